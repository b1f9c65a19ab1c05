"""A check for a lent GPU machine (torch, transformers and Triton; no vLLM needed), in under 5 minutes.

1. **Fork after a CUDA check** (issue 27, item 1), each case in a fresh process that checks for CUDA, then forks
   and uses CUDA in the child, as vLLM forks its engine core and workers:

   * ``bare``: ``torch.cuda.is_available()`` as torch does it by default (``cudaGetDeviceCount``, which
     initialises CUDA): the child is expected to FAIL ("CUDA error: initialization error"), and evalkit's
     second line of defence (``environment.cuda_touched()``, libcuda.so in /proc/self/maps) to see it;
   * ``evalkit order``: ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` set first, as ``python -m evalkit`` and a try set
     it, then torch and the same check: the child is expected to WORK;
   * ``evalkit start path``: the same order, then transformers (and lm-eval where installed) imported and what
     a try calls before vLLM (``environment.accelerators()``, ``hardware()``, ``tuning.this_machine()``,
     ``cuda_touched()``): the child is expected to WORK, and cuda_touched() to say False.

2. **The HF reference engine on the GPU against the CPU** (float32 both): evalkit's own HFEngine scores the
   embedded tasks' continuations (each choice of evalkit_facts, each answer of evalkit_arith after its few-shot
   description) on both; the largest difference of log-likelihoods must stay under 1e-3 and the greedy flags agree.
   The model: ``--model PATH``, else the embedded model where it was materialised ($EVALKIT_CACHE), else a small
   randomly initialised Llama with a tokenizer trained here on the tasks' text (the machine may be offline).

Run from the repository root: ``python -m benchmarks.gpu_check [--model PATH]``. Exit status: 0 every check as
expected, 1 one was not (or could not run), 2 no NVIDIA GPU or no CUDA build of torch here (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from evalkit.engine.machine import gpus  # standard library only: counts GPUs through NVML, never CUDA

ROOT = Path(__file__).resolve().parent.parent

FORK_CHILD = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        import torch
        x = torch.ones(1024, device="cuda") * 2
        torch.cuda.synchronize()
        print("child: CUDA works", float(x.sum()), flush=True)
        os._exit(0)
    except Exception as error:
        print(f"child: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
        os._exit(1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
CHECK = "import torch\nprint('is_available:', torch.cuda.is_available(), flush=True)\n"
TOUCHED = "from evalkit.engine.machine.environment import cuda_touched\nprint('cuda_touched:', cuda_touched(), flush=True)\n"
EVALKIT_FIRST = "from evalkit.engine.machine.environment import use_nvml_for_cuda_checks\nuse_nvml_for_cuda_checks()\n"
START_PATH = """
import importlib.util
import transformers
if importlib.util.find_spec("lm_eval"):
    import lm_eval.api.model
from evalkit.engine.machine import environment
print("accelerators:", environment.accelerators(), "gpus:", environment.hardware().get("gpus"), flush=True)
try:
    from evalkit.engine.machine import tuning
    print("this_machine:", tuning.this_machine().device, flush=True)
except ImportError as error:  # tuning needs hydra-core (evalkit.config)
    print("this_machine: not checked,", error, flush=True)
"""
# (name, code, child expected to work, cuda_touched() expected before the fork)
FORK_CASES = [
    ("bare", CHECK + TOUCHED, False, True),
    ("evalkit order", EVALKIT_FIRST + CHECK + TOUCHED, True, False),
    ("evalkit start path", EVALKIT_FIRST + CHECK + START_PATH + TOUCHED, True, False),
]
TOLERANCE = 1e-3  # nats per continuation, float32 on GPU against float32 on CPU


def fork_case(name: str, code: str, works: bool, touched: bool) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code + FORK_CHILD], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    seen_touched = f"cuda_touched: {touched}" in lines
    ok = (done.returncode == 0) == works and seen_touched
    expected = "child works" if works else "child fails"
    print(f"[{'PASS' if ok else 'FAIL'}] fork, {name} (expected: {expected}, cuda_touched={touched}): "
          f"{' | '.join(lines) or done.stderr.strip()[-300:]}", flush=True)
    return ok


def tiny_model(folder: Path) -> str:
    """A small random Llama and a byte-level BPE tokenizer trained on the embedded tasks' text (offline)."""
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
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=0, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def find_model(asked: str | None, scratch: Path) -> tuple[str, str]:
    if asked:
        return asked, "as given"
    cache = Path(os.environ.get("EVALKIT_CACHE", Path.home() / ".cache" / "evalkit")) / "smollm2-135m-instruct"
    if (cache / "model.safetensors").is_file():
        return str(cache), "the embedded model"
    return tiny_model(scratch), "a random 4-layer Llama (the embedded model is not here, and this machine may be offline)"


def requests(engine) -> list:
    """Every choice of evalkit_facts and every answer of evalkit_arith (after its description), as lm-eval asks."""
    import yaml

    from evalkit.contracts import ScoreRequest

    asked = []
    facts = [json.loads(line) for line in (ROOT / "tasks/evalkit_facts/test.jsonl").read_text().splitlines()]
    arith = [json.loads(line) for line in (ROOT / "tasks/evalkit_arith/test.jsonl").read_text().splitlines()]
    description = yaml.safe_load((ROOT / "tasks/evalkit_arith/evalkit_arith.yaml").read_text())["description"]
    pairs = [(f"Question: {d['question']}\nAnswer:", f" {choice}") for d in facts for choice in d["choices"]]
    pairs += [(f"{description}Question: {d['question']}\nAnswer:", f" {d['answer']}") for d in arith]
    for context, continuation in pairs:
        ids = engine.encode(context, add_special_tokens=True)
        more = engine.encode(continuation, add_special_tokens=False)
        asked.append(ScoreRequest(ids=tuple(ids + more), start=len(ids)))
    return asked


def hf_engine(model: str, device: str):
    from evalkit.engine.hf.engine import HFEngine

    return HFEngine(model=model, tokenizer=None, dtype="float32", max_model_len=2048, batch_size=None, seed=1234,
                    trust_remote_code=False, add_bos_token=None, engine_kwargs={"device_map": device})


def hf_on_gpu_and_cpu(asked_model: str | None) -> bool:
    try:
        import evalkit.engine.hf.engine  # noqa: F401  (evalkit.config needs hydra-core and omegaconf)
        import yaml  # noqa: F401
    except ImportError as error:
        print(f"[FAIL] HF engine on the GPU: not run, {error} (pip install -e . on this machine first)", flush=True)
        return False
    with tempfile.TemporaryDirectory() as scratch:
        model, which = find_model(asked_model, Path(scratch))
        print(f"HF engine: model {model} ({which})", flush=True)
        scored = {}
        for device in ("cpu", "cuda"):
            started = time.perf_counter()
            engine = hf_engine(model, device)
            asked = requests(engine)
            scored[device] = engine.score(asked)
            engine.close()
            print(f"HF engine on {device}: {len(asked)} continuations scored in {time.perf_counter() - started:.1f} s",
                  flush=True)
    gaps = [abs(a.logprob - b.logprob) for a, b in zip(scored["cpu"], scored["cuda"])]
    flips = sum(a.is_greedy != b.is_greedy for a, b in zip(scored["cpu"], scored["cuda"]))
    ok = max(gaps) < TOLERANCE and flips == 0
    print(f"[{'PASS' if ok else 'FAIL'}] HF engine, GPU float32 against CPU float32: largest log-likelihood "
          f"difference {max(gaps):.2e} (mean {sum(gaps) / len(gaps):.2e}, tolerance {TOLERANCE:g}), "
          f"greedy flags differing: {flips} of {len(gaps)}", flush=True)
    return ok


def cuda_torch() -> str | None:
    """torch's CUDA version (read without initialising CUDA), or None for a CPU build."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda)"], capture_output=True,
                          text=True, timeout=120)
    version = done.stdout.strip()
    return version if done.returncode == 0 and version not in ("", "None") else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder for the HF comparison (default: see the module docstring)")
    args = parser.parse_args()
    found, how = gpus.discover()
    if not found:
        print(f"gpu_check: no NVIDIA GPU visible here ({how}); run it on a machine with one", flush=True)
        return 2
    version = cuda_torch()
    if version is None:
        print("gpu_check: torch here is not a CUDA build (torch.version.cuda is None); install a CUDA torch", flush=True)
        return 2
    print(f"gpu_check: {gpus.summary(found, how)}; torch CUDA {version}", flush=True)
    started = time.perf_counter()
    results = [fork_case(*case) for case in FORK_CASES]
    try:
        results.append(hf_on_gpu_and_cpu(args.model))
    except Exception as error:  # a missing package (accelerate for device_map), a driver error: one line
        print(f"[FAIL] HF engine on the GPU: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
        results.append(False)
    print(f"gpu_check: {sum(results)} of {len(results)} checks as expected in {time.perf_counter() - started:.0f} s",
          flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
