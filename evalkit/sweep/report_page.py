"""The sweep report's HTML page, through the reports' one template (evalkit/page.py): the verdict over the
points in words, a compact table (point, overrides, task, metric, score ± stderr, difference, verdict linked to the
point's comparison page, tokens/s), every column folded below it, each point's divergence from the reference
(evalkit/sweep/divergence.py's section), the plots with their captions, and report.md rendered. Pure: the table
(evalkit/sweep/report.py's) in, HTML out. The verdicts are compare's, as the table holds them; nothing here decides
one."""

from __future__ import annotations

import math
from collections import Counter

import pandas as pd

from evalkit import page
from evalkit.compare.statistics.verdict import FAILING
from evalkit.sweep.points import COMPLETED, PointRecord

SCORES = "Each point's score with lm-eval's standard error as its bar, one panel per task, metric and filter. " \
         "Bars that overlap the reference's do not show a change; the table's verdicts come from the paired test, " \
         "which sees more than these bars."
THROUGHPUT = "Engine throughput per point: prompt plus generated tokens per second spent in engine calls. A point " \
             "resumed from the request store reads faster than it ran."


def _points(nums: list[int]) -> str:
    return ("point " if len(nums) == 1 else "points ") + ", ".join(map(str, nums))


def headline(table: pd.DataFrame, points: list[PointRecord], reference: int | None) -> tuple[str, str]:
    """The sweep's verdict in words and its colour: which points are worse than the reference on how many rows,
    which failed, which could not be compared."""
    if reference is None:
        return f"no point completed: {len(points)} failed", "fail"
    verdicts = table[table["point"] != reference].groupby("point")["verdict"].agg(list).to_dict()
    worse = {p: sum(v in FAILING for v in vs) for p, vs in verdicts.items() if any(v in FAILING for v in vs)}
    failed = [p.num for p in points if p.status not in COMPLETED]
    apart = sorted(p for p, vs in verdicts.items() if any(str(v).startswith("not comparable") for v in vs))
    compared = sorted(p for p, vs in verdicts.items() if p not in apart and p not in failed)
    parts = [f"{_points([p])} is worse than the reference (point {reference}) on {n} of {len(verdicts[p])} rows"
             for p, n in sorted(worse.items())]
    if not worse and compared:
        counts = Counter(v for p in compared for v in verdicts[p])
        parts.append(f"no point is worse than the reference (point {reference}): "
                     + ", ".join(f"{n} rows {v}" for v, n in counts.most_common()))
    if not compared and not failed and not apart:
        parts.append(f"one point (point {reference}): nothing to compare it with")
    parts += [f"{_points(failed)} failed"] if failed else []
    parts += [f"{_points(apart)} not comparable (other documents)"] if apart else []
    kind = "fail" if worse or failed else ("unsure" if apart or not compared or "inconclusive" in str(
        [verdicts[p] for p in compared]) else "pass")
    return "; ".join(parts), kind


def _num(value: object, digits: str = ".4g") -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, digits)


def verdict_cell(row: pd.Series, reference: int | None) -> str:
    """The verdict, linked to the point's comparison page; a failed point's status."""
    if row["status"] not in COMPLETED:
        return page.cell(row["status"], css="verdict")
    word = "" if pd.isna(row["verdict"]) else str(row["verdict"])
    if word in ("", "reference", "not comparable"):
        return page.cell(word, css="verdict")
    link = f'<a href="compare-{int(row["point"])}-vs-{reference}.html">{page.escape(word)}</a>'
    return page.cell(link, css="verdict", raw=True)


COMPACT = ["point", "overrides", "task", "metric", "score ± stderr", "diff", "verdict", "tokens/s"]


def compact_table(table: pd.DataFrame, reference: int | None) -> str:
    cells, classes = [], []
    for _, row in table.iterrows():
        score = _num(row["value"]) + (f" ± {_num(row['stderr'], '.2g')}" if _num(row["stderr"]) else "")
        failed = row["status"] not in COMPLETED
        task = f"{row['task']} ({row['filter']})" if isinstance(row["task"], str) and row["filter"] not in (
            "none", None) and not pd.isna(row["filter"]) else ("" if pd.isna(row["task"]) else row["task"])
        cells.append([page.cell(str(row["point"]), css="num"), page.cell(row["overrides"]),
                      page.cell(row["error"] if failed else task), page.cell("" if pd.isna(row["metric"]) else
                                                                            row["metric"]),
                      page.cell(score, css="num"), page.cell(_num(row["diff"], "+.3f"), css="num"),
                      verdict_cell(row, reference), page.cell(_num(row["tokens_per_s"], ".1f"), css="num")])
        classes.append(page.verdict_class(row["status"] if failed else row["verdict"]))
    return page.table(COMPACT, cells, row_classes=classes, numeric={"point", "score ± stderr", "diff", "tokens/s"},
                      optional={"overrides", "score ± stderr", "tokens/s"}, fit=True)


def full_table(table: pd.DataFrame) -> str:
    shown = table.astype(object).where(table.notna(), None)
    cells = [[page.cell(_num(v) if isinstance(v, float) else ("" if v is None else str(v))) for v in row]
             for row in shown.itertuples(index=False)]
    return page.folded("Every column (report.csv): status, wall seconds, error",
                       f"<div class=scroll>{page.table(table.columns, cells)}</div>")


def html_page(text: str, table: pd.DataFrame, images: dict[str, bytes], links: list[str], *,
              points: list[PointRecord], reference: int | None, tolerance: float, divergence: str = "") -> str:
    words, kind = headline(table, points, reference)
    plotted = table["point"][table["value"].notna()].nunique()  # a plot of one point compares nothing
    captions = {"Scores per point": SCORES, "Throughput per point": THROUGHPUT}
    figures = [page.figure(name, page.Plot(data if plotted > 1 else None, captions.get(name, "")
                                           if plotted > 1 else f"{name}: one point only, nothing to compare"))
               for name, data in images.items()]
    listed = "".join(f'<li><a href="{page.escape(n)}">{page.escape(n)}</a></li>' for n in links)
    facts = (f"{len(points)} points · reference: point {reference} · verdicts: evalkit.compare against the reference "
             f"at ±{tolerance:g}, every compared point's rows one family (Holm) · "
             + ("<a href=#divergence>divergence</a> · " if divergence else "") + "<a href=#report>text report</a>")
    return page.document(title="evalkit sweep report", headline=words, kind=kind, facts=facts, sections=[
        f"<div class=scroll>{compact_table(table, reference)}</div>", full_table(table), divergence,
        "<h2>Comparison reports</h2>" + (f"<ul>{listed}</ul>" if listed else "<p class=none>none</p>"),
        "<h2>Plots</h2>", *figures,
        f"<h2 id=report>The text report</h2>\n<div class=report>{page.markdown_html(text)}</div>"])
