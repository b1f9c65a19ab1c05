"""A vLLM server's side of the benchmarks (benchmarks.served, chain_cost, num_mc_cost): one evalkit run of a task
on the served engine, the same task through lm-eval's local-completions, the server's prefix cache emptied, and
evalkit_bench_num_mc's continuations as score requests."""

from __future__ import annotations

import json
import tempfile
import time
from typing import Any

from benchmarks.common import TASKS_DIR
from benchmarks.common.table import answers

# the same work on both sides: lm-eval records no token-level divergence, so neither does evalkit here (a run's
# default records it: +26 % on vLLM offline, docs/divergence.md "What recording costs"; served, its traced scores
# read whole prompts with prompt_logprobs=20 instead of chaining, docs/served.md)
SETTINGS = ["+engine_kwargs.enforce_eager=true", f"tasks_dirs=[{TASKS_DIR}]", "resume=false", "divergence_top_k=0"]
NUM_MC = TASKS_DIR / "evalkit_bench_num_mc" / "test.jsonl"


def evalkit_task(cfg_args: list[str], engine: Any, task: str) -> tuple[float, dict[str, Any], list, list]:
    """(seconds, results of task, log-likelihoods, generations) of one evalkit run of task on engine."""
    from evalkit.config import compose_config
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate
    from evalkit.run.results import read_samples

    started = time.perf_counter()
    run_dir = evaluate(compose_config([*cfg_args, f"tasks=[{task}]"]), engine_factory=lambda c, d: KeptRunning(engine))
    seconds = time.perf_counter() - started
    results = json.loads((run_dir / "results.json").read_text())["results"][task]
    return (seconds, results, *answers(read_samples(run_dir, task)))


def lm_eval_task(server_url: str, model: str, model_dir: str, task: str, limit: int,
                 concurrent: int = 8, batch_size: int = 8) -> tuple[float, dict, list, list]:
    """The same for lm-eval's local-completions on the server: concurrent requests in flight, batch_size prompts
    in each."""
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.loggers import EvaluationTracker

    from evalkit.harness.tasks import load_tasks

    args = {"model": model, "base_url": f"{server_url}/completions", "tokenizer_backend": "huggingface",
            "tokenizer": model_dir, "tokenized_requests": True, "num_concurrent": concurrent, "max_retries": 3,
            "max_length": 4096}
    # the client is built before the clock (its tokenizer loaded), as evalkit's engine is started before its own;
    # the tasks are loaded inside it, and the results and samples written as lm-eval's CLI writes them with
    # --output_path --log_samples, as evalkit's evaluate() loads its tasks and writes its run folder inside its clock
    client = get_model("local-completions").create_from_arg_obj(args, {"batch_size": batch_size,
                                                                      "max_batch_size": None, "device": None})
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        tracker = EvaluationTracker(output_path=out)
        manager, built = load_tasks([task], task_data={}, extra_dirs=[str(TASKS_DIR)])
        outcome = simple_evaluate(model=client, tasks=built, task_manager=manager, limit=limit, log_samples=True,
                                  bootstrap_iters=0, evaluation_tracker=tracker)
        samples = outcome.pop("samples")
        tracker.save_results_aggregated(results=outcome, samples=samples)
        for name in outcome["configs"]:
            tracker.save_results_samples(task_name=name, samples=samples[name])
        seconds = time.perf_counter() - started
    outcome["samples"] = samples
    return (seconds, outcome["results"][task], *answers(outcome["samples"][task]))


def reset_prefix_cache(root: str) -> None:
    """Empty the server's prefix cache (a development endpoint, VLLM_SERVER_DEV_MODE=1)."""
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(f"{root}/reset_prefix_cache", method="POST"), timeout=60):
        pass


def num_mc(served, docs: int = 30) -> list:
    """evalkit_bench_num_mc's continuations as its task writes them ("Question: ...\\nAnswer:", " <choice>")."""
    from evalkit.contracts import ScoreRequest

    requests = []
    for line in NUM_MC.read_text().splitlines()[:docs]:
        doc = json.loads(line)
        context = tuple(served.encode(f"Question: {doc['question']}\nAnswer:", True))
        requests += [ScoreRequest(ids=context + tuple(served.encode(f" {c}", False)), start=len(context))
                     for c in doc["choices"]]
    return requests
