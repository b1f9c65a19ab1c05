"""The divergence on compare's page: the lines and the table of the text report as HTML, and the plots that
carry information, each with its caption (page.Plot): the KLD percentiles per task, the per-document KLD of
the candidate beside the noise run's (with --noise), and Same top p per task (two tasks or more). matplotlib
through evalkit/page.py's pyplot."""

from __future__ import annotations

import numpy as np

from evalkit import page
from evalkit.compare.divergence import report
from evalkit.compare.divergence.between import Divergence
from evalkit.page import png, pyplot

LEVELS = np.concatenate([np.linspace(0, 90, 46), np.linspace(90.5, 99.5, 19), [99.9, 100.0]])


def floor(*values: np.ndarray) -> float:
    """Where a zero KLD is drawn on log axes (said in the captions): a tenth of the smallest positive value, so
    that the axis spans what was measured rather than down to an arbitrary tiny number."""
    positive = np.concatenate([np.asarray(v, dtype=float).ravel() for v in values])
    positive = positive[positive > 0]
    return float(positive.min()) / 10 if len(positive) else 1e-12


def percentile_plot(d: Divergence) -> page.Plot:
    """KLD against its percentile, one line per task (and all tasks): where the tail rises."""
    series = {name: t.contexts.kld for name, t in d.tasks.items() if t.contexts.n}
    if len(series) > 1:
        series["all tasks"] = np.concatenate(list(series.values()))
    if all(float(np.nanmax(v)) <= 0 for v in series.values()):
        return page.Plot(None, f"every position's KLD bound is 0: the two runs' top-{d.k} agree to the last digit")
    zero = floor(*series.values())
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, values in series.items():
        ax.plot(LEVELS, np.maximum(np.percentile(values, LEVELS), zero), label=name,
                linewidth=2.0 if name == "all tasks" else 1.0)
    ax.set_yscale("log")
    ax.set_xlabel("percentile of positions")
    ax.set_ylabel("KLD (nats, a lower bound)")
    ax.legend(loc="upper left", fontsize=7)
    plot = page.Plot(png(fig), f"KLD at each percentile of the positions (llama.cpp's percentiles are points of "
                               f"these lines; zero drawn at {zero:.2g}): a flat line that rises only in the last "
                               "percent is a few positions far apart, a high line everywhere a candidate that "
                               "moves everything.")
    plt.close(fig)
    return plot


def documents_plot(d: Divergence) -> page.Plot:
    """Per document, the candidate's mean KLD against the noise run's, the diagonal between them."""
    common = [key for key in d.documents if key in d.noise]
    cand, noise = np.array([d.documents[k] for k in common]), np.array([d.noise[k] for k in common])
    zero = floor(cand, noise)
    cand, noise = np.maximum(cand, zero), np.maximum(noise, zero)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 5.2))
    ax.scatter(noise, cand, s=9, alpha=0.6)
    low, high = float(min(cand.min(), noise.min())), float(max(cand.max(), noise.max()))
    ax.plot([low, high], [low, high], color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("noise run: mean KLD per document")
    ax.set_ylabel("candidate: mean KLD per document")
    above = int((cand > noise).sum())
    words = f" Verdict: {d.verdict.label} ({d.verdict.reason})." if d.verdict else ""
    plot = page.Plot(png(fig), f"Each of {len(common)} documents: the candidate's divergence from the reference "
                               f"against the noise run's (zero drawn at {zero:.2g}). {above} lie above the diagonal: "
                               f"the candidate moved them further than the engine moves on its own.{words}")
    plt.close(fig)
    return plot


def same_top_plot(d: Divergence) -> page.Plot:
    """Same top p per task with its interval."""
    names = list(d.per_task)
    values = [d.per_task[n].same_top for n in names]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.4))
    x = np.array([v.value for v in values]) * 100
    low = x - np.array([v.low for v in values]) * 100
    high = np.array([v.high for v in values]) * 100 - x
    ax.errorbar(x, range(len(names)), xerr=[np.nan_to_num(low), np.nan_to_num(high)], fmt="o", capsize=4)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("Same top p (%): the most likely token is the same in both runs")
    plot = page.Plot(png(fig), "How often both runs' most likely next token is the same, per task, with its "
                               "interval over documents: a task far left of the others is where the candidate's "
                               "choices moved.")
    plt.close(fig)
    return plot


def plots(d: Divergence) -> dict[str, page.Plot]:
    if d.missing:
        return {}
    images = {"Divergence: KLD percentiles": percentile_plot(d)}
    if d.noise and d.documents:
        images["Divergence: candidate and noise per document"] = documents_plot(d)
    if len(d.per_task) > 1:
        images["Divergence: Same top p per task"] = same_top_plot(d)
    return images


def section(d: Divergence | None) -> str:
    """The page's divergence section: a sentence where there is no table."""
    if d is None:
        return ""
    if d.missing:
        verdict = page.escape(report.verdict_line(d).removeprefix("- ").replace("**", "")) if d.verdict else ""
        return (f"<h2 id=divergence>Divergence</h2>\n<p class=none>{page.escape(d.missing)}</p>" +
                (f"\n<p class=none>{verdict}</p>" if verdict else ""))
    items = page.markdown_html("\n".join(report.lines(d)))  # the text report's lines, a list
    cells = [[page.cell(value, css="" if i == 0 else "num") for i, value in enumerate(r)] for r in report.rows(d)]
    table = page.table(report.COLUMNS, cells, numeric=set(report.COLUMNS[1:]),
                       optional={"documents", "positions", *(f"KLD {p}" for p in report.PERCENTILES[1:])})
    figures = [page.figure(name, plot) for name, plot in plots(d).items()]
    return "\n".join(["<h2 id=divergence>Divergence (token level)</h2>", f"<div class=facts>{items}</div>",
                      f"<div class=scroll>{table}</div>", *figures])
