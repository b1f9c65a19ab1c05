"""Two runs' divergence records (evalkit/run/divergence_record.py), read from their folders and paired position by
position, so that the measures (sides.py, positions.py) compare like with like.

A position is compared only where both runs saw the same context token for token: rows are matched by
(document, context key), never by their index in a request. Within one document several rows can share a
context (the choices of one question share their first continuation position); such a context is one
position for KLD and top-1 agreement, counted once. Δp and the log-likelihood ratio need the same text token
on both sides, so they use the (document, context, text token) triples both runs recorded, each once. A
generation's positions after the two outputs part have other contexts and drop out by themselves; the
parting position itself shares its context and counts for KLD and top-1, not for Δp.

A run made with a reference (``divergence_reference``) also holds, per position, the ids the reference's top
list named and its own did not, read apart (the given columns). They take part in the bound only where they
are fair to the verdict (:func:`given_policy`): the candidate's read at this very reference's ids (its
``evalkit.run_id``), and the noise runs' read alike; otherwise every run's are left out, and one line says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from evalkit.compare.runs import CompareError, Run
from evalkit.run import divergence_record
from evalkit.run.divergence_record import PAD, Positions
from evalkit.untrusted import OutsideFolder, TooLarge, inside

HOW = "run it with divergence_top_k=20 to record one"


@dataclass(frozen=True)
class Recorded:
    """One run's divergence records, task -> its rows; missing says in one line why there are none ("" when
    there are)."""

    run: str
    tasks: dict[str, Positions]
    missing: str = ""
    run_id: str = ""  # its evalkit.run_id
    read_at: str = ""  # the evalkit.run_id of the reference whose top ids it read apart; "" where it read none
    reference: str = ""  # that reference as evalkit.divergence.reference names it ("<parent>/<name>"), else ""
    not_read: str = ""  # the one line why its engine read no ids, where it was given a reference and could not
    # positions whose values from two engine calls disagreed (evalkit.divergence.between_calls.positions); None
    # where the run does not say (recorded by an evalkit that did not count them)
    between_calls: int | None = None

    @property
    def k(self) -> int:
        """The top-k the run recorded (the smallest of its tasks', should they differ)."""
        return min((p.k for p in self.tasks.values()), default=0)

    @property
    def given(self) -> int:
        """The most ids read apart at any position of any task (0: none)."""
        return max((p.g for p in self.tasks.values()), default=0)


def _reference(section: dict[str, Any]) -> dict[str, str]:
    """What evalkit.divergence.reference says of the ids the run read (Recorded's fields), {} where none."""
    divergence = section.get("divergence")
    said = divergence.get("reference") if isinstance(divergence, dict) else None
    if not isinstance(said, dict):
        return {}
    text = {key: str(said.get(key) or "") for key in ("run", "run_id", "not_read")}
    return {"read_at": "" if text["not_read"] else text["run_id"], "reference": text["run"] or text["run_id"],
            "not_read": text["not_read"]}


def read_run(run: Run) -> Recorded:
    """The records results.json names in ``evalkit.files.divergence``; a run that names none is missing them
    (one line saying so), a named file that cannot be read, leads out of the folder or is larger than
    untrusted.file_limit() is a CompareError (a damaged run: exit 2)."""
    section = run.results.get("evalkit") or {}
    names = (section.get("files") or {}).get("divergence")
    if not names:
        return Recorded(run.name, {}, f"run {run.name} recorded no divergence; {HOW}")
    if not isinstance(names, dict):
        raise CompareError(f"{run.path / 'results.json'}: evalkit.files.divergence is not a task -> file object")
    tasks = {}
    for task, name in names.items():
        try:
            tasks[task] = divergence_record.read(inside(run.path, name))
        except OutsideFolder as error:
            raise CompareError(f"{run.path / 'results.json'}: divergence file {error}; a run folder names only its "
                               "own files") from None
        except TooLarge as error:
            raise CompareError(str(error)) from None
        except ValueError as error:
            raise CompareError(f"{error}; a damaged run: copy it again or rerun") from None
    return Recorded(run.name, tasks, run_id=str(section.get("run_id") or ""), between_calls=_between_calls(section),
                    **_reference(section))


def _between_calls(section: dict[str, Any]) -> int | None:
    """evalkit.divergence.between_calls.positions where it is a count, else None."""
    divergence = section.get("divergence")
    said = divergence.get("between_calls") if isinstance(divergence, dict) else None
    count = said.get("positions") if isinstance(said, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


def between_calls_note(*runs: Recorded) -> str:
    """The line that says at how many positions each run's engine calls disagreed; "" where no run says."""
    said = [f"{run.run} {run.between_calls}" for run in runs if run.between_calls is not None]
    if not said:
        return ""
    return ("positions where two engine calls of a run disagreed (a value read apart above the top list that left "
            f"it out: the engine's rounding from call to call, counted, not an error): {', '.join(said)}")


def cut(rows: Positions, k: int) -> Positions:
    """The rows with only their k best top entries (a record is best first, so these are its top-k)."""
    return rows if rows.k <= k else replace(rows, top_ids=rows.top_ids[:, :k], top_logprobs=rows.top_logprobs[:, :k])


def comparable(*runs: Recorded) -> tuple[int, str]:
    """The k two or more runs are compared at (the smallest they recorded) and one line when they differ: a
    bound is computed the same way on both sides only from the same number of entries."""
    ks = [run.k for run in runs]
    if len(set(ks)) == 1:
        return ks[0], ""
    told = " and ".join(f"top-{k} ({run.run})" for k, run in zip(ks, runs))
    return min(ks), f"the runs recorded {told}: compared at top-{min(ks)}, the larger records cut to their best"


def same_run(run: Recorded, ref: Recorded) -> bool:
    """run is the reference itself (its folder, or a copy of it: the same run id)."""
    return run.run == ref.run or bool(ref.run_id) and run.run_id == ref.run_id


def _unread(run: Recorded, ref: Recorded) -> str:
    """Why run did not read ref's top ids apart, in a few words; "" where it did."""
    if ref.run_id and run.read_at == ref.run_id:
        return ""
    if run.not_read:
        return f"run {run.run}'s engine read none ({run.not_read})"
    if run.read_at:
        return f"run {run.run} read those of {run.reference or run.read_at}, not {ref.run}'s"
    return f"run {run.run} read none"


def _noise_kept(ref: Recorded, noise: Sequence[Recorded]) -> tuple[frozenset[str], str]:
    """The noise runs whose ids read apart take part, and why none do ("" where some do). The noise divergence
    is the second run's from the first: fair beside the candidate's where the second read the first's top ids
    (the one-run form, where the first is the reference, and the pair evalkit.compare.noise makes), or where
    both read the reference's (each then knows its top-k, so the noise bound is at least as tight)."""
    first, second = noise
    if not _unread(second, first):
        return frozenset({second.run}), ""
    if not same_run(first, ref) and not _unread(first, ref) and not _unread(second, ref):
        return frozenset({first.run, second.run}), ""
    return frozenset(), _unread(second, first) + ("" if same_run(first, ref) else f", nor did both read {ref.run}'s")


def given_policy(ref: Recorded, cand: Recorded, noise: Sequence[Recorded] = ()) -> tuple[frozenset[str], str]:
    """The runs whose ids read apart take part in the bound, and one line where some are left out. The
    candidate's do where it read them at this reference's top ids (its run id), and with a noise pair only
    where the noise runs read theirs alike (_noise_kept): the verdict sets the candidate's divergence beside
    the noise run's, and a bound tighter on the candidate's side only would lean it toward "beyond noise".
    Otherwise no run's do. The reference's own (read at another run) never do."""
    why = [] if same_run(cand, ref) else [reason for reason in [_unread(cand, ref)] if reason]
    kept = set() if why or same_run(cand, ref) else {cand.run}
    if noise:
        noise_kept, reason = _noise_kept(ref, noise)
        why, kept = (why + [reason], kept) if reason else (why, kept | noise_kept)
    if not why:
        return frozenset(kept - {ref.run}), ""
    if not any(run.given for run in (cand, *noise) if not same_run(run, ref)):
        return frozenset(), ""
    return frozenset(), (f"the ids read apart at a reference's top ids are left out on every side, so that the "
                         f"bound is the same on each: {'; '.join(why)}")


def keep_given(run: Recorded, kept: frozenset[str]) -> Recorded:
    """run with its ids read apart where they take part (its name among kept), else without them."""
    if run.given == 0 or run.run in kept:
        return run
    return replace(run, tasks={task: replace(rows, given_ids=rows.given_ids[:, :0],
                                             given_logprobs=rows.given_logprobs[:, :0])
                               for task, rows in run.tasks.items()})


MASS_SLACK = 1e-5  # a float32 log_softmax's k probabilities sum to 1 within about 1e-6; more is no distribution


def own_mass(rows: Positions) -> np.ndarray:
    """Per row, the probability its own entries hold: the top-k and the text token where the top-k leaves it out
    (the ids read apart are not its own: :func:`settle_given`)."""
    if not len(rows):
        return np.zeros(0)
    top = np.nansum(np.exp(rows.top_logprobs.astype(np.float64)), axis=1)
    listed = (rows.top_ids == rows.text_id[:, None]).any(axis=1)
    return top + np.where(listed, 0.0, np.exp(rows.text_logprob.astype(np.float64)))


def settle_given(rows: Positions, mass: np.ndarray) -> Positions:
    """The ids read apart as the bound takes them (mass: own_mass(rows)). A value read in another engine call than the top list may
    round above the last top entry (bfloat16: contracts.apart_tolerance); an id the top list left out lies at or
    below that entry in the row's own distribution, so it enters capped there. Where the capped values still
    take the row's entries above all the probability (their rounding), the row keeps its own entries only: a
    bound from one distribution, sound, if less tight."""
    if not rows.g or not len(rows):
        return rows
    last = np.nanmin(np.where(rows.top_ids == PAD, np.nan, rows.top_logprobs.astype(np.float64)), axis=1,
                     initial=0.0)
    capped = np.minimum(rows.given_logprobs.astype(np.float64), last[:, None])
    over = mass + np.nansum(np.exp(capped), axis=1) > 1 + MASS_SLACK
    ids = np.where(over[:, None], PAD, rows.given_ids)
    return replace(rows, given_ids=ids, given_logprobs=np.where(ids == PAD, np.nan, capped).astype(np.float32))


def as_distributions(rows: Positions) -> tuple[Positions, float]:
    """The rows the bound can use, and the most probability any row's own entries hold: the ids read apart
    settled (settle_given), and the rows whose own entries are no normalised distribution (more than all the
    probability, beyond float32 rounding) left out."""
    mass = own_mass(rows)
    return take(settle_given(rows, mass), mass <= 1 + MASS_SLACK), float(mass.max(initial=0.0))


def take(rows: Positions, keep: np.ndarray) -> Positions:
    """The rows where keep is true."""
    columns = divergence_record.COLUMNS + divergence_record.GIVEN
    return replace(rows, **{name: getattr(rows, name)[keep] for name in columns})


def overfull_note(left_out: int, runs: dict[str, float]) -> str:
    """The line above the table where positions were left out of every figure, "" where none were."""
    if not left_out:
        return ""
    who = "; ".join(f"run {run}'s up to {worst:.4g}" for run, worst in runs.items())
    return (f"{left_out} positions left out of every figure: their top-k probabilities sum above 1 there ({who}), "
            "so they are not the log-probabilities of one distribution and no bound holds at them")


_CONTEXT = np.dtype([("doc", "<i8"), ("context", "<u8")])
_TEXT = np.dtype([("doc", "<i8"), ("context", "<u8"), ("text", "<i4")])


def _keys(rows: Positions, dtype: np.dtype) -> np.ndarray:
    keys = np.empty(len(rows), dtype=dtype)
    keys["doc"], keys["context"] = rows.doc_id, rows.context
    if "text" in dtype.names:
        keys["text"] = rows.text_id
    return keys


def _common(ref: Positions, cand: Positions, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The keys both runs recorded, each once, and the first row of each in either run."""
    ref_keys, ref_first = np.unique(_keys(ref, dtype), return_index=True)  # the first occurrence of each key
    cand_keys, cand_first = np.unique(_keys(cand, dtype), return_index=True)
    keys, in_ref, in_cand = np.intersect1d(ref_keys, cand_keys, assume_unique=True, return_indices=True)
    return keys, ref_first[in_ref], cand_first[in_cand]


@dataclass(frozen=True)
class Pairs:
    """Rows of the two runs to compare, as indices into each run's record of one task."""

    ref: np.ndarray  # (n,) rows of the reference, one per shared context (KLD, top-1)
    cand: np.ndarray
    text_ref: np.ndarray  # (m,) one per shared context and text token (Δp, log-likelihood ratio)
    text_cand: np.ndarray
    text_of: np.ndarray  # (n,) the text pair each shared context is compared on, -1 where the tokens differ


def shared_contexts(ref: Positions, cand: Positions) -> int:
    """How many (document, context) keys both runs recorded."""
    return len(_common(ref, cand, _CONTEXT)[0])


def pair(ref: Positions, cand: Positions) -> Pairs:
    """The shared contexts and the shared (context, text token) triples of two runs' records of one task. A
    context where both runs also share a text token is compared on that token's rows (the same request on
    both sides); the others (a generation's parting position) on each run's first row there."""
    texts, text_ref, text_cand = _common(ref, cand, _TEXT)
    contexts, first_ref, first_cand = _common(ref, cand, _CONTEXT)
    rows_ref, rows_cand, text_of = first_ref, first_cand, np.full(len(contexts), -1, dtype=np.int64)
    if len(texts):  # the first shared text triple of each shared context: both key lists are sorted
        text_contexts = np.empty(len(texts), dtype=_CONTEXT)
        text_contexts["doc"], text_contexts["context"] = texts["doc"], texts["context"]
        at = np.minimum(np.searchsorted(text_contexts, contexts), len(texts) - 1)
        covered = text_contexts[at] == contexts
        rows_ref, rows_cand = np.where(covered, text_ref[at], first_ref), np.where(covered, text_cand[at], first_cand)
        text_of = np.where(covered, at, -1)
    return Pairs(ref=rows_ref.astype(np.int64), cand=rows_cand.astype(np.int64), text_ref=text_ref.astype(np.int64),
                 text_cand=text_cand.astype(np.int64), text_of=text_of.astype(np.int64))
