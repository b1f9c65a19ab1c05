"""evalkit's HF engine in bfloat16 at batch 1 against batch 16 (float32 beside it, for scale), for
``benchmarks/gpu_check.py``.

The model is a small Llama with random weights (``torch.manual_seed(0)``) from a config built here, and a
byte-level BPE tokenizer trained here on the embedded tasks' text: the embedded model's weights are too big to
bring to a machine that cannot download them. Random weights give flat distributions, so the differences are
those of the kernels' arithmetic on this shape of model, not of a trained model's answers.

``python -m benchmarks.common.gpu_hf DEVICE`` prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BATCHES = (1, 16)


def tiny_model(folder: Path) -> dict:
    """A random 4-layer Llama and its tokenizer saved in folder; returns the config's shape."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [line for path in sorted((ROOT / "tasks").glob("*/test.jsonl")) for line in path.read_text().splitlines()]
    texts += [path.read_text() for path in sorted((ROOT / "tasks").glob("*/*.yaml"))]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    shape = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    return shape


def requests(engine) -> list:
    """Every choice of evalkit_facts and every answer of evalkit_arith after its description, as lm-eval asks."""
    import yaml

    from evalkit.contracts import ScoreRequest

    facts = [json.loads(line) for line in (ROOT / "tasks/evalkit_facts/test.jsonl").read_text().splitlines()]
    arith = [json.loads(line) for line in (ROOT / "tasks/evalkit_arith/test.jsonl").read_text().splitlines()]
    description = yaml.safe_load((ROOT / "tasks/evalkit_arith/evalkit_arith.yaml").read_text())["description"]
    pairs = [(f"Question: {d['question']}\nAnswer:", f" {choice}") for d in facts for choice in d["choices"]]
    pairs += [(f"{description}Question: {d['question']}\nAnswer:", f" {d['answer']}") for d in arith]
    asked = []
    for context, continuation in pairs:
        ids = engine.encode(context, add_special_tokens=True)
        asked.append(ScoreRequest(ids=tuple(ids + engine.encode(continuation, add_special_tokens=False)),
                                  start=len(ids)))
    return asked


def scored(model: str, device: str, dtype: str, batch_size: int) -> tuple[list, float]:
    from evalkit.engine.hf.engine import HFEngine

    started = time.perf_counter()
    engine = HFEngine(model=model, tokenizer=None, dtype=dtype, max_model_len=2048, batch_size=batch_size, seed=1234,
                      trust_remote_code=False, add_bos_token=None, engine_kwargs={"device_map": device})
    answers = engine.score(requests(engine))
    engine.close()
    return answers, time.perf_counter() - started


def batches(device: str) -> dict:
    """Per dtype: the largest and mean |log-likelihood difference| between batch 1 and batch 16, how many
    continuations differ at all, and how many greedy flags flip."""
    figures: dict = {"device": device, "model": "random 4-layer Llama (seed 0) built here; tokenizer trained here"}
    with tempfile.TemporaryDirectory() as scratch:
        figures["shape"] = tiny_model(Path(scratch))
        for dtype in ("bfloat16", "float32"):
            (one, t1), (many, t16) = (scored(scratch, device, dtype, size) for size in BATCHES)
            gaps = [abs(a.logprob - b.logprob) for a, b in zip(one, many)]
            figures[dtype] = {"continuations": len(gaps), "max_abs_diff": max(gaps),
                              "mean_abs_diff": sum(gaps) / len(gaps), "differing": sum(g > 0 for g in gaps),
                              "greedy_flips": sum(a.is_greedy != b.is_greedy for a, b in zip(one, many)),
                              "seconds": {"batch 1": round(t1, 2), "batch 16": round(t16, 2)}}
    return figures


if __name__ == "__main__":
    print(json.dumps(batches(sys.argv[1])), flush=True)
