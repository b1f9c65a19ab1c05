"""Verdicts from the one-sided tests, family-wise over every row of a comparison, and the tolerance of each row.
Pure functions, no I/O.

Each row carries the p-values of its one-sided tests against its tolerance (stats.tost_p_values). Every kind of
claim is adjusted over all the rows compared at once: worse and better each by Holm's procedure (Holm 1979, "A
simple sequentially rejective multiple test procedure", Scand J Statist 6:65-70) with Tarone's count
(tarone_holm); equivalent, lower and higher together as one family (inside_family: each row's equivalence, then
its direction, at alpha / 2 a side since either could be claimed). Under Tarone's count a row where no
document's value changed cannot be shown worse or better and does not count, so copies of the reference
compared beside a candidate do not dilute it. For that screen to keep the level, a 0/1 row's p_worse and
p_better are those given that some document changed (tost.tango_p's given_change; other methods' rows change on
some document whenever they can be worse).
benchmarks/family_padding.py measures it. The chance that any row is wrongly called `worse`, and the command
wrongly exits 1, is at most alpha:

worse         shown beyond -tolerance (p_worse)                                                      exits 1
changed       direction unknown: shown beyond the tolerance either way                                exits 1
better        shown beyond +tolerance (p_better)
lower/higher  shown inside +-tolerance (p_equivalent), then below/above 0 (the smaller of p_lower and p_higher,
              doubled), in one family with equivalent
equivalent    shown inside +-tolerance, no difference from 0 shown
inconclusive  none of these shown (too few documents, or a zero-width bootstrap: no evidence either way)

A bootstrap p-value cannot go below 1 / (resamples + 1) (its p_floor); where that floor times the rows its claim
is adjusted over (for worse and better, Tarone's count of the rows that could be worse) is not below alpha, the
row's note says that its resolution, not the data, limits it (bootstrap.resamples_for sizes the resamples so
that this happens only to corpus-level rows, whose resamples are bounded). Where a row's own test shows a claim
(its interval beyond or inside the tolerance) that the family-wise verdict does not make, its note says that the
adjustment is why (family_note).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

FAILING = ("worse", "changed")  # verdicts that make the command exit 1
VERDICTS = ("worse", "changed", "better", "lower", "higher", "equivalent", "inconclusive")
UNBOUNDED = frozenset({"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "bleu", "chrf", "ter"})
"""Metrics with no fixed 0-1 range, compared relatively by default (lm-eval's BLEU, chrF and TER are 0-100+)."""


@dataclass(frozen=True)
class Tolerance:
    value: float
    relative: bool  # a fraction of the reference's score, the difference compared as (candidate - reference) / |reference|

    def __str__(self) -> str:
        return f"±{self.value:g}" + (" rel" if self.relative else "")


@dataclass(frozen=True)
class Tolerances:
    """The tolerance of each row: absolute for 0-1 metrics, relative for unbounded ones, overridden per task/metric;
    and the ranges users declare a metric's per-document values to lie in (--range-for), which let a mean of them
    be tested by betting, valid at every number of documents, instead of the sign-flip test."""

    absolute: float = 0.02
    relative: float = 0.02
    overrides: dict[tuple[str, str], Tolerance] = field(default_factory=dict)  # (task or *, metric or *)
    ranges: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # (task or *, metric or *)

    def unused(self, rows: set[tuple[str, str]], declared: dict | None = None) -> list[str]:
        """Overrides (or declared: ranges) that match no (task, metric) compared: a misspelt name."""
        return [f"{t}/{m}" for t, m in (self.overrides if declared is None else declared)
                if not any(t in ("*", task) and m in ("*", metric) for task, metric in rows)]

    def range_of(self, names: list[str], metric: str) -> tuple[float, float] | None:
        """The range declared for metric's values on a row's documents: names are the row's task (or group) and
        the groups it lies in, each of whose ranges holds for its documents, so the range is the intersection of
        every one declared for any of them or for every task (*); None where none is."""
        found = [self.ranges[key] for key in {(n, m) for n in [*names, "*"] for m in (metric, "*")}
                 if key in self.ranges]
        if not found:
            return None
        return max(lo for lo, _ in found), min(hi for _, hi in found)

    def of(self, task: str, metric: str, reference_score: float) -> Tolerance:
        for key in ((task, metric), (task, "*"), ("*", metric), ("*", "*")):
            if key in self.overrides:
                return self.overrides[key]
        outside = not math.isnan(reference_score) and not -1.0 <= reference_score <= 1.0
        if metric in UNBOUNDED or outside:
            return Tolerance(self.relative, relative=True)
        return Tolerance(self.absolute, relative=False)


def parse_override(text: str) -> tuple[tuple[str, str], Tolerance]:
    """TASK/METRIC=VALUE (either name may be *): VALUE absolute, or relative with a % (5% = 0.05 of the reference)."""
    try:
        names, value = text.rsplit("=", 1)
        task, metric = names.split("/", 1)
        relative = value.strip().endswith("%")
        number = float(value.strip().rstrip("%")) / (100 if relative else 1)
    except ValueError:
        raise ValueError(f"--tolerance-for {text!r}: expected TASK/METRIC=VALUE, e.g. mmlu/acc=0.01 or "
                         "wikitext/word_perplexity=5%") from None
    if not task or not metric or not number > 0:
        raise ValueError(f"--tolerance-for {text!r}: needs a task, a metric and a tolerance above 0")
    return (task, metric), Tolerance(number, relative)


def parse_range(text: str) -> tuple[tuple[str, str], tuple[float, float]]:
    """TASK/METRIC=LO:HI (either name may be *): the metric's per-document values lie in [LO, HI], LO < HI."""
    try:
        names, value = text.rsplit("=", 1)
        task, metric = names.split("/", 1)
        lo, hi = (float(v) for v in value.split(":"))
    except ValueError:
        raise ValueError(f"--range-for {text!r}: expected TASK/METRIC=LO:HI, e.g. mt_bench/score=1:10 or "
                         "*/bleu_max=0:100") from None
    if not task or not metric or not -math.inf < lo < hi < math.inf:
        raise ValueError(f"--range-for {text!r}: needs a task, a metric and finite bounds LO < HI")
    return (task, metric), (lo, hi)


def holm(p_values: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values (NaN: no test, adjusted to 1): reject where adjusted < alpha."""
    p = np.where(np.isnan(np.asarray(p_values, dtype=float)), 1.0, np.asarray(p_values, dtype=float))
    m, order = len(p), np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(np.maximum.accumulate((m - np.arange(m)) * p[order]), 1.0)
    return adjusted


def tarone_count(reach: np.ndarray, alpha: float) -> int:
    """Tarone's count of rows with smallest attainable p-values reach: the smallest k with at most k of them
    reaching alpha / k (the rows a family-wise test at alpha divides it among)."""
    return next(k for k in range(1, len(reach) + 1) if np.count_nonzero(reach <= alpha / k) <= k)


def tarone_holm(p_values: np.ndarray, reach: np.ndarray, alpha: float) -> np.ndarray:
    """Holm's step-down procedure with Tarone's count of the rows that could still be rejected (Tarone 1990,
    "A modified Bonferroni method for discrete data", Biometrics 46:515-522; its step-down form: Hommel &
    Krummenauer 1998, "Improvements and modifications of Tarone's multiple test procedure for discrete data",
    Biometrics 54:673-681). reach: each row's smallest attainable p-value. At each step the count k is, among the
    rows not yet rejected, the smallest with at most k of them reaching alpha / k; of those that reach it, the
    smallest p-value is rejected where p * k < alpha, else the procedure stops. Returns adjusted p-values at alpha
    (p * k, a running maximum, as Holm's; 1 for a row that cannot reach): rejected exactly where below alpha.
    With every row able to reach, the count is the rows left: Holm's procedure (holm)."""
    p = np.where(np.isnan(np.asarray(p_values, dtype=float)), 1.0, np.asarray(p_values, dtype=float))
    reach = np.maximum(np.nan_to_num(np.asarray(reach, dtype=float), nan=1.0), 0.0)
    adjusted, left, running = np.ones(len(p)), list(np.argsort(p, kind="stable")), 0.0
    while left:
        count = tarone_count(reach[left], alpha)
        testable = [row for row in left if reach[row] <= alpha / count]
        if not testable:
            break
        row = testable[0]  # left is in order of p
        running = max(running, min(1.0, p[row] * count))
        adjusted[row] = running  # once at or above alpha, so are the rest: the step-down has stopped
        left.remove(row)
    return adjusted


def inside_family(p_equivalent: np.ndarray, p_direction: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Adjusted p-values of every row's claim of equivalence (p_equivalent) and of its direction inside the
    tolerance (p_direction: the smaller of p_lower and p_higher, doubled, a test of no change whose sign says
    which), as one family: the claims `equivalent`, `lower` and `higher` are then wrong with probability at most
    alpha together (adjusted separately, `lower` joined two families: up to 2 alpha). Each row holds an equal
    share of alpha, spent on its equivalence first and, once that is shown, on its direction (a fixed sequence
    within the row); a row whose both claims are shown hands its share on to the rows left, equally. That is a
    sequentially rejective procedure whose weights grow as claims are shown and sum to at most 1 over the claims
    not yet shown (Goeman & Solari 2010, "The sequential rejection principle of familywise error control", Ann
    Stat 38:3782-3810; a graph of the kind of Bretz et al. 2009, Stat Med 28:586-604), so its family-wise error
    is at most alpha. With one row it is that row's two tests at alpha, one after the other. Adjusted p-values
    (Bretz et al.'s algorithm): the claim showable at the smallest level next, its p-value over its weight, a
    running maximum; rejected exactly where below alpha."""
    stages = np.stack([np.nan_to_num(np.asarray(p, dtype=float), nan=1.0) for p in (p_equivalent, p_direction)])
    m = stages.shape[1]
    adjusted, stage, running = np.ones((2, m)), np.zeros(m, dtype=int), 0.0
    while (open_rows := np.flatnonzero(stage < 2)).size:
        current = stages[stage[open_rows], open_rows]
        pick = open_rows[int(np.argmin(current))]
        running = max(running, min(1.0, float(current.min()) * open_rows.size))
        adjusted[stage[pick], pick] = running
        stage[pick] += 1
    return adjusted[0], adjusted[1]


def reach(rows: pd.DataFrame) -> np.ndarray:
    """Each row's smallest attainable p-value for worse and better: 1 where no document's value differs between
    the runs (no method can show a change there), else its method's floor (p_floor)."""
    floors = rows["p_floor"].fillna(0.0).to_numpy(dtype=float) if "p_floor" in rows else np.zeros(len(rows))
    changed = rows["changed"] if "changed" in rows else pd.Series(1, index=rows.index)
    return np.where(changed.fillna(1).to_numpy(dtype=float) == 0, 1.0, floors)


P_COLUMNS = ("p_worse", "p_better", "p_equivalent", "p_lower", "p_higher")


def adjusted_over(rows: str, mark=lambda word: f"`{word}`") -> str:
    """The sentence every page's header says decide's adjustment in: rows ("60 rows", "60 rows of 3 comparisons"),
    mark the form a verdict's name is set in (Markdown's code by default)."""
    return (f"verdicts are Holm-adjusted over all {rows} ({mark('worse')} and {mark('better')} over those that could "
            "reach the level: Tarone's screen leaves out rows where no document changed and rows whose method's "
            f"smallest p-value cannot reach it; {mark('equivalent')}, {mark('lower')} and {mark('higher')} as one "
            "family, each row's direction after its equivalence, at half the level)")


def decide(tables: list[pd.DataFrame], alpha: float) -> list[pd.DataFrame]:
    """Every row of every table one family: adjusted p-values (p_worse_holm, p_equivalent_holm columns) and the
    verdicts they show at alpha. Worse and better are adjusted by tarone_holm over the rows that could reach
    alpha, so rows where no document changed (a copy of the reference beside a candidate) cost nothing; the
    other claims by Holm over every row (no change is evidence of equivalence)."""
    if not tables or all(t.empty for t in tables):
        return [t.assign(verdict=pd.Series(dtype=object), p_worse_holm=np.nan, p_equivalent_holm=np.nan, mde=np.nan)
                for t in tables]
    rows = pd.concat(tables, ignore_index=True)
    shown = {c: tarone_holm(rows[c].to_numpy(dtype=float), reach(rows), alpha) for c in ("p_worse", "p_better")}
    p_lower, p_higher = (np.nan_to_num(rows[c].to_numpy(dtype=float), nan=1.0) for c in ("p_lower", "p_higher"))
    shown["p_equivalent"], direction = inside_family(rows["p_equivalent"].to_numpy(dtype=float),
                                                     np.minimum(1.0, 2 * np.minimum(p_lower, p_higher)))
    unknown = rows["higher_is_better"].isna().to_numpy()
    worse, better, inside = (shown[c] < alpha for c in ("p_worse", "p_better", "p_equivalent"))
    directed = inside & (direction < alpha)
    verdicts = np.select(
        [worse & unknown, worse, better, directed & (p_lower < p_higher), directed, inside],
        ["changed", "worse", "better", "lower", "higher", "equivalent"], default="inconclusive")
    rows = rows.assign(verdict=verdicts, p_worse_holm=shown["p_worse"], p_equivalent_holm=shown["p_equivalent"])
    rows["note"] = ["; ".join(filter(None, [note, family_note(row, alpha, len(rows))]))
                    for note, (_, row) in zip(resolution_notes(rows, alpha), rows.iterrows())]
    rows["mde"] = detectable(rows)
    bounds = np.cumsum([0] + [len(t) for t in tables])
    return [rows.iloc[a:b].reset_index(drop=True) for a, b in zip(bounds[:-1], bounds[1:])]


def family_note(row: pd.Series, alpha: float, m: int) -> str:
    """Where the row's own test shows a claim (its interval beyond or inside the tolerance) that its verdict does
    not make, the words that say the family-wise adjustment over the m rows is why ("" elsewhere, and for a
    single row, whose interval and verdict always agree)."""
    claims = (("worse", "p_worse", "p_worse_holm", ("worse", "changed"), "beyond the tolerance on the worse side"),
              ("better", "p_better", None, ("better",), "beyond the tolerance on the better side"),
              ("equivalent", "p_equivalent", "p_equivalent_holm", SHOWN_INSIDE, "inside the tolerance"))
    for claim, raw, adjusted, verdicts, where in claims:
        if m > 1 and float(np.nan_to_num(row.get(raw, np.nan), nan=1.0)) < alpha and row["verdict"] not in verdicts:
            by = f" (adjusted p {row[adjusted]:.3g})" if adjusted else ""
            return (f"its interval lies {where}, as its own test at {alpha:g} shows, but not {claim} at the "
                    f"family-wise level over the {m} rows compared{by}")
    return ""


def resolution_notes(rows: pd.DataFrame, alpha: float) -> list[str]:
    """Each row's note, with a word where the smallest p-value its method can give (p_floor: 1 / (resamples + 1)
    for a bootstrap) cannot reach the level its claims need: alpha over Tarone's count of the rows that could be
    worse (tarone_count over reach) for worse and better, alpha over every row for equivalent. Only rows it
    concerns: one where no document changed needs no resolution to be not worse, and one whose method cannot
    read it at all (p_floor 1) says why in its own note."""
    floors = (rows["p_floor"] if "p_floor" in rows else pd.Series(0.0, index=rows.index)).fillna(0.0)
    notes = rows["note"] if "note" in rows else pd.Series("", index=rows.index)
    reaches, m = reach(rows), len(rows)
    count = tarone_count(reaches, alpha) if m else 0
    out = []
    for floor, row_reach, note, shown in zip(floors, reaches, notes.fillna(""), rows["verdict"]):
        blind = [claim for claim, k in (("worse or better", count), ("equivalent", m)) if floor * k >= alpha]
        limited = row_reach < 1.0 and blind and shown not in ("worse", "changed", "better")
        words = (f"resolution: its p-values cannot go below {floor:.2g} (its method's smallest), and Holm over "
                 f"{count} {'row' if count == 1 else 'rows'} that could be worse needs {alpha / count:.2g}"
                 + (f" ({alpha / m:.2g} over all {m} for equivalent)" if count != m else "")
                 + f": this row cannot be shown {' or '.join(blind)} here") if limited else ""
        out.append("; ".join(filter(None, [note, words])))
    return out


SHOWN_INSIDE = ("equivalent", "lower", "higher", "better")  # what --require equivalent accepts of every row


def gate(tables: list[pd.DataFrame], require: str | None = None) -> int:
    """The exit code: 1 when any row's verdict fails (decide() made it family-wise), or with require="equivalent"
    when any row is not shown inside its tolerance or better (an `inconclusive` row included), else 0."""
    if require == "equivalent" and not all(t["verdict"].isin(SHOWN_INSIDE).all() for t in tables):
        return 1
    return int(any(t["verdict"].isin(FAILING).any() for t in tables))


def detectable(rows: pd.DataFrame) -> np.ndarray:
    """Each row's minimum detectable effect: the smallest drop (on the row's scale, oriented) its observed
    difference would have needed for the row's own test to show it `worse`: the tolerance plus the distance from
    diff to the interval's upper limit (ci_high - diff; the interval's shape taken as it is here). NaN where the
    interval is not finite (no test could show anything)."""
    reach = rows["tolerance"].astype(float) + rows["ci_high"].astype(float) - rows["diff"].astype(float)
    return np.where(np.isfinite(reach), reach, np.nan)
