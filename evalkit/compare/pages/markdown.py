"""A comparison's text report in Markdown (terminal and file), with ``--locate`` its "Why" section
(evalkit/compare/locate/why.py) and the divergence's table (evalkit/compare/divergence/report.py); the HTML page
that renders it is html_page.py's."""

from __future__ import annotations

import pandas as pd

from evalkit.compare.statistics import proportions, verdict
from evalkit.compare.divergence import report as divergence_report
from evalkit.compare.divergence.between import Divergence
from evalkit.compare.statistics.paired import TaskDetail
from evalkit.compare.pages.plots import MAX_WHY
from evalkit.compare.locate.why import CLASSES, Flip, Localisation

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


SHOWN = ["task", "filter", "metric", "n", "reference", "candidate", "diff", "ci_low", "ci_high", "tolerance",
         "mcnemar_b", "mcnemar_c", "p_worse_holm", "p_equivalent_holm", "mde", "method", "verdict"]


def header(table: pd.DataFrame, *, tolerance: float, confidence: float, family: int | None = None,
           comparisons: int = 1) -> list[str]:
    """What the numbers are, what the exit code controls, how many documents the tolerance needs, the verdicts."""
    alpha, family = 1.0 - confidence, len(table) if family is None else family
    counts = table["verdict"].value_counts().to_dict()
    over = f"{family} rows" + (f" of {comparisons} comparisons" if comparisons > 1 else "")
    lines = [f"- exit code 1 when any row is `worse` (or `changed`, direction unknown): "
             f"{verdict.adjusted_over(over)}, so a candidate with no change beyond the tolerance fails with probability at most "
             f"{alpha:g} (family-wise); `p_worse_holm`, `p_equivalent_holm`: the adjusted p-values; `mde`: the "
             "smallest drop each row could have shown `worse` at its size (its tolerance plus its interval's upper "
             "half-width), so a passing gate says how much it could see",
             f"- tolerance per row (`tolerance`): ±{tolerance} absolute for 0-1 metrics, relative (a fraction of the "
             "reference's score; `diff` is then (candidate − reference) / |reference|, the sign of the difference whatever the sign of the score) for unbounded ones, as `--tolerance-for` "
             "sets them; `diff` is candidate − reference, negated where lower is better, so positive means better "
             "unless the note says the direction is unknown",
             f"- `ci_low`, `ci_high`: the {1 - 2 * alpha:.0%} interval each row's own one-sided tests at {alpha:g} "
             "invert, before the adjustment for the family: it lies below −tolerance exactly when the row's test "
             "of `worse` rejects alone, inside ±tolerance exactly when its two tests of equivalence do; Holm over "
             f"{over} asks more of each row, so a row inside can still be `inconclusive` (read `p_equivalent_holm`; "
             "its note says so); at 0 the level is half of it a side, as either direction could be claimed. "
             "Method `tango`: 0/1 metrics, exact unconditional tests ordered by Tango's score, at every size; "
             "`betting`: means of values in [0, 1] or in a range declared with --range-for (a relative row, a % "
             "tolerance on a 0/1 metric too), valid at every size; `sign-flip`: other means, sign-flip test with "
             "a pseudo-document for what skewed differences could hide, from 200 documents on (untested below); "
             "`sign-flip <aggregation>`: perplexities, the same test on per-document log-likelihood changes, from "
             "200 documents on too; `sign-flip stratified` (and "
             "`sign-flip stratified <aggregation>`): a group of means (of perplexities), the same test with each "
             "document weighted by its leaf; `bootstrap <aggregation>`, `bootstrap stratified`: the metric's own "
             "lm-eval aggregation, bootstrapped, from 30 documents on (a group: in its smallest leaf)"]
    if 0 < tolerance < 1:
        needed = proportions.documents_needed(tolerance, confidence=confidence)
        fewer = sorted(set(table.loc[(table["method"] == "tango") & (table["n"] < needed), "task"]))
        lines.append(f"- with no flips, ±{tolerance} needs about {needed} documents to show `equivalent` on a 0/1 "
                     "metric alone (more when many rows share the family); "
                     + (f"fewer here: {', '.join(fewer)}" if fewer else "every 0/1 row here has that many"))
    return lines + ["- verdicts: " + ", ".join(f"{k} {v}" for k, v in counts.items())]


def markdown(reference: str, candidate: str, table: pd.DataFrame, details: list[TaskDetail], *,
             tolerance: float, confidence: float, noise: pd.DataFrame | None = None,
             why: Localisation | None = None, family: int | None = None, comparisons: int = 1,
             divergence: Divergence | None = None) -> str:
    """The text report: the scores' table, the divergence (when compare read both runs' records), the samples
    that changed and, with --locate, why (with each changed document's highest-KLD position)."""
    shown = with_noise(table[[c for c in SHOWN if c in table.columns]], noise)
    notes = [f"- {r.task} / {r.metric} ({r.filter}): {r.note}" for r in table.itertuples() if r.note]
    lines = ["# evalkit compare", "", f"- reference: `{reference}`", f"- candidate: `{candidate}`",
             *header(table, tolerance=tolerance, confidence=confidence, family=family, comparisons=comparisons), "",
             shown.to_markdown(index=False, floatfmt=".4g"), ""]
    if notes:
        lines += ["Notes:", "", *notes, ""]
    if divergence is not None:
        lines += divergence_report.markdown(divergence)
    lines += ["## Samples", ""]
    for detail in details:
        lines += detail_markdown(detail)
    if why is not None:
        lines += why_markdown(why, table, details)
        lines += divergence_report.peaks(divergence, why) if divergence is not None else []
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

