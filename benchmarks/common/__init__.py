"""What the benchmarks share: the model and task folder every one runs on, and the runners of each side.

* ``table``: the records of one task's answers per side and the one table of ``benchmarks.run``;
* ``evalkit_side``: evalkit's engine wrapped by a recorder, and the raw vLLM floor it is held to;
* ``lm_eval_side``: lm-eval's own vllm and hf backends on the same documents;
* ``served_side``: a vLLM server's runs (evalkit served, lm-eval's local-completions) and its prefix cache;
* ``divergence_runs``: the runs that ``benchmarks.divergence_verdict`` compares, made and kept in a folder;
* ``verdict_trials``, ``verdict_families``: the simulated comparisons of ``benchmarks.verdict``;
* ``provenance``: the date, machine and commit a benchmark's output names.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository
TASKS_DIR = ROOT / "benchmarks" / "tasks"  # the benchmark's own lm-eval tasks (evalkit_bench_*)
EMBEDDED = "embedded://smollm2-135m-instruct"  # the default model, SmolLM2-135M-Instruct
