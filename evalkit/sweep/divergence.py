"""The sweep report's token-level divergence: each compared point against the reference point, computed as
``python -m evalkit.compare REF P`` computes it without ``--noise`` (evalkit.compare.divergence: ``records.read_run``
and ``between.divergence``; a sweep has no noise pair, so figures only and no verdict), shown three ways:

* the whole section in the point's ``compare-<point>-vs-<reference>.md/.html`` (compare's own, passed to its report);
* per task, llama.cpp's Mean KLD with its standard error and 95 % interval and Same top p, as ``report.csv``
  columns (:data:`COLUMNS`) on each row of that task;
* one table in ``report.md`` and ``report.html``, a row per compared point and task (and all tasks, where there
  are several, as compare's table has it), its cells the very text of compare's table; a point without figures
  has blank cells and one line saying why (the run, or the reference, recorded none).

Names as llama.cpp's ``llama-perplexity --kl-divergence`` and docs/divergence.md use them.
"""

from __future__ import annotations

import re

from evalkit import page
from evalkit.compare.divergence import between, records
from evalkit.compare.divergence import report as divergence_report
from evalkit.compare.divergence.between import Divergence
from evalkit.compare.runs import CompareError, Run

COLUMNS = ["mean_kld", "mean_kld_se", "mean_kld_low", "mean_kld_high", "same_top_p"]  # report.csv's, per task
MEAN_KLD, SAME_TOP = "Mean KLD ± SE [95 %]", "Same top p ± SE [95 %]"  # compare's column names
HEAD = ["point", "overrides", "task", "positions", MEAN_KLD, SAME_TOP]
TITLE = "Divergence from the reference (token level)"
NONE = "none (see below)"  # the task cell of a point without figures; its figures blank


def point_divergences(reference: Run, candidates: dict[int, Run]) -> dict[int, Divergence]:
    """point -> its divergence from the reference, as compare computes it. A record that cannot be read (a damaged
    run: compare exits 2 on it) is that point's missing line, so the rest of the report is still written."""
    try:
        ref = records.read_run(reference)
    except CompareError as error:
        return {num: Divergence(reference.name, candidate.name, missing=str(error)) for num, candidate in
                candidates.items()}
    found = {}
    for num, candidate in candidates.items():
        try:
            found[num] = between.divergence(ref, records.read_run(candidate))
        except CompareError as error:
            found[num] = Divergence(ref.run, candidate.name, missing=str(error))
    return found


def task_columns(d: Divergence | None, task: object) -> dict[str, float]:
    """report.csv's divergence columns of one row: the figures of its task, {} where there are none (no record,
    a task not recorded by both runs, a group: its tasks' rows hold them)."""
    s = d.per_task.get(task) if d is not None and not d.missing and isinstance(task, str) else None
    if s is None:
        return {}
    kld = s.mean_kld
    return {"mean_kld": kld.value, "mean_kld_se": kld.se, "mean_kld_low": kld.low, "mean_kld_high": kld.high,
            "same_top_p": s.same_top.value}


def table_rows(found: dict[int, Divergence], overrides: dict[int, str]) -> list[list[str]]:
    """The section's rows: compare's cells of each compared point's tasks; one blank row for a point without."""
    at = [divergence_report.COLUMNS.index(name) for name in ("positions", MEAN_KLD, SAME_TOP)]
    rows = []
    for num, d in found.items():
        if d.missing:
            rows.append([str(num), overrides.get(num, ""), NONE, "", "", ""])
            continue
        rows += [[str(num), overrides.get(num, ""), r[0], *(r[i] for i in at)] for r in divergence_report.rows(d)]
    return rows


def _points(nums: list[int]) -> str:
    return f"{'point' if len(nums) == 1 else 'points'} {', '.join(map(str, nums))}"


def notes(found: dict[int, Divergence], reference: int) -> list[str]:
    """One line per reason a point has no figures, naming the points it holds for (the reference's own lack is
    one line for all of them), and any line compare adds on how a point was compared; each run compare names
    followed by its point(s)."""
    runs: dict[str, list[int]] = {}
    for num, d in sorted({reference: next(iter(found.values())), **found}.items()):
        runs.setdefault(d.reference if num == reference else d.candidate, []).append(num)
    by_reason: dict[str, list[int]] = {}
    for num, d in found.items():
        for reason in dict.fromkeys([f"no divergence: {d.missing}"] if d.missing else d.notes):
            by_reason.setdefault(reason, []).append(num)  # a point run as the reference's own says it twice
    for name, nums in runs.items():
        named = re.compile(rf"run {re.escape(name)}(?![\w/-])")
        by_reason = {named.sub(f"run {name} ({_points(nums)})", reason): at for reason, at in by_reason.items()}
    return [f"{_points(nums)}: {reason}" for reason, nums in by_reason.items()]


def header(reference: int, found: dict[int, Divergence]) -> str:
    bound = " / ".join(sorted({d.bound for d in found.values() if not d.missing})) or "top-k of both"
    return (f"KL(P_ref ‖ P_point) in nats per task against point {reference}, as `evalkit compare REF P` "
            f"gives it: Mean KLD (a lower bound from {bound}) and Same top p (the most likely token the same), "
            "± the standard error, [ ] the 95 % interval, over documents. No noise run in a sweep: figures only, no "
            "verdict. Percentiles, Δp and the PPL ratio: each point's comparison report (docs/divergence.md).")


def markdown(found: dict[int, Divergence], overrides: dict[int, str], reference: int | None) -> list[str]:
    """report.md's section: what the figures are, the table, the notes; nothing where no point was compared."""
    if reference is None or not found:
        return []
    rows = table_rows(found, overrides)
    lines = [f"## {TITLE}", "", header(reference, found), "", "| " + " | ".join(HEAD) + " |",
             "|" + "|".join("--:" if c in ("point", "positions") else ":--" for c in HEAD) + "|",
             *("| " + " | ".join(r) + " |" for r in rows), ""]
    said = notes(found, reference)
    return lines + [f"- {line}" for line in said] + ([""] if said else [])


def unbroken(figure: str) -> str:
    """A figure whose line may break only before its interval, at a narrow width: "0.05 ± 0.03 [0.01, 0.08]"."""
    for space in (" ± ", ", ", " %"):
        figure = figure.replace(space, space.replace(" ", "\u00a0"))
    return figure


def html(found: dict[int, Divergence], overrides: dict[int, str], reference: int | None) -> str:
    """report.html's section: the same table and notes."""
    if reference is None or not found:
        return ""
    cells = [[page.cell(f'<a href="compare-{num}-vs-{reference}.html#divergence">{num}</a>', css="num", raw=True),
              *(page.cell(unbroken(v), css="num" if i == 2 else "") for i, v in enumerate(rest))]  # its section
             for num, *rest in table_rows(found, overrides)]
    table = page.table(HEAD, cells, numeric={"point", "positions"},
                       optional={"overrides", "positions"})
    said = "".join(f"<li>{page.escape(line)}</li>" for line in notes(found, reference))
    return "\n".join([f"<h2 id=divergence>{page.escape(TITLE)}</h2>",
                      f"<div class=caption>{page.markdown_html(header(reference, found))}</div>",
                      f"<div class=scroll>{table}</div>", f"<ul class=caption>{said}</ul>" if said else ""])
