"""The report of a sweep: every point x task x metric in one table, with plots and each point's verdict.

Reads the point records (evalkit/sweep/points.py) and each completed point's run folder (status ok, or
skipped with the earlier run that has its config), compares every completed point with a reference point
(the first completed one unless chosen) through evalkit.compare, and writes into the sweep folder:
``report.csv``, ``report.md``, ``scores.png`` (each score per point with its stderr as error bars, one panel
per task, metric and filter), ``throughput.png`` (tokens/s per point), ``report.html`` (the verdict in
words, a compact table, both images: report_page.py) and, per compared point,
``compare-<point>-vs-<reference>.md`` / ``.html`` (evalkit.compare's report, with its divergence section).

Columns (:data:`COLUMNS`): ``point``, ``overrides``, ``status``, then per task, metric and filter the run's
``value`` and ``stderr`` (lm-eval's), ``verdict`` and ``diff`` against the reference (evalkit.compare's, every
compared point's rows one family as ``python -m evalkit.compare REF P1 ... Pk`` makes them;
"reference" on the reference's rows, "not comparable: ..." where the runs saw different documents), the
token-level divergence of the row's task from the reference's (``mean_kld`` with its ``_se``, ``_low`` and
``_high``, ``same_top_p`` as a fraction: evalkit/sweep/divergence.py, as evalkit.compare computes it), the
point's ``wall_seconds``, ``tokens_per_s`` and, for a failed point (one row, no metrics), its ``error``.

tokens/s is the run's engine throughput: prompt plus generated tokens of all its tasks (``evalkit.counts``)
per second spent in engine calls (``evalkit.timings.engine_calls``, summed; ``timings.evaluate`` in runs that
did not record them). Tokens are as sent to the engine, so a cached prompt prefix counts too, as on the
progress lines; answers a run reused from its request store count with almost no time, so a resumed run
reads faster than it was.

Table building (:func:`sweep_table`, :func:`markdown`, :func:`html_page`) is pure; :func:`write_report` reads,
compares and writes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from evalkit.compare.divergence.between import Divergence
from evalkit.compare.runs import names_escaped
from evalkit.page import png, pyplot
from evalkit.sweep import divergence, report_page
from evalkit.sweep.points import (COMPLETED, PointRecord, SweepError, distinct_overrides, read_points,
                                   write_atomic)
from evalkit import untrusted
from evalkit.untrusted import inside

COLUMNS = ["point", "overrides", "status", "task", "metric", "filter", "value", "stderr", "verdict", "diff",
           *divergence.COLUMNS, "wall_seconds", "tokens_per_s", "error"]


def tokens_per_second(results: dict[str, Any]) -> float | None:
    """The run's engine throughput (see the module docstring), None where the run recorded no time."""
    section = results.get("evalkit") or {}
    tokens = sum(c.get("prompt_tokens", 0) + c.get("output_tokens", 0) for c in (section.get("counts") or {}).values())
    timings = section.get("timings") or {}
    seconds = sum((timings.get("engine_calls") or {}).values()) or timings.get("evaluate") or 0
    return round(tokens / seconds, 1) if tokens and seconds > 0 else None


def point_rows(point: PointRecord, overrides: str, results: dict[str, Any] | None,
               verdicts: pd.DataFrame | str | None, found: Divergence | None = None) -> list[dict[str, Any]]:
    """The rows of one point: one per task, metric and filter of its run, or one row with its status and error.

    verdicts: the comparison with the reference (evalkit.compare's table), or one word for every row; found: its
    divergence from the reference (each row gets its task's figures)."""
    from evalkit.run.results import summary_frame

    base = {"point": point.num, "overrides": overrides, "status": point.status,
            "wall_seconds": point.wall_seconds, "error": point.error}
    if results is None:
        return [base]
    frame = summary_frame(results, (results.get("evalkit") or {}).get("counts") or {})
    speed = tokens_per_second(results)
    rows = []
    for r in frame.itertuples():
        row = {**base, "task": r.task, "metric": r.metric, "filter": r.filter, "value": r.value,
               "stderr": r.stderr, "tokens_per_s": speed, **divergence.task_columns(found, r.task)}
        if isinstance(verdicts, pd.DataFrame):
            same = (verdicts.task == r.task) & (verdicts.metric == r.metric) & (verdicts["filter"] == r.filter)
            match = verdicts[same]
            if len(match):
                row.update(verdict=match.iloc[0].verdict, diff=match.iloc[0]["diff"])
        elif verdicts is not None:
            row["verdict"] = verdicts.split(":")[0]  # "not comparable": report.md says why
        rows.append(row)
    return rows or [{**base, "tokens_per_s": speed}]


def sweep_table(points: list[PointRecord], runs: dict[int, dict[str, Any]],
                verdicts: dict[int, pd.DataFrame | str], found: dict[int, Divergence] | None = None) -> pd.DataFrame:
    """Every point x task x metric (see COLUMNS). runs: point -> its results.json; verdicts: point -> its
    comparison with the reference, or a word ("reference", "not comparable: ..."); found: point -> its divergence
    from the reference. overrides: only those that differ between the points (all of them in a sweep of one
    point)."""
    apart, found = distinct_overrides(points), found or {}
    rows = [row for p in points
            for row in point_rows(p, apart[p.num], runs.get(p.num), verdicts.get(p.num), found.get(p.num))]
    return pd.DataFrame(rows, columns=COLUMNS)


def choose_reference(points: list[PointRecord], runs: dict[int, dict[str, Any]], wanted: int | None) -> int | None:
    """The reference point: wanted, or the first completed point (None when no point completed)."""
    completed = [p.num for p in points if p.num in runs]
    if wanted is None:
        return completed[0] if completed else None
    known = {p.num: p for p in points}
    if wanted not in known:
        raise SweepError(f"no point {wanted} in this sweep; points: {', '.join(map(str, known)) or 'none'}")
    if wanted not in runs:
        raise SweepError(f"point {wanted} did not complete (status {known[wanted].status}); choose a completed "
                         f"point: {', '.join(map(str, completed)) or 'none'}")
    return wanted


def compare_points(points: list[PointRecord], reference: int | None, *, tolerance: float
                   ) -> tuple[dict[int, pd.DataFrame | str], dict[str, str], dict[int, Divergence]]:
    """Every completed point against the reference with evalkit.compare, all of them one family (as
    ``python -m evalkit.compare REF P1 ... Pk`` compares them: the same rows, resamples and verdicts): point -> its
    table (or a word), the comparison reports by file name, and point -> its divergence from the reference
    (evalkit/sweep/divergence.py; shown in its report as compare shows it without --noise)."""
    from evalkit.compare import runs
    from evalkit.compare.statistics import paired
    from evalkit.compare.pages import html_page, markdown, plots

    verdicts: dict[int, pd.DataFrame | str] = {}
    files: dict[str, str] = {}
    if reference is None:
        return verdicts, files, {}
    by_num = {p.num: p for p in points}
    verdicts[reference] = "reference"
    try:
        ref = runs.load_run(by_num[reference].run_dir)
    except runs.CompareError as error:  # no samples (log_samples=false): nothing can be compared with it
        return {**{p.num: f"not comparable: reference {error}" for p in points}, reference: "reference"}, files, {}
    comparable: dict[int, runs.Run] = {}
    for point in points:
        if point.num == reference or point.status not in COMPLETED or not point.run_dir:
            continue
        try:
            candidate = runs.load_run(point.run_dir)
            paired.check_comparable(ref, candidate)  # like for like, and values that can be compared
            comparable[point.num] = candidate
        except runs.CompareError as error:
            verdicts[point.num] = f"not comparable: {error}"
    compared = paired.compare_family(ref, list(comparable.values()), tolerance=tolerance) if comparable else []
    found = divergence.point_divergences(ref, comparable)
    family = sum(len(table) for table, _ in compared)
    for num, (table, details) in zip(comparable, compared):
        verdicts[num] = table
        text = markdown.markdown(f"point {reference}: {ref.name}", f"point {num}: {by_num[num].run_dir}",
                                 table, details, tolerance=tolerance, confidence=0.95, family=family,
                                 comparisons=len(compared), divergence=found[num])
        stem = f"compare-{num}-vs-{reference}"
        files[f"{stem}.md"] = text
        files[f"{stem}.html"] = html_page.html(  # no exit code: the sweep exits on failed points only
            text, table, plots.plots(table, details, tolerance), exit_code=None, tolerance=tolerance,
            confidence=0.95, reference=ref, candidate=comparable[num], details=details, family=family,
            title=f"evalkit compare: point {num} against point {reference}", divergence=found[num])
    return verdicts, files, found


def label(point: int, overrides: str) -> str:
    return "\n".join([f"#{point}", *overrides.split()])


def width(points: int) -> float:
    return max(8.0, 1.8 * points)


def scores_png(table: pd.DataFrame) -> bytes:
    """Each task/metric/filter's score per point, stderr as error bars, one panel each."""
    plt = pyplot()
    scored = table[table["value"].notna()]
    panels = list(scored.groupby(["task", "metric", "filter"], sort=True))
    size = (width(scored["point"].nunique()), 2.8 * max(1, len(panels)))
    fig, axes = plt.subplots(max(1, len(panels)), 1, figsize=size, squeeze=False)
    for ax, ((task, metric, filt), rows) in zip(axes[:, 0], panels):
        ax.errorbar(range(len(rows)), rows["value"].astype(float), yerr=rows["stderr"].astype(float).fillna(0),
                    fmt="o", capsize=4)
        ax.set_xticks(range(len(rows)), [label(r.point, r.overrides) for r in rows.itertuples()], fontsize=7)
        ax.set_title(f"{task} / {metric} ({filt})", fontsize=9)
        ax.set_ylabel(metric)
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no completed point", ha="center", va="center")
    fig.tight_layout()
    data = png(fig)
    plt.close(fig)
    return data


def throughput_png(table: pd.DataFrame) -> bytes:
    """tokens/s per point (prompt plus generated tokens per second in the engine)."""
    plt = pyplot()
    speed = table[table["tokens_per_s"].notna()].drop_duplicates("point")
    fig, ax = plt.subplots(figsize=(width(len(speed)), 3.5))
    ax.bar(range(len(speed)), speed["tokens_per_s"].astype(float))
    ax.set_xticks(range(len(speed)), [label(r.point, r.overrides) for r in speed.itertuples()], fontsize=7)
    ax.set_ylabel("tokens/s (prompt + generated, in the engine)")
    ax.set_title("Throughput per point")
    if speed.empty:
        ax.text(0.5, 0.5, "no completed point", ha="center", va="center", transform=ax.transAxes)
    data = png(fig)
    plt.close(fig)
    return data


def markdown(table: pd.DataFrame, points: list[PointRecord], *, sweep_dir: str, reference: int | None,
             tolerance: float, compare_files: list[str], notes: dict[int, str],
             found: dict[int, Divergence] | None = None) -> str:
    """report.md: what the numbers are, the table (its divergence columns as their own table below it, compare's
    cells), each point's full overrides, run folder, error and notes."""
    statuses = pd.Series([p.status for p in points]).value_counts().to_dict()
    lines = ["# evalkit sweep report", "", f"- sweep: `{sweep_dir}`",
             "- points: " + ", ".join(f"{v} {k}" for k, v in statuses.items()),
             f"- reference: point {reference}" if reference is not None else "- reference: none (no point completed)",
             f"- verdicts: evalkit.compare against the reference, tolerance ±{tolerance}, the rows of every compared "
             "point one family (Holm), as `evalkit compare REF P1 ... Pk` gives them",
             "- tokens/s: prompt + generated tokens per second in the engine", ""]
    shown = table.drop(columns=divergence.COLUMNS).astype(object)
    shown = shown.where(shown.notna(), None)  # empty cells, not "nan"
    lines += [shown.to_markdown(index=False, floatfmt=".4g", missingval=""), ""]
    lines += divergence.markdown(found or {}, distinct_overrides(points), reference) + ["## Points", ""]
    for p in points:
        lines.append(f"- point {p.num} (`{' '.join(p.overrides)}`): {p.status}"
                     + (f", run `{p.run_dir}`" if p.run_dir else "") + (f", error: {p.error}" if p.error else "")
                     + (f"; {notes[p.num]}" if p.num in notes else ""))
    if compare_files:
        lines += ["", "Comparison reports: " + ", ".join(f"`{name}`" for name in compare_files)]
    return "\n".join(lines) + "\n"


def html_page(text: str, table: pd.DataFrame, images: dict[str, bytes], links: list[str], *,
              points: list[PointRecord], reference: int | None, tolerance: float,
              found: dict[int, Divergence] | None = None) -> str:
    """report.html: the sweep's verdict in words first, then the compact table and the divergence's
    (report_page.py, through evalkit.compare's one page template)."""
    return report_page.html_page(text, table, images, links, points=points, reference=reference, tolerance=tolerance,
                                 divergence=divergence.html(found or {}, distinct_overrides(points), reference))


def runs_root(sweep_dir: Path) -> Path:
    """Where a sweep folder's points' run folders may lie, unless told otherwise: the output folder that holds its
    ``.sweeps`` (``<output_dir>/.sweeps/<time>``, the default layout), else the sweep folder itself. A point record
    names its run folder by path, and a sweep folder may come from elsewhere: read anywhere, its record could show
    in the report any run of this machine's."""
    sweep_dir = Path(sweep_dir).resolve()
    return sweep_dir.parent.parent if sweep_dir.parent.name == ".sweeps" else sweep_dir


def outside_root(points: list[PointRecord], root: Path) -> dict[int, str]:
    """point -> why its run folder is not read: it lies outside root (links resolved)."""
    root = Path(root).resolve()
    return {p.num: f"its run folder {p.run_dir} lies outside {root}, where this report reads runs (evalkit report "
                   "--runs-under DIR reads them under DIR)"
            for p in points
            if p.status in COMPLETED and p.run_dir and not Path(p.run_dir).resolve().is_relative_to(root)}


def load_results(points: list[PointRecord]) -> dict[int, dict[str, Any]]:
    """point -> its run's results.json, for the completed points whose run folder is still there."""
    runs = {}
    for p in points:
        results_file = Path(p.run_dir) / "results.json" if p.run_dir else None
        if p.status in COMPLETED and results_file and results_file.is_file():
            try:  # a point.json may name any folder: its own results.json read as data, bounded, a regular file
                data = untrusted.json_data(untrusted.read_bounded(inside(results_file.parent, "results.json")))
                runs[p.num] = names_escaped(data)  # a newline in a task's name starts no line of the report
            except (OSError, ValueError) as error:  # TooLarge, NotRegularFile and OutsideFolder included
                raise SweepError(f"point {p.num}'s {untrusted.printable(results_file)} cannot be read: "
                                 f"{untrusted.printable(getattr(error, 'strerror', None) or error)}") from None
    return runs


def write_report(sweep_dir: Path, *, reference: int | None = None, tolerance: float = 0.02,
                 runs_under: Path | None = None) -> list[Path]:
    """Build the sweep's report from its point records and write its files into sweep_dir; return them. Only run
    folders under runs_under (default :func:`runs_root`) are read; a point whose run lies elsewhere says so."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise SweepError(f"{sweep_dir} is not a folder; pass a sweep folder (<output_dir>/.sweeps/<time>)")
    points = read_points(sweep_dir)
    if not points:
        what = "no point has started" if (sweep_dir / "multirun.yaml").is_file() else "not a sweep folder"
        raise SweepError(f"{sweep_dir}: {what} (no <job num>/point.json under it)")
    outside = outside_root(points, runs_under or runs_root(sweep_dir))
    runs = load_results([p for p in points if p.num not in outside])
    points = [replace(p, error=outside[p.num]) if p.num in outside and not p.error else
              replace(p, error=f"its run folder {p.run_dir} has no results.json (moved or deleted?)")
              if p.status in COMPLETED and p.num not in runs and not p.error else p for p in points]
    ref = choose_reference(points, runs, reference)
    verdicts, compare_files, found = compare_points([p for p in points if p.num in runs], ref, tolerance=tolerance)
    table = sweep_table(points, runs, verdicts, found)
    text = markdown(table, points, sweep_dir=str(sweep_dir), reference=ref, tolerance=tolerance,
                    compare_files=sorted(n for n in compare_files if n.endswith(".md")), found=found,
                    notes={n: v for n, v in verdicts.items() if isinstance(v, str) and v.startswith("not comparable")})
    images = {"Scores per point": scores_png(table), "Throughput per point": throughput_png(table)}
    written = [write_atomic(inside(sweep_dir, name), data) for name, data in compare_files.items()]
    # names and values from the runs are data: none starts a formula in a spreadsheet that opens the file
    written.append(write_atomic(sweep_dir / "report.csv", table.map(untrusted.spreadsheet_cell).to_csv(index=False)))
    written.append(write_atomic(sweep_dir / "report.md", text))
    written += [write_atomic(sweep_dir / "scores.png", images["Scores per point"]),
                write_atomic(sweep_dir / "throughput.png", images["Throughput per point"])]
    links = sorted(n for n in compare_files if n.endswith(".html"))
    written.append(write_atomic(sweep_dir / "report.html", html_page(text, table, images, links, points=points,
                                                                     reference=ref, tolerance=tolerance, found=found)))
    return written
