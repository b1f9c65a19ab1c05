"""Compare's plots, only those that carry information, each with a caption saying what to read in it (page.Plot):
the score differences with their intervals against each row's tolerance (two rows or more), the log-probability
drift of log-likelihood tasks (a sentence instead when nothing moved beyond the noise floor), the output-length
shift binned on whole tokens (a sentence when no length changed), and with --locate the drift along the shared
tokens up to each divergence. matplotlib with Agg: no display."""

from __future__ import annotations

import numpy as np
import pandas as pd

from evalkit import page
from evalkit.compare.statistics.paired import TaskDetail
from evalkit.compare.locate.why import NOISE_FLOOR, Localisation
from evalkit.page import png, pyplot

MAX_WHY = 5  # flips plotted (markdown.py shows as many in full)


DIFFERENCES = ("Each row's difference (dot) with its interval (bar), in units of the row's own tolerance, oriented "
               "so that right is better: a bar wholly left of the green band is worse, a bar inside it equivalent, a "
               "bar across its edge inconclusive (more documents would decide it).")


def differences_plot(table: pd.DataFrame, tolerance: float) -> page.Plot | None:
    """The intervals against the tolerance band; None with fewer than two rows (the table says it all)."""
    table = table[table["ci_low"].notna() & table["ci_high"].notna()]  # rows not compared have no interval
    if len(table) < 2:
        return None
    plt = pyplot()
    labels = [f"{r.task} / {r.metric} ({r.filter}) [{r.verdict}]" for r in table.itertuples()]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(labels) + 1.5))
    y = range(len(labels))
    unit = table["tolerance"] if "tolerance" in table else tolerance  # each row in units of its own tolerance
    diff, low, high = table["diff"] / unit, table["ci_low"] / unit, table["ci_high"] / unit
    ax.axvspan(-1, 1, color="tab:green", alpha=0.15, label="within the tolerance")
    ax.axvline(0, color="black", linewidth=0.8)
    # a zero-width interval (every document's change the same ratio) may miss diff by a rounding: no bar, not an error
    bars = [np.maximum(np.asarray(side, dtype=float), 0.0) for side in (diff - low, high - diff)]
    ax.errorbar(diff.astype(float), list(y), xerr=bars, fmt="o", capsize=4)
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlabel("(candidate - reference) / the row's tolerance; green: within it")
    plot = page.Plot(png(fig), DIFFERENCES)
    plt.close(fig)
    return plot


def drift_plot(drift: list[float], floor: float) -> page.Plot:
    """Per-choice log-probability differences; a sentence when none is above the noise floor."""
    size = np.abs(drift)  # one number per choice: 400,000 for 100,000 documents of four choices
    moved = size[size > floor]
    if not len(moved):
        return page.Plot(None, f"no log-probability drift above the noise floor ({floor:g} nats) on {len(drift)} "
                               "choices of the log-likelihood tasks")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.hist(drift, bins=min(50, max(10, len(set(drift)))))
    ax.axvspan(-floor, floor, color="tab:green", alpha=0.3, label=f"noise floor ±{floor:g}")
    ax.set_xlabel("candidate - reference log-probability per choice (nats)")
    ax.set_ylabel("choices")
    ax.legend(loc="best")
    plot = page.Plot(png(fig), f"{len(moved)} of {len(drift)} choices moved beyond the noise floor ({floor:g} "
                                f"nats), the largest by {moved.max():.3g}: a spread centred on 0 is "
                                "rounding; a shifted or wide one, a candidate that computes something else.")
    plt.close(fig)
    return plot


def length_plot(shift: list[int]) -> page.Plot:
    """Output-length changes, one bar per token count; a sentence when no length changed."""
    changed = [s for s in shift if s]
    if not changed:
        return page.Plot(None, f"no output length changed: all {len(shift)} generations have as many tokens in "
                               "both runs")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.hist(shift, bins=[b - 0.5 for b in range(min(shift), max(shift) + 2)], rwidth=0.85)  # a bar per integer
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("candidate - reference output tokens per document")
    ax.set_ylabel("documents")
    plot = page.Plot(png(fig), f"{len(changed)} of {len(shift)} generations changed length (mean shift "
                                f"{sum(shift) / len(shift):+.2f} tokens): bars right of 0 are longer answers, left "
                                "shorter; a tall bar at the maximum length means answers now run out of tokens.")
    plt.close(fig)
    return plot


def plots(table: pd.DataFrame, details: list[TaskDetail], tolerance: float,
          floor: float = NOISE_FLOOR) -> dict[str, page.Plot]:
    """The plots that carry information, each with its caption: the differences (two rows or more), the
    log-probability drift and the length shift (a sentence instead where nothing moved)."""
    images: dict[str, page.Plot] = {}
    differences = differences_plot(table, tolerance)
    if differences is not None:
        images["Score differences"] = differences
    drift = [d for detail in details for d in detail.logprob_diffs]
    if drift:
        images["Log-probability drift"] = drift_plot(drift, floor)
    shift = [s for detail in details for s in detail.length_shift]
    if shift:
        images["Output length shift"] = length_plot(shift)
    return images


def why_plots(why: Localisation | None) -> dict[str, page.Plot]:
    """The per-token log-probability difference (candidate engine - reference engine, on the reference's
    tokens) along each of the worst flips' sequences, up to its divergence (x = 0)."""
    if why is None or not why.flips:
        return {}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for flip in sorted(why.flips, key=lambda f: -(f.ref_side.margin or 0.0))[:MAX_WHY]:
        x = [p - (flip.prompt_tokens + flip.index - 1) for p in range(len(flip.deltas))]
        ax.plot(x, flip.deltas, linewidth=0.9, marker=".", markersize=3, alpha=0.8,
                label=f"{flip.task} doc {flip.doc_id} ({flip.kind})")
    ax.axhspan(-why.floor, why.floor, color="tab:green", alpha=0.3, label=f"noise floor ±{why.floor:.2g}")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("token position relative to the first divergent token (prompt and output)")
    ax.set_ylabel("candidate - reference engine log-prob (nats)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)  # beside the lines, not over them
    caption = ("How far the candidate engine's log-probabilities of the shared tokens had moved from the reference "
               "engine's before each divergence (x = 0), for the worst flips: inside the green noise floor up to 0, "
               "the flip is a near-tie or chance; lines that leave it earlier mean the candidate computes another "
               "function (logit drift).")
    images = {"Why: drift up to the divergence": page.Plot(png(fig), caption)}
    plt.close(fig)
    return images
