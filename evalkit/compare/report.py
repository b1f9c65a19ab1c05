"""Stage 5b, report: the comparison as Markdown (terminal and file) and as an HTML page with plots.

Plots with matplotlib (Agg, no display): score differences with their intervals per task and metric
against the tolerance band, the log-probability drift histogram, and the output-length shift.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

import pandas as pd

from evalkit.compare import stats
from evalkit.compare.paired import TaskDetail

MAX_LISTED = 10  # documents listed per category in the text report


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


def header(table: pd.DataFrame, *, tolerance: float, confidence: float) -> list[str]:
    """What the numbers are, how many documents the tolerance needs, and the verdict counts."""
    counts = table["verdict"].value_counts().to_dict()
    lines = [f"- tolerance ±{tolerance} (metric units); {confidence:.0%} intervals: Tango's score interval for 0/1 "
             "metrics (method `tango`), a paired bootstrap for the others (`bootstrap`: mean difference; "
             "`bootstrap <aggregation>`: the metric's own lm-eval aggregation); `diff` is candidate − reference, "
             "negated where lower is better, so positive means better unless the note says the direction is unknown"]
    if 0 < tolerance < 1:
        needed = stats.documents_needed(tolerance, confidence=confidence)
        fewer = sorted(set(table.loc[(table["method"] == "tango") & (table["n"] < needed), "task"]))
        lines.append(f"- with no flips, ±{tolerance} needs about {needed} documents to show `equivalent` on a 0/1 "
                     "metric; " + (f"fewer here: {', '.join(fewer)}" if fewer else "every 0/1 row here has that many"))
    return lines + ["- verdicts: " + ", ".join(f"{k} {v}" for k, v in counts.items())]


def markdown(reference: str, candidate: str, table: pd.DataFrame, details: list[TaskDetail], *,
             tolerance: float, confidence: float, noise: pd.DataFrame | None = None) -> str:
    shown = with_noise(table, noise).drop(columns=["note"])
    notes = [f"- {r.task} / {r.metric} ({r.filter}): {r.note}" for r in table.itertuples() if r.note]
    lines = ["# evalkit compare", "", f"- reference: `{reference}`", f"- candidate: `{candidate}`",
             *header(table, tolerance=tolerance, confidence=confidence), "",
             shown.to_markdown(index=False, floatfmt=".4g"), ""]
    if notes:
        lines += ["Notes:", "", *notes, ""]
    lines += ["## Samples", ""]
    for detail in details:
        lines += detail_markdown(detail)
    return "\n".join(lines)


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
    labels = [f"{r.task} / {r.metric} ({r.filter})" for r in table.itertuples()]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(labels) + 1.5))
    y = range(len(labels))
    ax.axvspan(-tolerance, tolerance, color="tab:green", alpha=0.15, label=f"tolerance ±{tolerance}")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.errorbar(table["diff"], list(y), xerr=[table["diff"] - table["ci_low"], table["ci_high"] - table["diff"]],
                fmt="o", capsize=4)
    ax.set_yticks(list(y), labels)
    ax.set_xlabel("candidate - reference, oriented: positive is better (unless the direction is unknown)")
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
