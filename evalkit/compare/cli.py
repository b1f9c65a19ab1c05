"""``python -m evalkit.compare``: the command line over the comparison (paired.py), the token-level
divergence where both runs recorded it (divergence/), its localisation (locate/) and its report (pages/).
Exit 0, 1 when a candidate is worse (or changed) family-wise at --alpha (verdict.py) or, with --noise, its
divergence is beyond noise (divergence/verdict.py), 2 on unusable input.

Usage: ``python -m evalkit.compare <reference run> <candidate run> [more candidates] [--tolerance 0.02]
[--tolerance-for TASK/METRIC=VALUE] [--range-for TASK/METRIC=LO:HI] [--alpha 0.05] [--noise RUN] [--output DIR]
[--locate]`` (``--locate``: why each changed document changed, evalkit/compare/locate/passes.py).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from evalkit.compare import locate
from evalkit.compare.pages import html_page, markdown, plots
from evalkit.compare.statistics import verdict
from evalkit.compare.divergence import ALPHA as NOISE_ALPHA, between, family, records
from evalkit.compare.statistics.paired import compare_family, compare_runs
from evalkit.compare.runs import CompareError, Run, load_run
from evalkit.compare.statistics.verdict import Tolerances
from evalkit.run import results
from evalkit.untrusted import printable


DESCRIPTION = """\
Are two runs' scores the same within a tolerance, and if not, why did they change?

Compares a candidate run (or several: every point of a sweep) with a reference run of the same tasks,
documents and prompts, document by document. For every task, filter and metric it gives both scores, the
difference with its interval, and a verdict, family-wise at --alpha over every row: worse, changed, better,
lower, higher, equivalent or inconclusive. Where both runs recorded their top-k log-probabilities
(divergence_top_k), the token-level divergence beside it (llama.cpp's Mean KLD, Same top p, Δp, PPL ratio),
and with --noise RUN whether it lies beyond the engine's own noise. Below the tables: the documents that
flipped, where generations diverge, log-probability drift; --locate finds the first token where each changed
generation parted and why (near-tie, logit drift, other). The report is printed and written next to each candidate run
(compare-vs-<reference model>-<reference run id>.md and .html)."""

EPILOG = """\
examples:
  python -m evalkit.compare result/qwen2-7b/20261201-101500 result/qwen2-7b/20261202-093000
  python -m evalkit.compare REF CAND --tolerance 0.01 --tolerance-for mmlu/acc=0.005
  python -m evalkit.compare REF SWEEP_POINT_1 SWEEP_POINT_2 --locate
  python -m evalkit.compare REF CAND --noise REF_AGAIN     (REF_AGAIN: python -m evalkit.compare.noise)

exit codes:
  0  no row of any candidate is worse or changed (inconclusive rows exit 0 too, unless --require equivalent:
     read the verdicts and each row's mde), and with --noise no candidate's divergence is beyond noise
  1  a row is worse (shown below -tolerance) or changed (shown beyond it, direction unknown), at --alpha; with
     --require equivalent, a row not shown inside its tolerance or better; or,
     with --noise, a candidate's divergence is beyond noise at --divergence-alpha
  2  unusable input: a run missing, unreadable, truncated or damaged (a samples file missing, a document twice
     in one), runs not like-for-like (other tasks, versions, documents, prompts or targets), a per-document value
     null, NaN, infinite, text where a number belongs, or so large its sum overflows, or outside its --range-for,
     a metric one run scored on a document and the other did not, no row compared, a bad option (a tolerance not
     above 0, an absolute one not below 1, --alpha outside (0, 0.5), a range on a metric not averaged), an
     engine --locate cannot start, or a divergence verdict --noise cannot give (a noise run without a record,
     too few documents); 2 wins over 1
  a score results.json records that cannot be compared (no per-document values, a group score no mean of its
     tasks) is a row, inconclusive, whose note says why
  a report that cannot be written (a read-only folder) is said on stderr; the exit code stays the verdict's

more: docs/compare.md, docs/divergence.md and docs/locate.md"""


def tolerances_from(args: Any) -> Tolerances:
    """The tolerances asked for, each a number above 0 (an absolute one, for 0-1 metrics, below 1), whether given
    for every row or one task's metric: a negative one would call identical runs worse, zero or NaN would call
    nothing equivalent, an absolute 5 would call any change of a 0-1 metric equivalent; anything else a
    CompareError."""
    if not 0 < args.tolerance < 1:
        raise CompareError(f"--tolerance {args.tolerance}: the largest acceptable change of a 0-1 metric lies in "
                           "(0, 1), e.g. 0.02")
    if not 0 < args.relative_tolerance < math.inf:
        raise CompareError(f"--relative-tolerance {args.relative_tolerance}: a fraction above 0, e.g. 0.02 (2 %)")
    overrides = {}
    for text in args.tolerance_for:
        try:
            (task, metric), tolerance = verdict.parse_override(text)
        except ValueError as error:
            raise CompareError(str(error)) from None
        if tolerance.relative and not tolerance.value < math.inf:
            raise CompareError(f"--tolerance-for {text!r}: a relative tolerance is a percentage above 0, e.g. "
                               f"{task}/{metric}=2%")
        if not tolerance.relative and not tolerance.value < 1:
            raise CompareError(f"--tolerance-for {text!r}: the largest acceptable change of a 0-1 metric lies in "
                               f"(0, 1), e.g. {task}/{metric}=0.02; a relative tolerance ends in %, e.g. "
                               f"{task}/{metric}=2%")
        overrides[(task, metric)] = tolerance
    ranges = {}
    for text in getattr(args, "range_for", []):  # callers that build their own arguments may leave it out
        try:
            key, bounds = verdict.parse_range(text)
        except ValueError as error:
            raise CompareError(str(error)) from None
        ranges[key] = bounds
    return Tolerances(absolute=args.tolerance, relative=args.relative_tolerance, overrides=overrides, ranges=ranges)


def write_report(reference: Run, candidate: Run, files: dict[str, str], output: str | None,
                 name: str = "evalkit compare") -> None:
    """The report beside the candidate run (or in --output DIR, named after both runs). One that cannot be
    written is said on stderr, and the command goes on: the verdict was printed and decides the exit code."""
    stem = f"compare-vs-{reference.path.parent.name}-{reference.path.name}"
    folder = candidate.path if output is None else Path(output)
    if output is not None:
        stem = f"compare-{candidate.path.parent.name}-{candidate.path.name}-vs-{stem[len('compare-vs-'):]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        written = results.write_beside(folder, {f"{stem}{suffix}": text for suffix, text in files.items()})
    except OSError as error:
        print(f"{name}: the report could not be written to {printable(folder)} ({error.strerror or error}); "
              "the verdict above stands; --output DIR writes it elsewhere", file=sys.stderr)
        return
    print(f"\nwritten: {', '.join(printable(path) for path in written)}")  # a folder's name as text


def add_arguments(parser: Any) -> None:
    parser.add_argument("reference", help="reference run folder (or its results.json)")
    parser.add_argument("candidates", nargs="+", help="candidate run folder(s), e.g. every point of a sweep")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="largest acceptable change of a 0-1 metric (accuracy, exact match), absolute "
                             "(default 0.02)")
    parser.add_argument("--relative-tolerance", type=float, default=0.02, metavar="FRACTION",
                        help="largest acceptable change of an unbounded metric (perplexity, BLEU, bits_per_byte, any "
                             "score outside [-1, 1]) as a fraction of the reference's score (default 0.02: 2%%)")
    parser.add_argument("--tolerance-for", action="append", default=[], metavar="TASK/METRIC=VALUE",
                        help="the tolerance of one task (or group) and metric, either may be *: absolute, in (0, 1) "
                             "as --tolerance (mmlu/acc=0.01), or relative with %% (wikitext/word_perplexity=5%%); "
                             "repeatable")
    parser.add_argument("--range-for", action="append", default=[], metavar="TASK/METRIC=LO:HI",
                        help="the range a metric's per-document values lie in, known beforehand (a judge's score "
                             "1:10, a per-document BLEU 0:100; either name may be *): its mean is then tested by "
                             "betting, valid at every number of documents, instead of the sign-flip test (from 200 "
                             "documents); a value outside it is an error (exit 2); repeatable")
    parser.add_argument("--alpha", type=float, default=0.05,
                        help="family-wise false-alarm rate: the chance that a candidate with no change beyond the "
                             "tolerance anywhere fails (exit 1), Holm over every row compared (default 0.05)")
    parser.add_argument("--require", choices=["equivalent"],
                        help="equivalent: also fail (exit 1) unless every row is shown inside its tolerance "
                             "(equivalent, lower, higher) or better; an inconclusive row fails (default: only a row "
                             "shown worse fails)")
    parser.add_argument("--iterations", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--output", metavar="DIR",
                        help="write the reports into DIR (made if missing) instead of beside each candidate run")
    parser.add_argument("--noise", nargs="+", metavar="RUN",
                        help="the engine's own variation: RUN, a second run of the reference's config (python -m "
                             "evalkit.compare.noise), compared with the reference; or RUN_A RUN_B, two runs of one "
                             "config, compared with each other. Adds their score differences to the table and, "
                             "where the runs recorded divergence, the verdict whether the candidate's is beyond it")
    parser.add_argument("--divergence-alpha", type=float, default=NOISE_ALPHA, metavar="ALPHA",
                        help="false-alarm rate of the divergence verdict against --noise: a one-sided signed-rank "
                             f"test over documents, Holm over the candidates (default {NOISE_ALPHA})")


def noise_pair(args: Any, reference: Run) -> tuple[Run, Run] | None:
    """The two runs whose difference is the engine's own: (reference, RUN) or (RUN_A, RUN_B); None without."""
    if not args.noise:
        return None
    if len(args.noise) > 2:
        raise CompareError(f"--noise takes one run (a second run of the reference's config) or two, not "
                           f"{len(args.noise)}; put --noise after the candidates")
    return (reference, load_run(args.noise[0])) if len(args.noise) == 1 else tuple(map(load_run, args.noise))


def noise_columns(args: Any, pair: tuple[Run, Run], tolerances: Tolerances) -> pd.DataFrame:
    table, _ = compare_runs(*pair, tolerance=tolerances, iterations=args.iterations, seed=args.seed)
    return table[["task", "filter", "metric", "diff", "mcnemar_b", "mcnemar_c"]].rename(columns={
        "diff": "noise_diff", "mcnemar_b": "noise_b", "mcnemar_c": "noise_c"})


def divergences(args: Any, reference: Run, candidates: list[Run],
                pair: tuple[Run, Run] | None) -> list[between.Divergence]:
    """Each candidate's divergence from the reference (or the line why there is none), with the verdict
    against the noise pair when there is one; several candidates' verdicts are one family (Holm)."""
    if not 0 < args.divergence_alpha < 0.5:
        raise CompareError(f"--divergence-alpha {args.divergence_alpha}: must lie in (0, 0.5)")
    ref = records.read_run(reference)
    noise = tuple(map(records.read_run, pair)) if pair is not None else None  # read once for every candidate
    found = []
    for candidate in candidates:
        cand = records.read_run(candidate)
        d = between.divergence(ref, cand)
        if noise is not None:
            d = between.against_noise(d, ref, cand, noise, alpha=args.divergence_alpha)
        found.append(d)
    verdicts = family([d.verdict for d in found if d.verdict], alpha=args.divergence_alpha)
    tested = iter(verdicts)
    return [replace(d, verdict=next(tested)) if d.verdict else d for d in found]


def exit_code(tables: list[pd.DataFrame], found: list[between.Divergence], require: str | None = None) -> int:
    """2 where a divergence verdict is unusable, else 1 where a row fails (verdict.gate, with --require) or a
    divergence is beyond noise."""
    labels = {d.verdict.label for d in found if d.verdict}
    return 2 if "unusable" in labels else max(verdict.gate(tables, require), int("beyond noise" in labels))


def main(argv: list[str] | None = None, prog: str = "python -m evalkit.compare") -> int:
    """Exit 0, or 1 when a row of any candidate is worse (or changed) family-wise at --alpha or a divergence is
    beyond noise, or 2 on unusable input."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    locate.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        if not 0 < args.alpha < 0.5:
            raise CompareError(f"--alpha {args.alpha}: must lie in (0, 0.5)")
        tolerances, confidence = tolerances_from(args), 1.0 - args.alpha
        reference, candidates = load_run(args.reference), [load_run(path) for path in args.candidates]
        pair = noise_pair(args, reference)
        noise = noise_columns(args, pair, tolerances) if pair else None
        found = divergences(args, reference, candidates, pair)
        name = prog.removeprefix("python -m ")  # the command as typed starts each line said on stderr
        why = locate.from_args(args, reference, candidates, pair, name=name) if args.locate else {}
        compared = compare_family(reference, candidates, tolerance=tolerances, confidence=confidence,
                                  iterations=args.iterations, seed=args.seed)  # one family: every candidate's rows
        tables = [table for table, _ in compared]
        code = exit_code(tables, found, args.require)
        for candidate, table, (_, details), d in zip(candidates, tables, compared, found):
            text = markdown.markdown(reference.name, candidate.name, table, details, tolerance=args.tolerance,
                                     confidence=confidence, noise=noise, why=why.get(candidate.path),
                                     family=sum(map(len, tables)), comparisons=len(tables), divergence=d)
            images = {**plots.plots(table, details, args.tolerance), **plots.why_plots(why.get(candidate.path))}
            page = html_page.html(text, markdown.with_noise(table, noise), images, exit_code=code,
                                  tolerance=args.tolerance, confidence=confidence, reference=reference,
                                  candidate=candidate, details=details, why=why.get(candidate.path),
                                  family=sum(map(len, tables)), divergence=d)
            print(printable(text, keep="\n"))  # names and outputs from run folders: no terminal control
            write_report(reference, candidate, {".md": text, ".html": page}, args.output, name=name)
        for d in found:
            if d.verdict and d.verdict.label == "unusable":
                print(f"{prog.removeprefix('python -m ')}: error: the divergence of {d.candidate} against noise: "
                      f"{d.verdict.reason}", file=sys.stderr)
        return code
    except CompareError as error:
        print(f"{prog.removeprefix('python -m ')}: error: {printable(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
