"""The documents that changed between two runs, for the HTML page: per task and filter, each document whose score
flipped (right -> wrong first, then wrong -> right) or whose generation changed, with its prompt, its target,
both runs' answers (for a generation its output, the first differing character marked) and, where --locate
ran, the first divergent token with its class and both engines' top alternatives. Pure: samples in, records and
HTML out."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from evalkit import page
from evalkit.compare.statistics.paired import TaskDetail
from evalkit.compare.runs import Run
from evalkit.compare.locate.why import Flip, Localisation, choice_logprobs

MAX_ROWS = 50  # documents shown per task and filter; the samples files hold the rest
ORDER = ("right_to_wrong", "wrong_to_right")  # lost scores first


@dataclass(frozen=True)
class Changed:
    """One document that changed: how, and both runs' samples."""

    task: str
    filter: str
    doc_id: int
    change: str  # "exact_match: right → wrong; ...", or "output changed, score the same"
    lost: bool  # a score went right -> wrong
    reference: dict[str, Any]
    candidate: dict[str, Any]


def anchor(task: str, filt: str) -> str:
    """The id of a task and filter's table of changed documents (the score table links to it)."""
    return "changed-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{task}-{filt}")


def changes(detail: TaskDetail) -> dict[int, list[str]]:
    """doc id -> how its scores moved ("acc: right → wrong"), right -> wrong first; then generations that
    changed with no score flipped."""
    moved: dict[int, list[str]] = {}
    for direction in ORDER:
        for metric, flips in detail.flips.items():
            for doc in flips.get(direction, []):
                moved.setdefault(doc, []).append(f"{metric}: {direction.replace('_to_', ' → ').replace('_', ' ')}")
    for generation in detail.generations:
        moved.setdefault(generation["doc_id"], ["output changed, score the same"])
    return moved


def changed(reference: Run, candidate: Run, details: list[TaskDetail]) -> dict[tuple[str, str], list[Changed]]:
    """(task, filter) -> its changed documents, lost scores first (in the order of details)."""
    found = {}
    for detail in details:
        rows = []
        for doc, moves in changes(detail).items():
            key = (doc, detail.filter)
            rows.append(Changed(task=detail.task, filter=detail.filter, doc_id=doc, change="; ".join(moves),
                                lost=any("right → wrong" in m for m in moves),
                                reference=reference.samples[detail.task][key],
                                candidate=candidate.samples[detail.task][key]))
        if rows:
            found[(detail.task, detail.filter)] = sorted(rows, key=lambda r: not r.lost)  # stable: order kept
    return found


def choice_text(sample: dict[str, Any], index: int) -> str:
    """The continuation of choice index, as lm-eval recorded its arguments."""
    args = (sample.get("arguments") or {}).get(f"gen_args_{index}") or {}
    return str(args.get("arg_1", f"choice {index}"))


def differ_at(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def answer_html(sample: dict[str, Any], other: dict[str, Any], side: str) -> str:
    """A run's answer: a generation's extracted answer and its output with the part that differs marked; a
    log-likelihood document's chosen continuation (highest log-likelihood) and every choice's log-likelihood."""
    output = sample.get("raw_output")
    if output is not None:
        cut = differ_at(output, other.get("raw_output") or "")
        rest = page.escape(output[cut:]) or "<small>(ends here)</small>"
        marked = (f"{page.escape(output[:cut])}<mark class={side}>{rest}</mark>"
                  if output != other.get("raw_output") else page.escape(output))
        return f"<b>{page.escape(sample.get('filtered_output'))}</b><pre>{marked}</pre>"
    lls = choice_logprobs(sample)
    if not lls:
        return page.escape(sample.get("filtered_output"))
    best = max(range(len(lls)), key=lls.__getitem__)
    listed = ", ".join(f"{page.escape(repr(choice_text(sample, i)))} {lp:.3f}" for i, lp in enumerate(lls))
    return f"<b>{page.escape(choice_text(sample, best).strip())}</b><br><small>log-likelihoods: {listed}</small>"


def prompt_html(sample: dict[str, Any]) -> str:
    prompt = str(sample.get("prompt") or "")
    tail = " ".join(prompt.split())[-70:]
    return page.folded(("…" if len(prompt) > 70 else "") + tail, f"<pre>{page.escape(prompt)}</pre>")


def flip_html(flip: Flip) -> str:
    """--locate's reading of one generation: the divergent token, its class, margins, both engines' top-k."""
    ref, cand = (page.escape(repr(flip.token_text(t))) for t in (flip.ref_token, flip.cand_token))
    margins = ", ".join(f"{name} {'n/a' if s.margin is None else f'{s.margin:+.3f}'}"
                        for name, s in (("reference engine", flip.ref_side), ("candidate engine", flip.cand_side)))
    tops = "".join(f"<br><small>{name} top: " + ", ".join(
        f"{page.escape(repr(flip.token_text(t)))} {lp:.2f}" for t, lp in s.top) + "</small>"
        for name, s in (("reference", flip.ref_side), ("candidate", flip.cand_side)) if s.top)
    return (f"<b>{page.escape(flip.kind)}</b> at output token {flip.index}: <mark class=ref>{ref}</mark> → "
            f"<mark class=cand>{cand}</mark><br><small>margins (lp ref token − lp cand token): {margins}</small>"
            f"{tops}")


def located_html(row: Changed, why: Localisation | None) -> str:
    if why is None:
        return ""
    for flip in why.flips:
        if (flip.task, flip.doc_id) == (row.task, row.doc_id):
            return flip_html(flip)
    for choice in why.choices:
        if (choice.task, choice.doc_id) == (row.task, row.doc_id):
            return (f"<b>{page.escape(choice.kind)}</b>: choice {choice.ref_choice} → {choice.cand_choice}<br><small>"
                    f"margins {choice.ref_margin:+.3f} / {choice.cand_margin:+.3f}, drift {choice.drift:.3g}</small>")
    return "not located" + ("" if row.reference.get("raw_output") is None else " (see the text report)")


COLUMNS = ["doc", "change", "prompt", "target", "reference", "candidate"]


def task_table(rows: list[Changed], why: Localisation | None) -> str:
    """One task and filter's changed documents (at most MAX_ROWS) as a table."""
    columns = COLUMNS + (["why (--locate)"] if why is not None else [])
    cells = [[page.cell(str(r.doc_id), css="num"), page.cell(r.change),
              page.cell(prompt_html(r.reference), raw=True), page.cell(r.reference.get("target")),
              page.cell(answer_html(r.reference, r.candidate, "ref"), raw=True),
              page.cell(answer_html(r.candidate, r.reference, "cand"), raw=True)]
             + ([page.cell(located_html(r, why), raw=True)] if why is not None else []) for r in rows[:MAX_ROWS]]
    more = (f"<p class=caption>and {len(rows) - MAX_ROWS} more: the text report and the samples files list "
            "them</p>") if len(rows) > MAX_ROWS else ""
    classes = ["v-worse" if r.lost else ("v-better" if "right" in r.change else "") for r in rows[:MAX_ROWS]]
    shown = page.table(columns, cells, row_classes=classes, numeric={"doc"}, optional={"prompt", "target"})
    return f"<div class=scroll>{shown}</div>{more}"


def section(found: dict[tuple[str, str], list[Changed]], why: Localisation | None) -> str:
    """The page's "Documents that changed" section: one table per task and filter."""
    if not found:
        return "<h2 id=changed>Documents that changed</h2>\n<p class=none>no document changed its score or output</p>"
    parts = ["<h2 id=changed>Documents that changed</h2>",
             "<p class=caption>Per task, each document whose score flipped (right → wrong first, in red) or whose "
             "generation changed; the part of an output after the first character that differs is marked. "
             "The prompt is folded: click it.</p>"]
    for (task, filt), rows in found.items():
        lost = sum(r.lost for r in rows)
        parts.append(f'<h3 id="{anchor(task, filt)}">{page.escape(task)} ({page.escape(filt)}): {len(rows)} '
                     f"documents changed, {lost} lost a score</h3>")
        parts.append(task_table(rows, why))
    return "\n".join(parts)
