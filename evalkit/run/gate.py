"""The in-run gate (``gate.reference=RUN``): a run that stops as soon as it is decided against a reference run.

Each task's documents are evaluated in a random order fixed by gate.seed (recorded), gate.chunk more of each task
per look; lm-eval evaluates each look's documents (simple_evaluate's ``samples=``) on the one engine the run
started, whose request store answers every document an earlier run of the command already computed. After each
look every gated row (a task, filter and metric whose reference values all lie in [0, 1]: acc, acc_norm,
exact_match, F1) is read as paired differences against the reference's per-document values, and
evalkit/run/sequence.py's confidence sequence over the task's N documents decides it at level alpha / rows
(Bonferroni: a wrong `worse` or `equivalent` anywhere in the family, at any look, has chance at most alpha). Rows
of unbounded metrics (perplexities, BLEU) are recorded but never stop the run. The run stops at the first look
where a row is `worse`, or, with gate.require=equivalent, where every row is `equivalent`; else it runs to the
end, where each row's interval is its exact difference over the N documents.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from evalkit.config import ConfigError, EvalConfig
from evalkit.run.results import sample_files
from evalkit.run.sequence import look
from evalkit.untrusted import OutsideFolder, TooLarge, inside, json_data, printable, read_bounded


@dataclass(frozen=True)
class Row:
    task: str
    filter: str
    metric: str

    def __str__(self) -> str:
        return f"{self.task}/{self.metric} [{self.filter}]"


@dataclass
class Plan:
    """What the gate reads against: the reference's values per row and document, each task's order and size."""

    reference: str
    run_id: str
    rows: list[Row]
    values: dict[Row, dict[int, float]]  # row -> reference document index -> value
    hashes: dict[str, dict[int, tuple[str, str]]]  # task -> document index -> the reference's doc and prompt hashes
    orders: dict[str, list[int]]  # task -> document indices in the order evaluated
    looks: list[dict[str, Any]] = field(default_factory=list)


def _bad(reference: str, why: str) -> ConfigError:
    return ConfigError(f"gate.reference={reference}: {why}")


def _reference_samples(folder: Path, reference: str) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    try:
        results = json_data(read_bounded(inside(folder, "results.json")).decode("utf-8"))
        files = sample_files(folder, results)
        # lines end at "\n" only, as lm-eval writes them: an output's U+2028 or \x85 is text, not a line's end
        samples = {task: [json_data(line) for line in read_bounded(path).decode("utf-8").split("\n") if line.strip()]
                   for task, path in files.items()}
    except FileNotFoundError as error:
        raise _bad(reference, f"{Path(error.filename or 'results.json').name} is missing; name a run folder "
                              "(result/<model>/<run id>) written with log_samples=true") from None
    except (OutsideFolder, TooLarge) as error:
        raise _bad(reference, str(error)) from None
    except (OSError, ValueError, AttributeError, TypeError) as error:  # ValueError: damaged or crafted JSON
        raise _bad(reference, f"its files cannot be read ({error})") from None
    if not samples:
        raise _bad(reference, "the run kept no samples; rerun the reference with log_samples=true")
    return results, samples


def documents(task: Any, limit: float | None) -> int:
    """The documents of task this run evaluates: all, or limit's share as lm-eval counts it."""
    n = len(task.eval_docs)
    if limit is None:
        return n
    return min(n, int(limit) if limit >= 1 else int(math.ceil(n * limit)))


def plan(cfg: EvalConfig, tasks: list[Any]) -> Plan:
    """The gate's plan, read before any engine starts: ConfigError where the reference cannot be read, holds
    other tasks, or lacks a document this run evaluates."""
    reference = str(cfg.gate.reference)
    folder = Path(reference).expanduser()
    if not folder.is_dir():
        raise _bad(reference, "no such folder; name a run folder (result/<model>/<run id>)")
    results, samples = _reference_samples(folder, reference)
    if any(isinstance(task, str) for task in tasks):
        raise ConfigError("gate.reference needs tasks by their own names, not groups: list the group's tasks")
    names = {task.config.task: task for task in tasks}
    if set(names) != set(samples):
        raise _bad(reference, f"it ran tasks {sorted(samples)}, this run {sorted(names)}: the gate compares the same "
                              "tasks")
    rows, values, hashes, orders = [], {}, {}, {}
    for name, task in sorted(names.items()):
        n = documents(task, cfg.limit)
        by_doc: dict[int, dict[str, Any]] = {}
        for line in samples[name]:
            by_doc.setdefault(int(line["doc_id"]), {})[str(line.get("filter"))] = line
        missing = [i for i in range(n) if i not in by_doc]
        if missing:
            raise _bad(reference, f"task {printable(name)} has {len(by_doc)} documents and this run evaluates {n}: "
                                  f"document {missing[0]} is missing (pass a smaller limit=, or rerun the reference)")
        hashes[name] = {i: _hashes(next(iter(by_doc[i].values()))) for i in range(n)}
        for filter_name, line in by_doc[0].items():
            for metric in line.get("metrics") or []:
                row = Row(name, filter_name, metric)
                column = {i: by_doc[i].get(filter_name, {}).get(metric) for i in range(n)}
                if all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in column.values()):
                    rows.append(row)
                    values[row] = {i: float(v) for i, v in column.items()}
        orders[name] = [int(i) for i in np.random.default_rng(cfg.gate.seed).permutation(n)]
    if not rows:
        raise _bad(reference, "no row has values in [0, 1] (acc, exact_match, ...) to gate on")
    return Plan(reference=f"{folder.resolve().parent.name}/{folder.resolve().name}",
                run_id=str((results.get("evalkit") or {}).get("run_id")), rows=rows, values=values, hashes=hashes,
                orders=orders)


def _hashes(line: dict[str, Any]) -> tuple[str, str]:
    return str(line.get("doc_hash")), str(line.get("prompt_hash"))


def differences(plan: Plan, row: Row, samples: list[dict[str, Any]]) -> np.ndarray:
    """The row's candidate-minus-reference values, in the order drawn; the documents' hashes checked."""
    order = plan.orders[row.task]
    by_doc = {s["doc_id"]: s for s in samples if str(s.get("filter")) == row.filter}
    out = []
    for i in order[:len(by_doc)]:
        line = by_doc[i]
        doc, prompt = plan.hashes[row.task][i]
        if _hashes(line)[0] != doc:
            raise ConfigError(f"gate.reference={plan.reference}: task {row.task}'s document {i} is not the "
                              "reference's (its hash differs): the gate compares the same documents")
        if _hashes(line)[1] != prompt:
            raise ConfigError(f"gate.reference={plan.reference}: task {row.task}'s document {i} was asked with "
                              "another prompt than the reference's (few-shot examples drawn at random depend on "
                              "the documents evaluated before it): gate a task whose prompts are fixed per "
                              "document, or pass num_fewshot=0")
        value = float(line[row.metric])
        if not 0 <= value <= 1:
            raise ConfigError(f"{row}: a value {value} outside [0, 1]; the gate reads only 0-1 metrics")
        out.append(value - plan.values[row][i])
    return np.array(out)


def renumbered(records: dict[tuple[str, int], list[Any]], selected: dict[str, list[int]]
               ) -> dict[tuple[str, int], list[Any]]:
    """lm-eval numbers the requests of ``samples=`` by the documents' rank among those selected (0, 1, ...) and
    gives each sample its own index (selected sorted); the request records put under their documents' own indices,
    so the samples file joins them and pairs with the reference's documents."""
    return {(task, selected[task][doc] if task in selected else doc): r for (task, doc), r in records.items()}


class Indices(list):
    """Document indices for simple_evaluate's ``samples=``: lm-eval asks ``i in samples`` of every document of the
    task, which a list answers in O(len) (hours for a prefix of 100,000 documents); a set answers at once."""

    def __init__(self, indices: list[int]) -> None:
        super().__init__(sorted(indices))
        self._set = frozenset(self)

    def __contains__(self, index: object) -> bool:
        return index in self._set


def run(cfg: EvalConfig, plan: Plan, evaluate: Callable[[dict[str, list[int]] | None], tuple[Any, dict[str, Any]]]
        ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Look after look until the family is decided or every document is evaluated; (lm, outcome) of every document
    evaluated, its doc ids the reference's, and the gate's record. evaluate(samples) runs lm-eval on those documents
    of the tasks samples names (None: every document). Each look evaluates only its new documents; once decided,
    one last evaluation of all those drawn (every answer from the request store) gives the run's results and
    samples: lm-eval's work grows with the documents, not with their square over the looks."""
    gate, alpha = cfg.gate, cfg.gate.alpha / len(plan.rows)
    total = sum(len(o) for o in plan.orders.values())
    drawn = {t: 0 for t in plan.orders}
    seen: dict[str, list[dict[str, Any]]] = {t: [] for t in plan.orders}
    while True:
        new = {t: Indices(o[drawn[t]:drawn[t] + gate.chunk]) for t, o in plan.orders.items() if drawn[t] < len(o)}
        _, outcome = evaluate(new)
        for task, indices in new.items():
            seen[task].extend(outcome["samples"][task])
            drawn[task] += len(indices)
        looks = []
        for row in plan.rows:
            d = differences(plan, row, seen[row.task])
            looks.append((row, look(d, len(plan.orders[row.task]), tolerance=gate.tolerance, alpha=alpha,
                                    equivalence=gate.require == "equivalent")))
        done = sum(drawn.values())
        plan.looks.append({"documents": dict(drawn), "rows": [{**asdict(row), **asdict(one)} for row, one in looks]})
        worst_row, worst = min(looks, key=lambda pair: pair[1].high)
        verdict = decide([one for _, one in looks], gate.require, finished=done == total)
        print(f"evalkit: gate: {done} of {total} documents ({total - done} left); worst row {worst_row}: "
              f"{worst.mean:+.3f}, {1 - 2 * alpha:.1%} sequence [{worst.low:+.3f}, {worst.high:+.3f}] "
              f"(tolerance {gate.tolerance:g}){f': {verdict}' if verdict else ''}", file=sys.stderr, flush=True)
        if verdict:
            selected = None if done == total else {t: Indices(o[:drawn[t]]) for t, o in plan.orders.items()}
            lm, outcome = evaluate(selected)
            if selected is not None:
                lm.records = renumbered(lm.records, selected)
            return lm, outcome, record(cfg, plan, verdict, worst_row, stopped=done < total)


def decide(looks: list[Any], require: str, *, finished: bool) -> str | None:
    """The family's verdict at this look, None while it is undecided and documents are left."""
    if any(one.verdict == "worse" for one in looks):
        return "worse"
    if require == "equivalent" and all(one.verdict == "equivalent" for one in looks):
        return "equivalent"
    if finished:
        return "not worse" if require == "not_worse" else "not equivalent"
    return None


def record(cfg: EvalConfig, plan: Plan, verdict: str, worst: Row, *, stopped: bool) -> dict[str, Any]:
    """The gate's record in results.json (evalkit.gate)."""
    last = plan.looks[-1]
    reason = {"worse": f"{worst} is worse than the reference beyond -{cfg.gate.tolerance:g}",
              "equivalent": f"every row is within ±{cfg.gate.tolerance:g} of the reference",
              "not worse": "every document evaluated, no row worse",
              "not equivalent": "every document evaluated, not every row within the tolerance"}[verdict]
    return {"reference": plan.reference, "reference_run_id": plan.run_id, "tolerance": cfg.gate.tolerance,
            "alpha": cfg.gate.alpha, "alpha_per_row": cfg.gate.alpha / len(plan.rows), "require": cfg.gate.require,
            "seed": cfg.gate.seed, "chunk": cfg.gate.chunk, "verdict": verdict, "reason": reason,
            "stopped_early": stopped, "exit_code": 1 if verdict in ("worse", "not equivalent") else 0,
            "documents": last["documents"], "of": {t: len(o) for t, o in plan.orders.items()},
            "order": plan.orders, "looks": plan.looks}
