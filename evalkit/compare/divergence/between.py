"""The divergence of a candidate run from a reference run, from both runs' records: the positions paired
(records.py), measured (sides.py, positions.py) and summarised per task and over all tasks (stats.py), with
the verdict against a noise run (verdict.py) where one is given.

A run's known entries at a position are its top-k and, where it read them at this reference's top ids and the
comparison is fair (records.given_policy), the ids it read apart there, capped at its last top entry
(records.settle_given). A position where either run's own entries hold more than all the probability is no
distribution: it is left out of every figure, counted, and said above the table (records.overfull_note).

Every shared context is one position for KLD and top-1 agreement; Δp and the PPL ratio come from the shared
(context, text token) triples (records.py says why). Both are summarised by the same ``summarize`` and put
together in one ``Summary``: its KLD, percentiles and top-1 figures from the contexts, its Δp and PPL figures
from the triples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Hashable

import numpy as np

from evalkit.compare.divergence import records, stats
from evalkit.compare.divergence.positions import Positions, measure
from evalkit.compare.divergence.sides import PAD, top_entries
from evalkit.compare.divergence.verdict import NoiseVerdict, noise_verdict
from evalkit.compare.runs import CompareError
from evalkit.run.divergence_record import Positions as Rows

CONFIDENCE = 0.95  # the figures' intervals: descriptive, as llama.cpp's, not a test


@dataclass(frozen=True)
class Task:
    """One task's compared positions: one per shared context, and one per shared (context, text token)."""

    contexts: Positions
    docs: np.ndarray  # document of each context position
    kinds: np.ndarray  # index into run.divergence_record.KINDS
    request: np.ndarray  # the reference's request and position of each context position
    position: np.ndarray
    ref_text: np.ndarray  # each run's text token there (they differ where two generations part)
    cand_text: np.ndarray
    texts: Positions
    text_docs: np.ndarray
    unshared: int  # shared contexts where no token is known on both sides: KLD bound 0, top-1 differs
    left_out: int = 0  # shared contexts left out of every figure: a run's entries there are no distribution
    overfull: tuple[float, float] = (0.0, 0.0)  # the most probability either run's entries held at one of them


def _entries(rows: Rows, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The known entries of rows: the top-k, the ids read apart and, where it is not among them, the text token
    (n, k + g + 1)."""
    ids = np.concatenate([rows.top_ids[index], rows.given_ids[index]], axis=1).astype(np.int64)
    values = np.concatenate([rows.top_logprobs[index], rows.given_logprobs[index]], axis=1).astype(np.float64)
    text, text_lp = rows.text_id[index].astype(np.int64), rows.text_logprob[index].astype(np.float64)
    listed = (ids == text[:, None]).any(axis=1)
    return (np.concatenate([ids, np.where(listed, PAD, text)[:, None]], axis=1),
            np.concatenate([values, np.where(listed, np.nan, text_lp)[:, None]], axis=1))


def _shared_token(ref_ids, ref_lp, cand_ids, cand_lp):
    """Per row, the reference's best entry the candidate knows too, with both values, and whether one exists:
    a parting position's two text tokens differ, and the measures need one token known on both sides."""
    match = (ref_ids[:, :, None] == cand_ids[:, None, :]) & (ref_ids != PAD)[:, :, None]
    rows, found = np.arange(len(ref_ids)), match.any(axis=(1, 2))
    i = np.argmax(match.any(axis=2), axis=1)
    j = np.argmax(match[rows, i], axis=1)
    return ref_ids[rows, i], ref_lp[rows, i], cand_lp[rows, j], found


def measure_rows(ref: Rows, ref_rows: np.ndarray, cand: Rows, cand_rows: np.ndarray) -> tuple[Positions, int]:
    """The measures at paired rows (Side: the top-k and any ids read apart, own_top), and how many positions no
    token is known on both sides of. Where the two text tokens differ the position is measured on a token both
    know, and its Δp and log-likelihood ratio are NaN; where none is, its KLD bound is 0 and its top tokens
    differ."""
    ref_ids, ref_lp = _entries(ref, ref_rows)
    cand_ids, cand_lp = _entries(cand, cand_rows)
    text = ref.text_id[ref_rows].astype(np.int64)
    text_ref, text_cand = ref.text_logprob[ref_rows].astype(float), cand.text_logprob[cand_rows].astype(float)
    differ = text != cand.text_id[cand_rows]
    keep = ~differ
    if differ.any():
        token, lp_ref, lp_cand, found = _shared_token(ref_ids[differ], ref_lp[differ], cand_ids[differ],
                                                      cand_lp[differ])
        text[differ], text_ref[differ], text_cand[differ] = token, lp_ref, lp_cand
        keep[np.flatnonzero(differ)[found]] = True
    own = min(ref.k, cand.k) > 0  # each side's entries hold its own best: its top token is known
    measured = measure(top_entries(text[keep], text_ref[keep], ref_ids[keep], ref_lp[keep], own_top=own),
                       top_entries(text[keep], text_cand[keep], cand_ids[keep], cand_lp[keep], own_top=own))
    n = len(ref_rows)
    out = {"kld": np.zeros(n), "exact": np.zeros(n, dtype=bool), "captured": np.zeros(n),
           "same_top": np.full(n, 0.0 if own else np.nan), "delta_p": np.full(n, np.nan), "llr": np.full(n, np.nan)}
    for name, values in out.items():
        values[keep] = getattr(measured, name)
    out["delta_p"][differ], out["llr"][differ] = np.nan, np.nan
    return Positions(**out), int((~keep).sum())


def compare_task(ref: Rows, cand: Rows) -> Task:
    """One task's two records, paired (records.pair) and measured: each shared (context, token) pair once, and
    the contexts where the two tokens differ (a parting position) apart; every shared context takes its
    measures from the one it is compared on. Rows that are no distribution are left out first
    (records.as_distributions), and the shared contexts that loses counted."""
    whole = records.shared_contexts(ref, cand)
    (ref, ref_most), (cand, cand_most) = records.as_distributions(ref), records.as_distributions(cand)
    pairs = records.pair(ref, cand)
    texts, _ = measure_rows(ref, pairs.text_ref, cand, pairs.text_cand)
    parting = pairs.text_of < 0
    parted, unshared = measure_rows(ref, pairs.ref[parting], cand, pairs.cand[parting])
    columns = {}
    for name in ("kld", "exact", "captured", "same_top", "delta_p", "llr"):
        column = np.empty(len(parting), dtype=getattr(texts, name).dtype)
        column[~parting], column[parting] = getattr(texts, name)[pairs.text_of[~parting]], getattr(parted, name)
        columns[name] = column
    contexts = Positions(**columns)
    return Task(contexts=contexts, docs=ref.doc_id[pairs.ref], kinds=ref.kind[pairs.ref],
                request=ref.request[pairs.ref], position=ref.position[pairs.ref], ref_text=ref.text_id[pairs.ref],
                cand_text=cand.text_id[pairs.cand], texts=texts, text_docs=ref.doc_id[pairs.text_ref],
                unshared=unshared, left_out=whole - len(pairs.ref), overfull=(ref_most, cand_most))


def compare_records(ref: records.Recorded, cand: records.Recorded, k: int) -> dict[str, Task]:
    """Every task both runs recorded, both records cut to k entries; a record that fails its checks is a
    CompareError naming the task and the runs."""
    out = {}
    for task in sorted(set(ref.tasks) & set(cand.tasks)):
        try:
            out[task] = compare_task(records.cut(ref.tasks[task], k), records.cut(cand.tasks[task], k))
        except ValueError as error:
            raise CompareError(f"divergence of {task}, {cand.run} against {ref.run}: {error}") from None
    return out


def per_document(tasks: dict[str, Task]) -> dict[Hashable, float]:
    """Mean KLD per (task, document): the input of the verdict against noise."""
    return {(task, doc): value for task, t in tasks.items()
            for doc, value in stats.document_divergence(t.contexts.kld, t.docs).items()}


@dataclass(frozen=True)
class Divergence:
    """The candidate's divergence from the reference, or in one line why there is none (missing)."""

    reference: str
    candidate: str
    missing: str = ""
    k: int = 0  # the top-k both records were compared at
    given: bool = False  # the candidate's ids read at the reference's top ids took part in the bound
    notes: tuple[str, ...] = ()  # what the reader must know about how they were compared (one line each)
    tasks: dict[str, Task] = field(default_factory=dict)
    per_task: dict[str, stats.Summary] = field(default_factory=dict)
    overall: stats.Summary | None = None
    verdict: NoiseVerdict | None = None  # None: no noise run, no verdict claimed
    documents: dict[Hashable, float] = field(default_factory=dict)  # (task, doc) -> the candidate's mean KLD
    noise: dict[Hashable, float] = field(default_factory=dict)  # (task, doc) -> the noise run's, at the same k

    @property
    def bound(self) -> str:
        """Which entries the bound saw, in a few words."""
        return f"the reference's top-{self.k}, read on the candidate" if self.given else f"top-{self.k} of both"


def _joined(contexts: stats.Summary, texts: stats.Summary) -> stats.Summary:
    """KLD, its percentiles and top-1 from the shared contexts; Δp and the PPL ratio from the shared tokens."""
    return replace(contexts, mean_dp=texts.mean_dp, rms_dp=texts.rms_dp, dp_percentiles=texts.dp_percentiles,
                   ln_ppl_ratio=texts.ln_ppl_ratio, ppl_ratio=texts.ppl_ratio)


def summaries(tasks: dict[str, Task]) -> tuple[dict[str, stats.Summary], stats.Summary]:
    per_context, all_contexts = stats.summarize_tasks({n: (t.contexts, t.docs) for n, t in tasks.items()},
                                                      confidence=CONFIDENCE)
    per_text, all_texts = stats.summarize_tasks({n: (t.texts, t.text_docs) for n, t in tasks.items()},
                                                confidence=CONFIDENCE)
    return {n: _joined(per_context[n], per_text[n]) for n in tasks}, _joined(all_contexts, all_texts)


def _lacking(runs: list[records.Recorded], how: str) -> str:
    names = [r.run for r in runs if r.missing]
    if not names:
        return ""
    who = f"run {names[0]} recorded" if len(names) == 1 else f"neither run ({', '.join(names)}) recorded"
    return f"{who} no divergence; {how}"


def _left_out(ref: str, cand: str, tasks: dict[str, Task]) -> str:
    """The line that says which positions no figure includes, and whose entries made them so; "" where none."""
    worst = {run: max(t.overfull[side] for t in tasks.values()) for side, run in enumerate((ref, cand))}
    return records.overfull_note(sum(t.left_out for t in tasks.values()),
                                 {run: most for run, most in worst.items() if most > 1 + records.MASS_SLACK})


def divergence(ref: records.Recorded, cand: records.Recorded,
               noise: tuple[records.Recorded, ...] = ()) -> Divergence:
    """The figures of the candidate against the reference over every task both recorded; with the noise runs
    the verdict will use, the ids read apart take part only where theirs do too (records.given_policy)."""
    lacking = _lacking([ref, cand], records.HOW)
    if lacking:
        return Divergence(ref.run, cand.run, missing=lacking)
    kept, given_note = records.given_policy(ref, cand, noise)
    ref, cand = records.keep_given(ref, kept), records.keep_given(cand, kept)
    k, note = records.comparable(ref, cand)
    tasks = compare_records(ref, cand, k)
    if not tasks:
        told = f"{', '.join(sorted(ref.tasks))} vs {', '.join(sorted(cand.tasks))}"
        return Divergence(ref.run, cand.run, missing=f"the runs recorded the divergence of no task in common ({told})")
    if not any(t.contexts.n for t in tasks.values()):
        left_out = _left_out(ref.run, cand.run, tasks)
        return Divergence(ref.run, cand.run, missing=left_out or "no position of the candidate shares its context "
                          "with the reference's, token for token (another tokenizer or prompt)")
    per_task, overall = summaries(tasks)
    notes = tuple(filter(None, [_left_out(ref.run, cand.run, tasks), note, given_note,
                                records.between_calls_note(cand, ref)]))
    return Divergence(ref.run, cand.run, k=k, given=cand.run in kept, notes=notes,
                      tasks=tasks, per_task=per_task, overall=overall, documents=per_document(tasks))


def _unusable(reason: str, alpha: float) -> NoiseVerdict:
    return NoiseVerdict("unusable", math.nan, alpha, 0, 0, math.nan, math.nan, reason)


def against_noise(found: Divergence, ref: records.Recorded, cand: records.Recorded,
                  noise: tuple[records.Recorded, records.Recorded], *, alpha: float) -> Divergence:
    """found with the verdict against the noise pair's own divergence (the second noise run against the
    first), all of it at the smallest top-k any of the runs recorded; unusable, in one line, where the noise
    runs recorded none, or the candidate none while the reference or a noise run did (the check asked for would
    be skipped in silence). Where the noise runs did not read the reference's ids as the candidate did, found is
    measured again without the candidate's (records.given_policy), the table too."""
    if found.missing:
        recorded = [run.run for run in (ref, *noise) if not run.missing]
        # the verdict asked for cannot be given: unusable, where the other runs show a record was meant
        return replace(found, verdict=_unusable(found.missing, alpha)) if recorded else found
    lacking = _lacking(list(noise), "make the noise run with the same divergence_top_k as the reference")
    if lacking:
        return replace(found, verdict=_unusable(lacking, alpha))
    kept, _ = records.given_policy(ref, cand, noise)
    if (cand.run in kept) != found.given:  # the noise runs did not read theirs alike: none take part
        found = divergence(ref, cand, noise)
    ref, cand, *noise = (records.keep_given(run, kept) for run in (ref, cand, *noise))
    k, note = records.comparable(*{r.run: r for r in (ref, cand, *noise)}.values())
    documents = found.documents if k == found.k else per_document(compare_records(ref, cand, k))
    noise_documents = per_document(compare_records(noise[0], noise[1], k))
    found = replace(found, documents=documents, noise=noise_documents,
                    notes=found.notes + ((f"the verdict: {note}",) if note and k != found.k else ()))
    return replace(found, verdict=noise_verdict(documents, noise_documents, alpha=alpha))
