"""The divergence record of a run: at each scored position, the token in the text and the engine's top entries.

``divergence_<task>_<date>.npz`` beside the samples holds, for one task, one row per scored position: a
position of a log-likelihood continuation, of a rolling (perplexity) window, or of a generation's own output,
whose context is ``ids[:p]`` of the request. Two runs are compared only where their contexts are the same token
for token: each row carries ``context``, the first 8 bytes of the SHA-256 of the context's ids (as
little-endian int32), so equal contexts are found by key, never assumed from the document and position
(evalkit/compare/divergence reads it).

Columns (NumPy arrays of equal length n; k is the run's ``divergence_top_k``):

* ``doc_id`` (int64), ``request`` (int32: lm-eval's index of the request in its document, a choice or a
  window), ``kind`` (int8: :data:`KINDS`), ``position`` (int32: p, the index of the text token in the request);
* ``context`` (uint64);
* ``text_id`` (int32), ``text_logprob`` (float32: the engine's log-probability of the text token there);
* ``top_ids`` (int32, n x k), ``top_logprobs`` (float32, n x k): the engine's k most likely next tokens after
  the context, best first; -1 and NaN pad a row where the engine gave fewer (a server's cap);
* ``given_ids`` (int32, n x g), ``given_logprobs`` (float32, n x g): ids read apart there because a reference
  run's top list named them and this run's own did not (``TokenTrace.given``, docs/divergence.md "Reading the
  reference's ids"), -1 and NaN padded; g is the most any row holds, 0 (n x 0) in a run given no reference.

About 20 + 8k bytes a position: 180 at k = 20 (docs/divergence.md); the given columns add 8g before compression,
about 8 bytes per id read after it (synthetic k = 20 rows: 1.1 ids read a position on average, padded to g = 4,
+8.5 bytes; 4.8 ids, g = 10, +33 bytes). The given columns came later within version 1: a file without them
reads as n x 0, and an evalkit that predates them reads a new file without them (its bound is then each run's
own top-k, as before), so the version stays 1.

A record comes from a run folder, perhaps another machine's: :func:`read` reads one whose arrays, decompressed,
stay within untrusted.file_limit() (4 GiB: about 23 million positions at k = 20), and refuses a larger one
from its arrays' headers before decompressing anything.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Sequence

import numpy as np

from evalkit import untrusted

KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
PAD = -1
VERSION = 1


def context_keys(ids: Sequence[int], start: int) -> list[int]:
    """The key of every context ids[:p] for p in start..len(ids)-1: the first 8 bytes of the SHA-256 of the
    context's ids as little-endian int32, hashed incrementally (one pass over the ids)."""
    digest = hashlib.sha256(np.asarray(ids[:start], dtype="<i4").tobytes())
    keys = []
    for p in range(start, len(ids)):
        keys.append(int.from_bytes(digest.copy().digest()[:8], "little"))
        digest.update(np.asarray([ids[p]], dtype="<i4").tobytes())
    return keys


@dataclass(frozen=True)
class Positions:
    """One task's rows (see the module docstring for each column), checked as they are built."""

    doc_id: np.ndarray
    request: np.ndarray
    kind: np.ndarray
    position: np.ndarray
    context: np.ndarray
    text_id: np.ndarray
    text_logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    given_ids: np.ndarray
    given_logprobs: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.doc_id)
        columns = {name: getattr(self, name) for name in COLUMNS + GIVEN}
        if any(len(v) != n for v in columns.values()):
            raise ValueError(f"divergence record: columns of unequal length "
                             f"({', '.join(f'{k} {len(v)}' for k, v in columns.items())})")
        if self.top_ids.ndim != 2 or self.top_ids.shape != self.top_logprobs.shape:
            raise ValueError(f"divergence record: top_ids {self.top_ids.shape} and top_logprobs "
                             f"{self.top_logprobs.shape} are not one n x k shape")
        if self.given_ids.ndim != 2 or self.given_ids.shape != self.given_logprobs.shape:
            raise ValueError(f"divergence record: given_ids {self.given_ids.shape} and given_logprobs "
                             f"{self.given_logprobs.shape} are not one n x g shape")

    @property
    def k(self) -> int:
        return self.top_ids.shape[1]

    @property
    def g(self) -> int:
        """The most ids read apart at any position (0: none)."""
        return self.given_ids.shape[1]

    def __len__(self) -> int:
        return len(self.doc_id)


COLUMNS = ("doc_id", "request", "kind", "position", "context", "text_id", "text_logprob", "top_ids", "top_logprobs")
GIVEN = ("given_ids", "given_logprobs")  # within version 1, absent from a file written before them
DTYPES = {"doc_id": np.int64, "request": np.int32, "kind": np.int8, "position": np.int32, "context": np.uint64,
          "text_id": np.int32, "text_logprob": np.float32, "top_ids": np.int32, "top_logprobs": np.float32,
          "given_ids": np.int32, "given_logprobs": np.float32}


@dataclass(frozen=True)
class Row:
    """One request's positions as the harness records them, before they become columns."""

    doc_id: int
    request: int
    kind: str
    start: int  # positions start..len(ids)-1 of ids
    ids: tuple[int, ...]
    text_logprobs: tuple[float, ...]  # one per position
    top: tuple[tuple[tuple[int, float], ...], ...]  # one per position: (id, log-probability), best first
    # () or one per position: (id, log-probability) read apart, ids a reference's top list named and top did not
    given: tuple[tuple[tuple[int, float], ...], ...] = ()


def _given(row: Row, n: int) -> tuple[tuple[tuple[int, float], ...], ...]:
    """The row's ids read apart, one list per position, each checked: distinct ids, none of them among that
    position's own top ids, log-probabilities (at most 0, not NaN)."""
    if not row.given:
        return ((),) * n
    where = f"divergence record of document {row.doc_id}, request {row.request}"
    if len(row.given) != n:
        raise ValueError(f"{where}: {n} positions but {len(row.given)} lists of ids read apart")
    for p, (given, top) in enumerate(zip(row.given, row.top), row.start):
        ids = [t for t, _ in given]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise ValueError(f"{where}, position {p}: ids read apart {ids} repeat one or hold a negative id")
        if set(ids) & {t for t, _ in top}:
            raise ValueError(f"{where}, position {p}: ids read apart {sorted(set(ids) & {t for t, _ in top})} "
                             "are among its own top entries")
        if any(not v <= 0 for _, v in given):  # NaN fails this too
            raise ValueError(f"{where}, position {p}: an id read apart has the value "
                             f"{next(v for _, v in given if not v <= 0)}, not a log-probability")
    return row.given


def _padded(entries: Sequence[tuple[int, float]], width: int) -> tuple[list[int], list[float]]:
    return ([t for t, _ in entries] + [PAD] * (width - len(entries)),
            [v for _, v in entries] + [np.nan] * (width - len(entries)))


def build(rows: Sequence[Row], k: int) -> Positions:
    """The columns of rows; each row's counts are checked against its request (one value and one top list per
    position, at most k entries each, and where any were read apart, one checked list of them per position)."""
    cols: dict[str, list] = {name: [] for name in COLUMNS + GIVEN}
    given = []
    for row in rows:
        n = len(row.ids) - row.start
        if len(row.text_logprobs) != n or len(row.top) != n:
            raise ValueError(f"divergence record of document {row.doc_id}, request {row.request}: {n} positions "
                             f"but {len(row.text_logprobs)} log-probabilities and {len(row.top)} top lists")
        given.extend(_given(row, n))
        for p, key, value, top in zip(range(row.start, len(row.ids)), context_keys(row.ids, row.start),
                                      row.text_logprobs, row.top):
            if len(top) > k:
                raise ValueError(f"divergence record of document {row.doc_id}: {len(top)} top entries, more "
                                 f"than divergence_top_k={k}")
            cols["doc_id"].append(row.doc_id)
            cols["request"].append(row.request)
            cols["kind"].append(KINDS.index(row.kind))
            cols["position"].append(p)
            cols["context"].append(key)
            cols["text_id"].append(row.ids[p])
            cols["text_logprob"].append(value)
            ids, values = _padded(top, k)
            cols["top_ids"].append(ids)
            cols["top_logprobs"].append(values)
    g = max(map(len, given), default=0)
    for entries in given:
        ids, values = _padded(entries, g)
        cols["given_ids"].append(ids)
        cols["given_logprobs"].append(values)
    arrays = {name: np.asarray(values, dtype=DTYPES[name]) for name, values in cols.items()}
    for name, width in (("top_ids", k), ("top_logprobs", k), ("given_ids", g), ("given_logprobs", g)):
        arrays[name] = arrays[name].reshape(len(arrays["doc_id"]), width)
    return Positions(**arrays)


def write(path: Path, positions: Positions) -> None:
    """One task's record, compressed (only run/results.py calls this, inside the run's temporary folder)."""
    columns = COLUMNS + GIVEN
    with open(path, "wb") as f:
        np.savez_compressed(f, version=np.asarray(VERSION), **{name: getattr(positions, name) for name in columns})


def decompressed_size(path: Path | BinaryIO) -> int:
    """The bytes path's arrays take decompressed (path: a file name or an open file), from each member's size and
    its array header (NumPy allocates what the header says before reading); ValueError where it is no npz
    archive."""
    total = 0
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    if version not in ((1, 0), (2, 0)):
                        raise ValueError(f"{info.filename}: array format {version}, not one evalkit writes")
                    header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                              else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = header(member)
                total += max(info.file_size, int(np.prod(shape, dtype=object)) * dtype.itemsize)
    except zipfile.BadZipFile as error:
        raise ValueError(f"not an npz archive ({error})") from None
    return total


def read(path: Path, limit: int | None = None) -> Positions:
    """A record written by :func:`write`, or by an evalkit before the given columns (n x 0 then); one line
    naming the file where it is not one, or where its arrays take more than limit bytes (untrusted.file_limit())
    decompressed."""
    limit = untrusted.file_limit() if limit is None else limit
    try:
        with untrusted.open_regular(path) as file:  # a FIFO would wait for a writer: refused
            return _read(path, file, limit)
    except untrusted.TooLarge:
        raise
    except (OSError, KeyError, ValueError) as error:
        raise ValueError(f"{path} is not a readable divergence record: {error}") from None


def _read(path: Path, file: BinaryIO, limit: int) -> Positions:
    """The record in the open file, its size checked on disk and decompressed first."""
    on_disk = os.fstat(file.fileno()).st_size
    if on_disk > limit:
        raise untrusted.too_large(path, on_disk, limit)
    size = decompressed_size(file)
    if size > limit:
        raise untrusted.too_large(path, size, limit, " decompressed")
    file.seek(0)
    with np.load(file, allow_pickle=False) as data:
        if int(data["version"]) != VERSION:
            raise ValueError(f"version {int(data['version'])}, this evalkit reads {VERSION}")
        columns = {name: data[name].astype(DTYPES[name], copy=False) for name in COLUMNS}
        n = len(columns["doc_id"])
        for name in GIVEN:
            columns[name] = (data[name].astype(DTYPES[name], copy=False) if name in data.files
                             else np.zeros((n, 0), dtype=DTYPES[name]))
        return Positions(**columns)
