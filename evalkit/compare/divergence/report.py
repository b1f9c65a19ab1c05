"""The divergence in compare's text report: one table under llama.cpp's names (per task and over all tasks),
the lines that say what it counted and how far the bound sees (the top-k of both runs, or the reference's
top-k read on the candidate), the verdict against a noise run (or that none is claimed), and with ``--locate``
each changed document's highest-KLD position."""

from __future__ import annotations

import math

import numpy as np

from evalkit.compare.divergence.between import CONFIDENCE, Divergence, Task
from evalkit.compare.divergence.stats import Estimate, Summary
from evalkit.compare.locate.why import Localisation
from evalkit.run.divergence_record import KINDS

KIND_NAMES = {"loglikelihood": "log-likelihood continuations", "loglikelihood_rolling": "rolling",
              "generate_until": "generated up to the first parting"}
PERCENTILES = ("Maximum", "99.9%", "99.0%", "95.0%", "90.0%", "Median")  # the skewed upper half matters
COLUMNS = ["task", "documents", "positions", "Mean KLD ± SE [95 %]", *(f"KLD {p}" for p in PERCENTILES),
           "Same top p ± SE [95 %]", "Mean Δp", "RMS Δp", "PPL(Q)/PPL(base) [95 %]"]


def _g(value: float, digits: int = 4) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}g}"


def estimate(e: Estimate, *, scale: float = 1.0, unit: str = "", se: bool = True, digits: int = 4) -> str:
    """A figure as llama.cpp prints it (value ± SE, then the unit) with its interval; – where undefined."""
    if not math.isfinite(e.value):
        return "–"
    text = _g(e.value * scale, digits)
    if se and math.isfinite(e.se):
        text += f" ± {_g(e.se * scale, 2)}"
    text += unit
    if math.isfinite(e.low) and math.isfinite(e.high):
        text += f" [{_g(e.low * scale, digits)}, {_g(e.high * scale, digits)}]"
    return text


def row(name: str, s: Summary) -> list[str]:
    return [name, str(s.documents), str(s.positions), estimate(s.mean_kld),
            *(_g(s.kld_percentiles[p], 3) for p in PERCENTILES),
            estimate(s.same_top, scale=100, unit=" %", digits=5), estimate(s.mean_dp, scale=100, unit=" %", digits=3),
            estimate(s.rms_dp, scale=100, unit=" %", se=False, digits=3), estimate(s.ppl_ratio, se=False, digits=6)]


def rows(d: Divergence) -> list[list[str]]:
    """One row per task, and all tasks together (every position weighs the same) when there are several."""
    out = [row(name, s) for name, s in d.per_task.items()]
    return out + ([row("all tasks", d.overall)] if len(d.per_task) > 1 else [])


def kinds(tasks: dict[str, Task]) -> str:
    counts = {name: sum(int((t.kinds == i).sum()) for t in tasks.values()) for i, name in enumerate(KINDS)}
    return ", ".join(f"{KIND_NAMES[k]} {n}" for k, n in counts.items() if n) or "none"


def verdict_line(d: Divergence) -> str:
    v = d.verdict
    if v is None:
        return ("- no noise run: the figures only, no verdict claimed (`--noise RUN`, a second run of the "
                "reference's configuration, tests whether the candidate moved beyond the engine's own noise)")
    if v.label == "unusable":
        return f"- against the noise run: **unusable** (exit 2): {v.reason}"
    return (f"- against the noise run: **{v.label}** (exit {v.exit_code}): the candidate's mean KLD per document "
            f"{_g(v.candidate, 3)}, the noise run's {_g(v.noise, 3)}; {v.reason}")


def lines(d: Divergence) -> list[str]:
    """What the table counted and how to read it, then the verdict line."""
    s, text = d.overall, sum(t.texts.n for t in d.tasks.values())
    out = [f"- KL(P_ref ‖ P_cand) in nats and llama.cpp's figures (`llama-perplexity --kl-divergence`); ± the "
           f"standard error, [ ] the {CONFIDENCE:.0%} interval, both over documents (docs/divergence.md)",
           f"- positions where both runs saw the same context token for token: {s.positions} in {s.documents} "
           f"documents ({kinds(d.tasks)}); a context several requests of a document share counts once; Δp and "
           f"the PPL ratio over the {text} positions whose text token is the same in both runs",
           f"- a lower bound: {d.bound}; it captures {_g(s.captured, 3)} of the reference mass (the KLD of "
           "the mass outside it is not seen)"]
    unshared = sum(t.unshared for t in d.tasks.values())
    if unshared:
        out.append(f"- {unshared} shared contexts have no token in both runs' top-{d.k}: KLD bound 0, top-1 differs")
    if s.undecided_top:
        out.append(f"- Same top p leaves out {s.undecided_top} positions whose top-1 agreement is unknown")
    return out + [f"- {note}" for note in d.notes] + [verdict_line(d)]


def markdown(d: Divergence) -> list[str]:
    """The section of the text report: one line where there is no table."""
    if d.missing:
        return [f"Divergence: none: {d.missing}", *([verdict_line(d)] if d.verdict else []), ""]
    body = [COLUMNS, *rows(d)]
    table = ["| " + " | ".join(r) + " |" for r in body[:1]] + ["|" + "---|" * len(COLUMNS)] + \
        ["| " + " | ".join(r) + " |" for r in body[1:]]
    return ["## Divergence (token level)", "", *lines(d), "", *table, ""]


def peak(d: Divergence, task: str, doc: int) -> dict | None:
    """The document's highest-KLD position: request, position, kind, KLD and both runs' text tokens."""
    t = d.tasks.get(task)
    if t is None:
        return None
    at = np.flatnonzero(t.docs == doc)
    if not len(at):
        return None
    i = at[np.argmax(t.contexts.kld[at])]
    return {"request": int(t.request[i]), "position": int(t.position[i]), "kind": KIND_NAMES[KINDS[t.kinds[i]]],
            "kld": float(t.contexts.kld[i]), "ref": int(t.ref_text[i]), "cand": int(t.cand_text[i])}


PEAK_COLUMNS = ["task", "doc", "class", "request", "position", "kind", "KLD", "reference token", "candidate token"]


def peaks(d: Divergence, why: Localisation) -> list[str]:
    """--locate with both runs' records: each changed document's highest-KLD position (tokens as --locate
    decoded them, #id where it decoded none: a log-likelihood document needs no engine)."""
    changed = [(f.task, f.doc_id, f.kind, f.token_text) for f in why.flips] + \
        [(c.task, c.doc_id, c.kind, lambda t: f"#{t}") for c in why.choices]
    found = []
    for task, doc, kind, text in changed:
        p = None if d.missing else peak(d, task, doc)
        if p is not None:
            found.append([task, doc, kind, p["request"], p["position"], p["kind"], _g(p["kld"]),
                          repr(text(p["ref"])), repr(text(p["cand"]))])
    if not found:
        return []
    return ["### The highest-KLD position of each changed document", "",
            "| " + " | ".join(PEAK_COLUMNS) + " |", "|" + "---|" * len(PEAK_COLUMNS),
            *("| " + " | ".join(map(str, r)) + " |" for r in found), ""]
