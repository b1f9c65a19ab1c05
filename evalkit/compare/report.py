"""Stage 5b, report: the comparison as Markdown (terminal and file) and as an HTML page with plots.

Plots with matplotlib (Agg, no display): score differences with their intervals per task and metric
against the tolerance band, the log-probability drift histogram, and the output-length shift; with
``--locate``, the "Why" section (evalkit/compare/why.py) and the per-token drift up to each divergence.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

import pandas as pd

from evalkit.compare import stats
from evalkit.compare.paired import TaskDetail
from evalkit.compare.why import CLASSES, Flip, Localisation

MAX_LISTED = 10  # documents listed per category in the text report
MAX_WHY = 5  # flips shown in full (prompt tail, top-k on both engines) and plotted


def _ids(ids: list[int]) -> str:
    more = f" (+{len(ids) - MAX_LISTED} more)" if len(ids) > MAX_LISTED else ""
    return ", ".join(map(str, ids[:MAX_LISTED])) + more if ids else "none"


def detail_markdown(detail: TaskDetail) -> list[str]:
    lines = [f"### {detail.task} ({detail.filter})", ""]
    for metric, flips in detail.flips.items():
        lines.append(f"- {metric}: right -> wrong on {len(flips['right_to_wrong'])} "
                     f"[{_ids(flips['right_to_wrong'])}], wrong -> right on {len(flips['wrong_to_right'])} "
                     f"[{_ids(flips['wrong_to_right'])}]")
    if detail.generated:
        lines.append(f"- generations differ on {len(detail.generations)} of {detail.generated} documents")
        for g in detail.generations[:MAX_LISTED]:
            where = f"token {g['token_index']}, " if g["token_index"] is not None else ""
            lines.append(f"  - doc {g['doc_id']}: first differs at {where}char {g['char_index']} after "
                         f"{g['common']!r}: reference {g['reference']!r} vs candidate {g['candidate']!r}")
        reasons = ", ".join(f"{k}: {v}" for k, v in detail.finish_reasons.items()) or "none"
        lines.append(f"- finish reasons changed: {reasons}")
        t = detail.output_tokens
        lines.append(f"- output tokens: reference mean {t['reference']:.1f}, candidate mean {t['candidate']:.1f} "
                     f"(shift {t['mean_shift']:+.2f})")
    if detail.logprob:
        lp = detail.logprob
        lines.append(f"- log-prob drift over {lp['choices']} choices: max |d| {lp['max_abs']:.3g}, mean |d| "
                     f"{lp['mean_abs']:.3g}, median {lp['q50_abs']:.3g}, p90 {lp['q90_abs']:.3g}, "
                     f"p99 {lp['q99_abs']:.3g}; argmax changed on {int(lp.get('argmax_changed', 0))} documents")
    return lines + [""]


def with_noise(table: pd.DataFrame, noise: pd.DataFrame | None) -> pd.DataFrame:
    """The comparison with the noise pair's difference and discordant counts beside each row."""
    return table if noise is None else table.merge(noise, on=["task", "filter", "metric"], how="left")


SHOWN = ["task", "filter", "metric", "n", "reference", "candidate", "diff", "ci_low", "ci_high", "tolerance",
         "mcnemar_b", "mcnemar_c", "p_worse_holm", "p_equivalent_holm", "method", "verdict"]


def header(table: pd.DataFrame, *, tolerance: float, confidence: float, family: int | None = None,
           comparisons: int = 1) -> list[str]:
    """What the numbers are, what the exit code controls, how many documents the tolerance needs, the verdicts."""
    alpha, family = 1.0 - confidence, len(table) if family is None else family
    counts = table["verdict"].value_counts().to_dict()
    over = f"{family} rows" + (f" of {comparisons} comparisons" if comparisons > 1 else "")
    lines = [f"- exit code 1 when any row is `worse` (or `changed`, direction unknown): verdicts are Holm-adjusted "
             f"over all {over}, so a candidate with no change beyond the tolerance fails with probability at most "
             f"{alpha:g} (family-wise); `p_worse_holm`, `p_equivalent_holm`: the adjusted p-values",
             f"- tolerance per row (`tolerance`): ±{tolerance} absolute for 0-1 metrics, relative (a fraction of the "
             "reference's score; `diff` is then candidate / reference − 1) for unbounded ones, as `--tolerance-for` "
             f"sets them; {1 - 2 * alpha:.0%} intervals (the two one-sided tests' reading): Tango's score interval "
             "for 0/1 metrics (method `tango`, p-values exact up to 500 documents), a paired bootstrap for the "
             "others (`bootstrap`: mean difference; `bootstrap <aggregation>`: the metric's own lm-eval "
             "aggregation); `diff` is candidate − reference, negated where lower is better, so positive means "
             "better unless the note says the direction is unknown"]
    if 0 < tolerance < 1:
        needed = stats.documents_needed(tolerance, confidence=confidence)
        fewer = sorted(set(table.loc[(table["method"] == "tango") & (table["n"] < needed), "task"]))
        lines.append(f"- with no flips, ±{tolerance} needs about {needed} documents to show `equivalent` on a 0/1 "
                     "metric alone (more when many rows share the family); "
                     + (f"fewer here: {', '.join(fewer)}" if fewer else "every 0/1 row here has that many"))
    return lines + ["- verdicts: " + ", ".join(f"{k} {v}" for k, v in counts.items())]


def markdown(reference: str, candidate: str, table: pd.DataFrame, details: list[TaskDetail], *,
             tolerance: float, confidence: float, noise: pd.DataFrame | None = None,
             why: Localisation | None = None, family: int | None = None, comparisons: int = 1) -> str:
    shown = with_noise(table[[c for c in SHOWN if c in table.columns]], noise)
    notes = [f"- {r.task} / {r.metric} ({r.filter}): {r.note}" for r in table.itertuples() if r.note]
    lines = ["# evalkit compare", "", f"- reference: `{reference}`", f"- candidate: `{candidate}`",
             *header(table, tolerance=tolerance, confidence=confidence, family=family, comparisons=comparisons), "",
             shown.to_markdown(index=False, floatfmt=".4g"), ""]
    if notes:
        lines += ["Notes:", "", *notes, ""]
    lines += ["## Samples", ""]
    for detail in details:
        lines += detail_markdown(detail)
    if why is not None:
        lines += why_markdown(why, table, details)
    return "\n".join(lines)


def score_change(details: list[TaskDetail], task: str, doc_id: int) -> str:
    """How a document's 0/1 score moved (the first metric that flipped it), or ""."""
    for detail in details:
        for metric, flips in (detail.flips.items() if detail.task == task else ()):
            for direction, ids in flips.items():
                if doc_id in ids:
                    return f"{metric}: {direction.replace('_to_', ' -> ')}"
    return ""


def only_near_ties(why: Localisation, table: pd.DataFrame, details: list[TaskDetail]) -> list[str]:
    """One line per `worse` task whose right -> wrong documents were all near-ties."""
    kinds = {(x.task, x.doc_id): x.kind for x in [*why.flips, *why.choices]}
    lines = []
    for row in table[table["verdict"] == "worse"].itertuples():
        lost = {d for detail in details if (detail.task, detail.filter) == (row.task, row.filter)
                for d in detail.flips.get(row.metric, {}).get("right_to_wrong", [])}
        if lost and all(kinds.get((row.task, d)) == "near-tie" for d in lost):
            lines.append(f"- **{row.task} / {row.metric} is `worse` on near-ties only**: all {len(lost)} documents it "
                         f"lost were near-ties (both engines within ±{why.near_tie} nats): noise any engine can show")
    return lines


def _margin(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def _tie(value: float | None) -> str:
    return " (an exact tie)" if value == 0.0 else ""


def _top(flip: Flip, top: tuple) -> str:
    return ", ".join(f"{flip.token_text(t)!r} {lp:.3f}" for t, lp in top)


def flip_markdown(flip: Flip, score: str) -> list[str]:
    """One flip in full: where, both tokens, both engines' log-probabilities, margins and top-k, the drift."""
    ref, cand = flip.token_text(flip.ref_token), flip.token_text(flip.cand_token)
    lines = [f"#### {flip.task} doc {flip.doc_id}: {flip.kind}" + (f" ({score})" if score else ""), "",
             f"- prompt tail: {flip.prompt_tail!r}",
             f"- output token {flip.index}, after {flip.shared_output!r}: reference {ref!r}, candidate {cand!r}"]
    for name, side in (("reference engine", flip.ref_side), ("candidate engine", flip.cand_side)):
        lines.append(f"- {name}: lp({ref!r}) {_margin(side.ref_logprob)}, lp({cand!r}) {_margin(side.cand_logprob)}, "
                     f"margin {_margin(side.margin)}{_tie(side.margin)}; top-{len(side.top)}: {_top(flip, side.top)}")
    shared = flip.prompt_tokens + flip.index - 1
    drift = "none (no shared tokens)" if flip.drift is None else f"{flip.drift:.3g} nats"
    return lines + [f"- drift before it: max |Δ log-prob| {drift} over {shared} shared tokens", ""]


FLIP_COLUMNS = ["task", "doc", "token", "reference", "candidate", "ref margin", "cand margin", "drift", "class",
                "score"]
CHOICE_COLUMNS = ["task", "doc", "reference's choice", "candidate's choice", "ref margin", "cand margin", "max drift",
                  "class", "score"]


def _table(columns: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows), ""]


def flip_rows(flips: list[Flip], details: list[TaskDetail]) -> list[list]:
    return [[f.task, f.doc_id, f.index, repr(f.token_text(f.ref_token)), repr(f.token_text(f.cand_token)),
             _margin(f.ref_side.margin), _margin(f.cand_side.margin), "n/a" if f.drift is None else f"{f.drift:.3g}",
             f.kind, score_change(details, f.task, f.doc_id)] for f in flips]


def why_header(why: Localisation) -> list[str]:
    counts = why.counts()
    line = lambda kind: ", ".join(f"{k} {counts[kind][k]}" for k in CLASSES)  # noqa: E731
    seconds = ", ".join(f"{k} {v:.1f} s" for k, v in why.seconds.items())
    return [f"- generations that differ: {len(why.flips)} located: {line('generations')}"
            + (f"; {len(why.skipped)} not located" if why.skipped else ""),
            f"- log-likelihood documents whose chosen answer changed: {len(why.choices)}: {line('choices')}",
            f"- margins: lp(reference's token) - lp(candidate's token) on each engine (log-likelihoods of the two "
            f"choices in each run); near-tie: both within ±{why.near_tie} nats; logit drift: otherwise, when the "
            f"candidate's log-probabilities of the shared tokens before the divergence (max |Δ|; for choices, of "
            f"the document's choices) moved more than the noise floor "
            + (f"{why.floor:.3g} nats ({why.floor_source})" if why.floor is not None
               else f"(none known, none needed: nothing to classify; {why.floor_source})"),
            *(f"- {side} engine: {text}" for side, text in why.engines.items()),
            f"- localisation took {seconds}" + ("" if why.engines else "; no engine started: no generation differs")]


def why_markdown(why: Localisation, table: pd.DataFrame, details: list[TaskDetail]) -> list[str]:
    """The "Why" section: counts per class, verdicts that rest on near-ties, every flip, the worst in full."""
    lines = ["## Why (--locate)", "", *why_header(why), *only_near_ties(why, table, details),
             *(f"- not located: {s}" for s in why.skipped), ""]
    lost = lambda f: score_change(details, f.task, f.doc_id).endswith("right -> wrong")  # noqa: E731
    flips = sorted(why.flips, key=lambda f: (not lost(f), -(f.ref_side.margin or 0.0)))
    if flips:
        lines += _table(FLIP_COLUMNS, flip_rows(flips, details))
        lines += [f"### The {min(MAX_WHY, len(flips))} worst (lost scores first, then the widest reference margin)", ""]
        for f in flips[:MAX_WHY]:
            lines += flip_markdown(f, score_change(details, f.task, f.doc_id))
    if why.choices:
        lines += _table(CHOICE_COLUMNS, [[c.task, c.doc_id, c.ref_choice, c.cand_choice, _margin(c.ref_margin),
                                          _margin(c.cand_margin), f"{c.drift:.3g}", c.kind,
                                          score_change(details, c.task, c.doc_id)] for c in why.choices])
    return lines


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def plots(table: pd.DataFrame, details: list[TaskDetail], tolerance: float) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images: dict[str, str] = {}
    table = table[table["ci_low"].notna() & table["ci_high"].notna()]  # rows not compared have no interval
    labels = [f"{r.task} / {r.metric} ({r.filter}) [{r.verdict}]" for r in table.itertuples()]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(labels) + 1.5))
    y = range(len(labels))
    unit = table["tolerance"] if "tolerance" in table else tolerance  # each row in units of its own tolerance
    diff, low, high = table["diff"] / unit, table["ci_low"] / unit, table["ci_high"] / unit
    ax.axvspan(-1, 1, color="tab:green", alpha=0.15, label="within the tolerance")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.errorbar(diff, list(y), xerr=[diff - low, high - diff], fmt="o", capsize=4)
    ax.set_yticks(list(y), labels)
    ax.set_xlabel("(candidate - reference) / the row's tolerance, oriented: positive is better "
                  "(unless the direction is unknown)")
    ax.set_title("Score differences with their intervals")
    ax.legend(loc="best")
    images["Score differences"] = _png(fig)
    plt.close(fig)
    drift = [d for detail in details for d in detail.logprob_diffs]
    if drift:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.hist(drift, bins=50)
        ax.set_xlabel("candidate - reference log-probability per choice (nats)")
        ax.set_ylabel("choices")
        ax.set_title("Log-probability drift")
        images["Log-probability drift"] = _png(fig)
        plt.close(fig)
    shift = [s for detail in details for s in detail.length_shift]
    if shift:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.hist(shift, bins=[b - 0.5 for b in range(min(shift), max(shift) + 2)])  # one bar per token count
        ax.set_xlabel("candidate - reference output tokens per document")
        ax.set_ylabel("documents")
        ax.set_title("Output length shift")
        images["Output length shift"] = _png(fig)
        plt.close(fig)
    return images


def why_plots(why: Localisation | None) -> dict[str, str]:
    """The per-token log-probability difference (candidate engine - reference engine, on the reference's
    tokens) along each of the worst flips' sequences, up to its divergence (x = 0)."""
    if why is None or not why.flips:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for flip in sorted(why.flips, key=lambda f: -(f.ref_side.margin or 0.0))[:MAX_WHY]:
        x = [p - (flip.prompt_tokens + flip.index - 1) for p in range(len(flip.deltas))]
        ax.plot(x, flip.deltas, linewidth=0.9, marker=".", markersize=3, alpha=0.8,
                label=f"{flip.task} doc {flip.doc_id} ({flip.kind})")
    ax.axhspan(-why.floor, why.floor, color="tab:green", alpha=0.3, label=f"noise floor ±{why.floor:.2g}")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("token position relative to the first divergent token (prompt and output)")
    ax.set_ylabel("candidate - reference engine log-prob (nats)")
    ax.set_title("Drift along the shared tokens up to each divergence")
    ax.legend(loc="best", fontsize=7)
    images = {"Why: drift up to the divergence": _png(fig)}
    plt.close(fig)
    return images


def html_page(text: str, table: pd.DataFrame, images: dict[str, Any]) -> str:
    figures = "\n".join(f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" '
                        f'src="data:image/png;base64,{data}">' for title, data in images.items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>evalkit compare</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px}}pre{{white-space:pre-wrap;background:#f6f6f6;padding:1em}}</style>
</head><body>
<h1>evalkit compare</h1>
{table.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="")}
{figures}
<h2>Report</h2><pre>{html.escape(text)}</pre>
</body></html>
"""
