"""The benchmark's records and its one table: seconds, scores and agreement per task and side, then ratios."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any

from tabulate import tabulate

from benchmarks.common.provenance import machine, provenance

SIDES = ("evalkit", "floor", "lm-eval vllm", "lm-eval hf")
HEADERS = ["measure", "evalkit", "raw vLLM floor", "lm-eval vllm", "lm-eval hf", "target"]


@dataclass
class TaskResult:
    """One side's answers to one task's requests."""

    seconds: float  # spent on this task's requests (the request kind's method, or the engine calls)
    score: float | None = None
    lls: list[float] = field(default_factory=list)  # per document, per choice, in document order
    gens: list[str] = field(default_factory=list)  # per document, in document order
    max_delta: float | None = None  # max |log-likelihood - evalkit's| over all choices
    identical: int | None = None  # generations equal to evalkit's
    engine_seconds: float | None = None  # evalkit only: in its engine's generate/score calls
    calls: int = 0  # evalkit only: engine calls made
    note: str = ""  # evalkit only: where its seconds come from, and what its scoring paths did


def primary_metric(task_results: dict[str, Any]) -> tuple[str, float]:
    """The task's first metric, e.g. ("acc,none", 0.5)."""
    key = next(k for k in task_results if "," in k and "_stderr" not in k)
    return key, float(task_results[key])


def answers(samples: list[dict[str, Any]]) -> tuple[list[float], list[str]]:
    """(log-likelihoods of every choice, generated texts) in document order, from lm-eval's per-sample records."""
    lls: list[float] = []
    gens: list[str] = []
    seen = set()
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        if sample["doc_id"] in seen:  # one record per filter; the responses are the same
            continue
        seen.add(sample["doc_id"])
        for resp in sample["resps"]:
            if isinstance(resp[0], (list, tuple)):  # log-likelihood: [logprob, is_greedy]
                lls.append(float(resp[0][0]))
            else:
                gens.append(str(resp[0]))
    return lls, gens


def agree(side: TaskResult, reference: TaskResult) -> TaskResult:
    """side, with its agreement with evalkit's answers filled in."""
    if side.lls and len(side.lls) == len(reference.lls):
        side.max_delta = max(abs(a - b) for a, b in zip(side.lls, reference.lls))
    if side.gens and len(side.gens) == len(reference.gens):
        side.identical = sum(a == b for a, b in zip(side.gens, reference.gens))
    return side


def header(command: str, model: str, model_dir: str, versions: dict[str, Any]) -> list[str]:
    return [f"command: {command}",
            provenance(),
            f"machine: {machine()}, {platform.platform()}",
            f"model: {model} ({model_dir}), float32, max_model_len 4096, eager (in process)",
            f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other work slows every side)",
            "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v)]


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}e}" if 0 < abs(value) < 1e-2 else f"{value:.{digits}f}"
    return str(value)


def _ratio(a: float | None, b: float | None, target: float | None = None) -> str:
    if not a or not b:
        return ""
    r = a / b
    return f"{r:.2f}" + ("" if target is None else (" ✓" if r <= target else " ✗"))


# ratio targets (issue 11): evalkit's generation ≤ 1.05 x the floor; on the 400-request MC task, evalkit's
# scoring ≤ 0.5 x lm-eval's vllm backend and ≤ 1 x its hf backend; the default run under 60 s
# (issue 19) on the short-context 0-shot MC task, end to end with model load: ≤ 0.3 x vllm, ≤ 0.8 x hf
TARGETS = {("generate_until", "floor"): 1.05, ("bench_mc", "lm-eval vllm"): 0.5, ("bench_mc", "lm-eval hf"): 1.0}
END_TO_END_TARGETS = {"lm-eval vllm": 0.3, "lm-eval hf": 0.8}
TOTAL_TARGET = 60.0


def task_rows(task: str, kind: str, requests: int, results: dict[str, TaskResult]) -> list[list[str]]:
    ev = results["evalkit"]
    rows = [[f"**{task}** ({requests} {kind} requests): seconds", *(_cell(results[s].seconds if s in results
                                                                            else None) for s in SIDES), ""],
            [f"{task}: evalkit seconds inside its engine ({ev.calls} call{'s' if ev.calls != 1 else ''}{ev.note})", _cell(ev.engine_seconds),
             "", "", "", ""]]
    if ev.score is not None:
        rows.append([f"{task}: score", *(_cell(results[s].score if s in results else None, 3) for s in SIDES), ""])
    if kind == "loglikelihood":
        rows.append([f"{task}: max abs Δ log-likelihood vs evalkit", "",
                     *(_cell(results[s].max_delta if s in results else None) for s in SIDES[1:]), ""])
    else:
        rows.append([f"{task}: generations identical to evalkit's", f"{len(ev.gens)}",
                     *(_cell(results[s].identical if s in results else None) for s in SIDES[1:]), ""])
    targets = {s: TARGETS.get(("bench_mc" if task.endswith("bench_mc") else kind, s)) for s in SIDES[1:]}
    rows.append([f"{task}: evalkit seconds ÷ side", "",
                 *(_ratio(ev.seconds, results[s].seconds, targets[s]) if s in results else "" for s in SIDES[1:]),
                 "; ".join(f"{s} ≤ {t}" for s, t in targets.items() if t)])
    return rows


def table(tasks: list[tuple[str, str, int]], results: dict[str, dict[str, TaskResult]],
          totals: list[list[str]]) -> list[list[str]]:
    """All rows: per task (name, kind, requests) its seconds, scores, agreement and ratios; then totals."""
    rows: list[list[str]] = []
    for task, kind, requests in tasks:
        rows += task_rows(task, kind, requests, results[task])
    return rows + totals


def total_row(label: str, evalkit: float | None = None, floor: float | None = None, lm_vllm: float | None = None,
              lm_hf: float | None = None, target: str = "") -> list[str]:
    return [label, *(_cell(v) for v in (evalkit, floor, lm_vllm, lm_hf)), target]


def render(rows: list[list[str]], fmt: str) -> str:
    return tabulate(rows, headers=HEADERS, tablefmt=fmt, disable_numparse=True)
