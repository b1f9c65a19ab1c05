"""Compare's HTML page (through the one template, page.py): the verdict in words with the command's exit code,
a compact score table coloured by verdict (the statistics folded below it), the plots with their captions, the
documents that changed (documents.py) and the text report rendered. Pure: the comparison in, HTML out.

The verdicts are the table's (verdict.decide made them) and the exit code is the one verdict.gate gave the
command: nothing here decides a verdict again."""

from __future__ import annotations

import math
from collections import Counter

import pandas as pd

from evalkit import page
from evalkit.compare.pages import documents
from evalkit.compare.statistics import proportions, verdict
from evalkit.compare.divergence import report_page as divergence_page
from evalkit.compare.divergence.between import Divergence
from evalkit.compare.divergence.verdict import NoiseVerdict
from evalkit.compare.locate.why import Localisation
from evalkit.compare.runs import Run
from evalkit.compare.statistics.paired import TaskDetail

INSIDE = ("equivalent", "lower", "higher")  # shown inside the tolerance
STATISTICS = ["task", "filter", "metric", "tolerance", "method", "mcnemar_b", "mcnemar_c", "p_worse_holm",
              "p_equivalent_holm", "mde", "noise_diff", "noise_b", "noise_c", "note"]


def _rows(k: int, m: int) -> str:
    return f"all {m} rows" if k == m and m > 1 else f"{k} of {m} row{'s' if m != 1 else ''}"


def tolerance_words(table: pd.DataFrame) -> str:
    """±0.02 when every row shares one absolute tolerance, else the rows' own."""
    if "tolerance" in table and table["tolerance"].nunique() == 1 and not table.get("relative", pd.Series()).any():
        return f"±{table['tolerance'].iloc[0]:g}"
    return "each row's tolerance"


def inconclusive_reason(table: pd.DataFrame, needed: int | None) -> str:
    """Why the inconclusive rows are: 0/1 rows with fewer documents than the tolerance needs, or their notes."""
    rows = table[table["verdict"] == "inconclusive"]
    few = rows[(rows["method"] == "tango") & (rows["n"] < (needed or 0))]
    if len(few) == 0:
        return "the intervals reach past the tolerance (see the notes)"
    counted = f"{needed} needed, {int(few['n'].max())} here"
    return (f"too few documents ({counted})" if len(few) == len(rows) else
            f"{len(few)} with too few documents ({counted}), {len(rows) - len(few)} see the notes")


def noise_words(noise: NoiseVerdict | None) -> str:
    """The divergence verdict against a noise run, in words: "divergence beyond noise (p=0.0012)"."""
    if noise is None:
        return ""
    if noise.label == "unusable":
        return f"divergence verdict unusable: {noise.reason}"
    return f"divergence {noise.label} (p={noise.p_value:.3g})"


def headline(table: pd.DataFrame, *, exit_code: int | None, needed: int | None,
             noise: NoiseVerdict | None = None) -> tuple[str, str]:
    """The verdict in words and its colour (fail, unsure, pass), from the table's verdicts, the divergence
    verdict against a noise run (when there is one) and the command's exit code: "candidate is worse than
    reference on 1 of 57 rows (exit 1)". exit_code None: a page no command exits with (the sweep's
    comparisons), coloured by this table's own gate."""
    counts, m = Counter(table["verdict"]), len(table)
    if m == 0:
        return "nothing compared" + ("" if exit_code is None else f" (exit {exit_code})"), "unsure"
    inside = sum(counts[v] for v in INSIDE)
    if counts["worse"] or counts["changed"]:
        lead = "; ".join(filter(None, [
            f"candidate is worse than reference on {_rows(counts['worse'], m)}" if counts["worse"] else "",
            f"changed beyond the tolerance (direction unknown) on {_rows(counts['changed'], m)}"
            if counts["changed"] else ""]))
        shown = ("worse", "changed")
    elif counts["inconclusive"] == m:
        lead, shown = f"inconclusive on {_rows(m, m)}: {inconclusive_reason(table, needed)}", ("inconclusive",)
    elif inside == m:
        lead, shown = f"equivalent within {tolerance_words(table)} on {_rows(m, m)}", INSIDE
    elif counts["better"]:
        lead, shown = f"candidate is better than reference on {_rows(counts['better'], m)}", ("better",)
    else:
        lead = f"inconclusive on {_rows(counts['inconclusive'], m)}: {inconclusive_reason(table, needed)}"
        shown = ("inconclusive",)
    rest = ", ".join(f"{counts[v]} {v}" for v in verdict.VERDICTS if counts[v] and v not in shown)
    if counts["inconclusive"] and "inconclusive" not in shown:
        rest += f" — {inconclusive_reason(table, needed)}"
    label = noise.label if noise else ""
    mine = 2 if label == "unusable" else int(verdict.gate([table]) or label == "beyond noise")
    other = "another candidate is worse" + (" or beyond noise" if noise else "") if exit_code == 1 else \
        "another candidate's divergence verdict is unusable"
    code = "" if exit_code is None else f" (exit {exit_code}" + (f": {other})" if exit_code and exit_code != mine
                                                                  else ")")
    kind = "fail" if (mine if exit_code is None else exit_code) else (
        "pass" if inside + counts["better"] == m else "unsure")
    said = "; ".join(filter(None, [rest, noise_words(noise)]))
    return f"{lead}{f'; {said}' if said else ''}{code}", kind


def _num(value: object, digits: str = ".4g") -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, digits)


def diff_text(row: pd.Series) -> str:
    """candidate − reference (oriented) with its interval; a relative row in percent."""
    if pd.isna(row["diff"]):
        return ""
    scale, unit, digits = (100.0, "%", "+.2f") if (pd.notna(row.get("relative")) and bool(row.get("relative"))) else (1.0, "", "+.3f")
    low, high = row.get("ci_low"), row.get("ci_high")
    interval = "" if pd.isna(low) or pd.isna(high) else (
        f" [{low * scale:{digits}}{unit}, {high * scale:{digits}}{unit}]")
    return f"{row['diff'] * scale:{digits}}{unit}{interval}"


def flips_link(row: pd.Series, found: dict[tuple[str, str], list[documents.Changed]]) -> str:
    """How many of this row's documents flipped each way, linked to its task's table of changed documents."""
    rows = found.get((row["task"], row["filter"]))
    if not rows:
        return "—"
    lost, gained = (sum(change in r.change for r in rows)
                    for change in (f"{row['metric']}: right → wrong", f"{row['metric']}: wrong → right"))
    words = f"{lost} lost, {gained} gained" if lost or gained else f"{len(rows)} outputs changed"
    return f'<a href="#{documents.anchor(row["task"], row["filter"])}">{words}</a>'


SCORES = ["task", "metric", "n", "reference", "candidate", "diff [interval]", "verdict", "changed documents"]


def score_table(table: pd.DataFrame, found: dict[tuple[str, str], list[documents.Changed]]) -> str:
    """The compact table: task (filter), metric, n, both scores, the difference with its interval, the verdict."""
    cells = []
    for _, row in table.iterrows():
        task = page.escape(row["task"]) + ("" if row["filter"] in ("none", "") else
                                           f" <small>({page.escape(row['filter'])})</small>")
        cells.append([page.cell(task, raw=True), page.cell(row["metric"]), page.cell(_num(row["n"], "d"), css="num"),
                      page.cell(_num(row["reference"]), css="num"), page.cell(_num(row["candidate"]), css="num"),
                      page.cell(diff_text(row), css="num"), page.cell(row["verdict"], css="verdict"),
                      page.cell(flips_link(row, found), raw=True)])
    return page.table(SCORES, cells, row_classes=[page.verdict_class(v) for v in table["verdict"]],
                      numeric={"n", "reference", "candidate", "diff [interval]"},
                      optional={"n", "reference", "candidate", "changed documents"}, fit=True)


def statistics(table: pd.DataFrame) -> str:
    columns = [c for c in STATISTICS if c in table.columns]
    cells = [[page.cell(_num(v) if isinstance(v, float) else ("" if v is None else str(v)),
                        css="num" if isinstance(v, (int, float)) else "") for v in row]
             for row in table[columns].astype(object).itertuples(index=False)]
    return page.folded("Statistics per row: tolerance, method, McNemar's discordant counts (b: right → wrong, "
                       "c: wrong → right), Holm-adjusted p-values, notes",
                       f"<div class=scroll>{page.table(columns, cells)}</div>")


def facts(reference: str, candidate: str, *, family: int, confidence: float, noise: bool = False) -> str:
    return (f"reference <code>{page.escape(reference)}</code> · candidate <code>{page.escape(candidate)}</code> · "
            f"{verdict.adjusted_over(f'{family} rows', lambda word: f'<code>{word}</code>')} at "
            f"α = {1 - confidence:.2g}; exit 1 when a row is worse or "
            "changed" + (" or the divergence is beyond noise (<a href=#divergence>divergence</a>)" if noise else "")
            + " · <a href=#changed>documents that changed</a> · <a href=#report>text report</a>")


def html(text: str, table: pd.DataFrame, images: dict[str, page.Plot], *, exit_code: int | None, tolerance: float,
         confidence: float, reference: Run | None = None, candidate: Run | None = None, details: list[TaskDetail] = (),
         why: Localisation | None = None, family: int | None = None, title: str = "evalkit compare",
         divergence: Divergence | None = None) -> str:
    """The whole page: the verdict in words with the command's exit code (verdict.gate's, passed in; None where no
    command exits with it) first, the scores, the divergence (when both runs recorded it, else its one line), the
    documents that changed (from both runs' samples, when given), the plots, the text report."""
    found = documents.changed(reference, candidate, list(details)) if reference and candidate else {}
    names = (reference.name if reference else "", candidate.name if candidate else "")
    needed = proportions.documents_needed(tolerance, confidence=confidence) if 0 < tolerance < 1 else None
    words, kind = headline(table, exit_code=exit_code, needed=needed,
                           noise=divergence.verdict if divergence is not None else None)
    figures = [page.figure(name, plot) for name, plot in images.items()]
    return page.document(
        title=title, headline=words, kind=kind,
        facts=facts(*names, family=family or len(table), confidence=confidence,
                    noise=divergence is not None and divergence.verdict is not None),
        sections=[f"<div class=scroll>{score_table(table, found)}</div>", statistics(table),
                  divergence_page.section(divergence),
                  documents.section(found, why), "<h2>Plots</h2>" if figures else "", *figures,
                  f'<h2 id=report>The text report</h2>\n<div class=report>{page.markdown_html(text)}</div>'])
