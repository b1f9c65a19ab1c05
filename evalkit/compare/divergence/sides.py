"""What one run knows at each scored position: the record the divergence measures read, checked as it is built.

An engine gives, at each position whose context both runs share token for token, either every log-probability
of the vocabulary (the HF engine: ``full``) or some entries of it (vLLM's ``prompt_logprobs=k`` / ``logprobs=k``,
a server's top log-probabilities, and the ids it was asked for with ``logprob_token_ids``), always with the
log-probability of the token that is in the text. A ``Side`` holds one run's n positions as arrays, so the
measures run vectorised; its constructors check what they are given (rule 14 of the style guide): one id per
entry, log-probabilities that are log-probabilities, and the text token's value equal wherever it appears twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from evalkit.run.divergence_record import PAD  # the id of an empty slot: the record file's, so its rows need no mapping

LOGPROB_SLACK = 1e-4  # a log-probability above this is not one (float rounding of log_softmax stays far below)
AGREE = 1e-4  # the text token's log-probability read twice (in the row and as the text's) must agree this well


@dataclass(frozen=True)
class Side:
    """One run at n positions: the text token and its log-probability, and the entries the run gave.

    ``ids``/``logprobs`` (n, k) are the known entries, PAD where a row has fewer; ``own_top`` says they include
    this run's own most likely entries (top-k), so its most likely token is among them; without it (only ids
    the run was asked for) the measures decide the top token from the mass alone or call it unknown.
    ``full`` (n, V), when given, is every log-probability and ``ids``/``logprobs`` are empty.
    """

    text_ids: np.ndarray  # (n,) int64
    text_logprobs: np.ndarray  # (n,) float64
    ids: np.ndarray  # (n, k) int64, PAD-padded
    logprobs: np.ndarray  # (n, k) float64, NaN where ids is PAD
    own_top: bool
    full: np.ndarray | None = None  # (n, V) float64

    @property
    def n(self) -> int:
        return len(self.text_ids)


def _text(text_ids: Sequence[int], n: int | None = None) -> np.ndarray:
    ids = np.asarray(text_ids, dtype=np.int64).reshape(-1)
    if n is not None and len(ids) != n:
        raise ValueError(f"{len(ids)} text tokens for {n} positions")
    if (ids < 0).any():
        raise ValueError("a text token id is negative")
    return ids


def _check_logprobs(values: np.ndarray, what: str) -> None:
    finite = values[~np.isnan(values)]
    if len(finite) and float(finite.max()) > LOGPROB_SLACK:
        raise ValueError(f"{what}: {float(finite.max()):.3g} is not a log-probability (above 0)")


def top_entries(text_ids: Sequence[int], text_logprobs: Sequence[float], ids: np.ndarray, logprobs: np.ndarray,
                *, own_top: bool = True) -> Side:
    """A side from padded arrays: ids (n, k) with PAD in empty slots, logprobs (n, k), the text token's
    log-probability (n,). Fails with one line on repeated ids in a row, a PAD with a value, a value above 0,
    or a text token whose log-probability in the row differs from the one given for the text."""
    ids = np.asarray(ids, dtype=np.int64)
    logprobs = np.asarray(logprobs, dtype=np.float64)
    n = ids.shape[0] if ids.ndim == 2 else -1
    if ids.ndim != 2 or logprobs.shape != ids.shape:
        raise ValueError(f"ids {ids.shape} and logprobs {logprobs.shape}: expected two (positions, k) arrays")
    text = _text(text_ids, n)
    text_lp = np.asarray(text_logprobs, dtype=np.float64).reshape(-1)
    if len(text_lp) != n or np.isnan(text_lp).any():
        raise ValueError(f"{len(text_lp)} text log-probabilities for {n} positions, or one is NaN")
    empty = ids == PAD
    if (ids < PAD).any():
        raise ValueError("a token id is negative (only -1 marks an empty slot)")
    if np.isnan(logprobs[~empty]).any():
        raise ValueError("a known entry has no log-probability (NaN)")
    logprobs = np.where(empty, np.nan, logprobs)
    ordered = np.sort(ids, axis=1)
    if ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != PAD)).any():
        raise ValueError("a row names the same token id twice")
    _check_logprobs(logprobs, "an entry")
    _check_logprobs(text_lp, "a text token")
    same = ids == text[:, None]
    gap = np.abs(np.where(same, logprobs, 0.0) - np.where(same, text_lp[:, None], 0.0))
    if (gap > AGREE).any():
        row = int(np.argwhere(gap > AGREE)[0, 0])
        raise ValueError(f"position {row}: the text token {text[row]} reads {logprobs[row][same[row]][0]:.6g} in "
                         f"the row and {text_lp[row]:.6g} as the text's")
    return Side(text_ids=text, text_logprobs=text_lp, ids=ids, logprobs=logprobs, own_top=own_top)


def from_rows(text_ids: Sequence[int], rows: Sequence[Mapping[int, float]], *, own_top: bool = True) -> Side:
    """A side from one {token_id: logprob} mapping per position (vLLM's prompt_logprobs and logprobs rows, a
    server's top_logprobs read into ids), each of which must hold the text token, as engines return it."""
    text = _text(text_ids, len(rows))
    k = max((len(row) for row in rows), default=0)
    ids = np.full((len(rows), k), PAD, dtype=np.int64)
    logprobs = np.full((len(rows), k), np.nan)
    text_lp = np.empty(len(rows))
    for i, row in enumerate(rows):
        if int(text[i]) not in row:
            raise ValueError(f"position {i}: the text token {int(text[i])} has no log-probability in the row")
        text_lp[i] = float(row[int(text[i])])
        ids[i, :len(row)] = list(row.keys())
        logprobs[i, :len(row)] = list(row.values())
    return top_entries(text, text_lp, ids, logprobs, own_top=own_top)


def full_distribution(text_ids: Sequence[int], logprobs: np.ndarray) -> Side:
    """A side that knows every log-probability: logprobs (n, V), as the HF engine computes them."""
    full = np.asarray(logprobs, dtype=np.float64)
    if full.ndim != 2:
        raise ValueError(f"logprobs {full.shape}: expected a (positions, vocabulary) array")
    text = _text(text_ids, full.shape[0])
    if (text >= full.shape[1]).any():
        raise ValueError(f"a text token id is outside the vocabulary of {full.shape[1]}")
    if np.isnan(full).any():
        raise ValueError("a log-probability is NaN")
    _check_logprobs(full, "an entry")
    empty = np.empty((len(text), 0))
    return Side(text_ids=text, text_logprobs=full[np.arange(len(text)), text], ids=empty.astype(np.int64),
                logprobs=empty, own_top=True, full=full)
