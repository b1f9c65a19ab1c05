"""How long does ``python -m evalkit.compare REF CAND`` take on one task of many documents, row by row?

For each size (--documents) and each kind of row (--kinds), two run folders are written as evalkit writes them
(results.json and one samples file per task, each line the fields lm-eval logs for that kind of task: the
document, the request arguments, the responses, the hashes, evalkit's request record), one task whose one metric
is that row:

* ``acc``: a multiple-choice task's 0/1 accuracy (Tango's exact tests), 3 % of documents right in the
  reference only and 2.5 % in the candidate only;
* ``exact_match``: a generation task's 0/1 exact match (Tango's exact tests), its raw outputs differing where
  the score does;
* ``mean``: a generation task's mean of unbounded per-document values (a score difference in [-30, 30]: the
  sign-flip test);
* ``perplexity``: a rolling log-likelihood task's word perplexity ((log-likelihood, words) per document: the
  sign-flip test of the documents' log-likelihood changes).

Printed per size and row, reading the runs from their samples files' indexes (as a run writes them) and then from
the samples files themselves (as for a run written before indexes): the whole command's wall and CPU time and its
peak memory (``python -m evalkit.compare REF CAND --output DIR`` in a fresh process, as a user runs it, with
Python's bytecode cache, reports written; the fastest of --repeat runs, as timeit reports, since a shared machine
only ever adds time; CPU time is the figure to compare on a shared machine; the peak is the process's largest
resident set, its VmHWM), and the CPU time of its parts measured in this process with evalkit's own functions:
reading both runs (runs.load_run), pairing and checking their documents (paired.check_comparable), the row's
statistics (stats.compare_paired, the CPU time of all its threads) and the rest of the comparison
(paired.compare_family less the statistics: the pairs checked again, the details, the verdicts). Printed, not
asserted.

Run: python -m benchmarks.compare_speed [--documents 10000 100000] [--kinds acc exact_match mean perplexity]
[--seed 0] [--repeat 3]
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
from typing import Any

import numpy as np

from evalkit.compare import runs
from evalkit.compare.statistics import paired, stats, tost
from evalkit.run import sample_index

KINDS = ("acc", "exact_match", "mean", "perplexity")
SETUP = {  # kind -> (aggregation, higher_is_better)
    "acc": ("mean", True), "exact_match": ("mean", True), "mean": ("mean", True),
    "perplexity": ("weighted_perplexity", False)}
ROOT = Path(__file__).resolve().parents[1]


def line(kind: str, i: int, value: Any, rng: np.random.Generator) -> dict[str, Any]:
    """One samples-file line of document i as lm-eval logs it for the kind's task, with evalkit's record."""
    common = {"doc_id": i, "filter": "none", "metrics": [kind if kind != "perplexity" else "word_perplexity"],
              "doc_hash": f"{i:064x}", "prompt_hash": f"{i + 1:064x}", "target_hash": f"{i + 2:064x}"}
    question = f"Question {i}: which of these is the answer to a question of about this length?"
    if kind == "acc":
        logprobs = rng.normal(-8.0, 2.0, 4)
        request = {"kind": "loglikelihood", "prompt_tokens": 24, "output_tokens": 0, "finish_reason": None,
                   "raw_output": None, "output_ids": None, "requested_max_tokens": None, "max_tokens": None,
                   "clamped": False, "truncated_tokens": 0, "extra": {"continuation_tokens": 1}}
        return {**common, "doc": {"id": i, "question": question, "choices": ["dog", "cat", "cow", "fish"],
                                  "answer": 0}, "target": "0",
                "arguments": {f"gen_args_{j}": {"arg_0": f"{question}\nAnswer:", "arg_1": f" {c}"}
                              for j, c in enumerate(["dog", "cat", "cow", "fish"])},
                "resps": [[[str(lp), "False"]] for lp in logprobs],
                "filtered_resps": [[str(lp), "False"] for lp in logprobs], "acc": value,
                "prompt": f"{question}\nAnswer:", "raw_output": None, "scores": {"acc": value},
                "finish_reason": None, "prompt_tokens": 96, "output_tokens": 0, "requests": [request] * 4}
    if kind == "perplexity":
        words = int(rng.integers(50, 400))
        return {**common, "doc": {"page": f"{question} " * 4}, "target": "", "arguments": {"gen_args_0": {
            "arg_0": f"{question} " * 4}}, "resps": [[str(value[0])]], "filtered_resps": [str(value[0])],
            "word_perplexity": list(value), "raw_output": None, "finish_reason": None, "prompt_tokens": 0,
            "output_tokens": 0}
    output = " 13" if kind == "mean" or value == 1 else " 14"
    request = {"kind": "generate_until", "prompt_tokens": 66, "output_tokens": 4, "finish_reason": "stop",
               "raw_output": output, "output_ids": [216, 33, 36 + (output == " 14"), 198], "requested_max_tokens": 16,
               "max_tokens": 16, "clamped": False, "truncated_tokens": 0, "extra": {}}
    return {**common, "doc": {"id": i, "question": question, "answer": "13"}, "target": "13",
            "arguments": {"gen_args_0": {"arg_0": f"{question}\nAnswer:", "arg_1": {
                "until": ["\n", "Question:"], "max_gen_toks": 16, "do_sample": False}}},
            "resps": [[output]], "filtered_resps": [output.strip()], kind: value, "prompt": f"{question}\nAnswer:",
            "raw_output": output, "filtered_output": output.strip(), "scores": {kind: value}, "finish_reason": "stop",
            "prompt_tokens": 66, "output_tokens": 4, "requests": [request]}


def values(kind: str, n: int, rng: np.random.Generator) -> tuple[list[Any], list[Any]]:
    """The reference's and the candidate's per-document values of the kind's metric."""
    if kind in ("acc", "exact_match"):
        ref, cand = np.ones(n, dtype=int), np.ones(n, dtype=int)
        b, c = int(0.03 * n), int(0.025 * n)
        cand[:b], ref[b:b + c] = 0, 0
        return [float(x) for x in ref], [float(x) for x in cand]
    if kind == "mean":
        ref = rng.normal(0.0, 10.0, n).clip(-30, 30)
        changed = rng.random(n) < 0.1
        cand = np.where(changed, (ref + rng.normal(0.0, 5.0, n)).clip(-30, 30), ref)
        return ref.tolist(), cand.tolist()
    words = rng.integers(50, 400, n)
    ll = -words * np.log(15.0) * rng.normal(1.0, 0.1, n)
    moved = ll * (1 + rng.normal(0.0, 0.002, n))
    return [(float(a), int(w)) for a, w in zip(ll, words)], [(float(a), int(w)) for a, w in zip(moved, words)]


def score(kind: str, per_document: list[Any]) -> float:
    if kind != "perplexity":
        return float(np.mean(per_document))
    ll, words = np.array(per_document, dtype=float).T
    return float(np.exp(-ll.sum() / words.sum()))


def write_run(folder: Path, kind: str, per_document: list[Any], seed: int) -> None:
    """A run folder of one task (speed_<kind>) whose samples hold per_document as the kind's metric, with the
    samples file's index as a run writes it (evalkit/run/sample_index.py)."""
    folder.mkdir(parents=True)
    task, rng = f"speed_{kind}", np.random.default_rng(seed)
    metric = "word_perplexity" if kind == "perplexity" else kind
    aggregation, higher = SETUP[kind]
    with open(folder / f"samples_{task}.jsonl", "w", encoding="utf-8") as f:
        for i, value in enumerate(per_document):
            f.write(json.dumps(line(kind, i, value, rng)) + "\n")
    assert sample_index.write(folder / f"samples_{task}.jsonl", folder / f"samples_{task}.index.msgpack")
    results = {"results": {task: {f"{metric},none": score(kind, per_document)}},
               "configs": {task: {"metric_list": [{"metric": metric, "aggregation": aggregation,
                                                   "higher_is_better": higher}]}},
               "higher_is_better": {task: {metric: higher}}, "n-shot": {task: 0}, "versions": {task: 1.0},
               "evalkit": {"files": {"samples": {task: f"samples_{task}.jsonl"},
                                     "sample_index": {task: f"samples_{task}.index.msgpack"}},
                           "engine": {"engine_args": {"dtype": "float32"}, "hardware": {}}}}
    (folder / "results.json").write_text(json.dumps(results))


def command(reference: Path, candidate: Path, output: Path) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak resident MB) of python -m evalkit.compare REF CAND in a fresh process. The
    peak is the child's own high-water mark (VmHWM in /proc/PID/status, read every 20 ms until it ends): its
    ru_maxrss would also hold this process's, which Linux carries over to a child through its exec."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # Python's bytecode cache, as a user's Python keeps it by default
    start, peak = time.perf_counter(), 0
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, "-m", "evalkit.compare", str(reference), str(candidate),
                                  "--output", str(output)], stdout=out, stderr=err, text=True, cwd=ROOT, env=env)
        while True:  # the child's own CPU time from wait4; its ru_maxrss there would hold this process's too
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            peak = max(peak, high_water(child.pid))
            time.sleep(0.02)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if child.returncode not in (0, 1) or "# evalkit compare" not in stdout:  # 1 is a verdict, not a traceback
        raise SystemExit(f"python -m evalkit.compare failed ({child.returncode}): {stderr.strip()}")
    return wall, usage.ru_utime + usage.ru_stime, peak / 1024


def high_water(pid: int) -> int:
    """The peak resident set of process pid so far, in KiB (0 once it has ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)


def parts(reference: Path, candidate: Path) -> dict[str, float]:
    """CPU seconds of each part of the comparison, in this process: read, pair, statistics (every call of
    stats.compare_paired), the rest of compare_family; nothing reused from an earlier row (tost's cache)."""
    tost.tango_p.cache_clear()
    timed = {"statistics": 0.0}
    original = stats.compare_paired

    def compare_paired(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            timed["statistics"] += time.process_time() - start

    start = time.process_time()
    ref, cand = runs.load_run(reference), runs.load_run(candidate)
    timed["read"] = time.process_time() - start
    start = time.process_time()
    paired.check_comparable(ref, cand)
    timed["pair"] = time.process_time() - start
    stats.compare_paired = compare_paired
    try:
        start = time.process_time()
        (table, _), = paired.compare_family(ref, [cand])
        timed["rest"] = time.process_time() - start - timed["statistics"]
    finally:
        stats.compare_paired = original
    timed["verdict"] = table.verdict[0]
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs of the command; the fastest is printed")
    args = parser.parse_args()
    print("| documents | row | samples file (MB) | read from | command: wall (s) | command: CPU (s) | "
          "command: peak memory (MB) | read (s) | pair (s) | statistics (s) | rest (s) | verdict |")
    print("|---:|:---|---:|:---|---:|---:|---:|---:|---:|---:|---:|:---|")
    for n in args.documents:
        for kind in args.kinds:
            with tempfile.TemporaryDirectory() as tmp:
                runs_ = [Path(tmp) / "m" / "ref", Path(tmp) / "m" / "cand"]
                for run, per_document in zip(runs_, values(kind, n, np.random.default_rng(args.seed))):
                    write_run(run, kind, per_document, args.seed)
                size = (runs_[0] / f"samples_speed_{kind}.jsonl").stat().st_size / 1e6
                for source in ("index", "samples"):  # as a run writes it, then as one written before indexes
                    if source == "samples":
                        for run in runs_:
                            (run / f"samples_speed_{kind}.index.msgpack").unlink()
                    wall, cpu, peak = min(command(*runs_, Path(tmp) / "out") for _ in range(args.repeat))
                    t = parts(*runs_)
                    print(f"| {n:,} | {kind} | {size:.0f} | {source} | {wall:.2f} | {cpu:.2f} | {peak:.0f} | "
                          f"{t['read']:.2f} | {t['pair']:.2f} | {t['statistics']:.2f} | {t['rest']:.2f} | "
                          f"{t['verdict']} |", flush=True)


if __name__ == "__main__":
    main()
