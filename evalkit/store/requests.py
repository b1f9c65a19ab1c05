"""Crash-safe resume (the request store): every finished engine request is kept, so a rerun only computes what is missing.

Answers are appended to ``<output_dir>/<model_name>/.requests/<fingerprint>.jsonl`` as each chunk of
requests finishes (flushed and fsync'ed); a kill at any instant loses at most the chunk in flight, and a
torn last line is cut off on reading, so the next append starts on a line of its own. Identical requests
share one answer when greedy and keep one each when sampled (:meth:`ResumableEngine._key`). The file name
is a hash of everything that decides an answer (:func:`fingerprint`): the model's files, the settings that
change outputs, the model runner and kernel-selecting environment, the library versions, the hardware and
evalkit's own answer code; each line is keyed by a hash of the exact request and the scoring path
(``fast_scoring``; with ``divergence_top_k`` > 0 its k too, the answer then keeping its trace), of a trace and
its k, or of an ids read (its context and ids: ``Engine.read_ids``), and records the settings of the try that
computed it. Settings that only change scheduling or memory
(``gpu_memory_utilization``, ``kv_cache_memory_bytes``, ``batch_size``/``max_num_seqs``,
``max_num_batched_tokens``, ``enforce_eager``, ``swap_space``) are left out of the key, so the OOM back-off can resume a run under smaller settings.

A store is held while it is open: the kernel's ``flock`` on the store file itself, taken before it is read and
freed by :meth:`RequestStore.close` or when its process ends, however it ends. Two runs whose configs name the
store differently (``tokenizer=null`` and ``tokenizer=<the model folder>``, a hub id and its snapshot folder)
take different run locks (evalkit/store/lock.py) but cannot both hold the store: the second is refused in one
line (:class:`StoreHeld`), so no run cuts or mixes the lines another appends.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from evalkit.config import ConfigError, EvalConfig
from evalkit.contracts import (Engine, Generation, GenRequest, IdsRead, PartialAnswers, Progress, Scored,
                               ScoreRequest, TokenTrace)
from evalkit.hashing import sha256
from evalkit.engine.machine import forks
from evalkit.engine.wrapper import Wrapped
from evalkit.untrusted import open_own


class StoreHeld(ConfigError):
    """Another live run holds this request store."""


BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # flock's "held by another"


def hold(path: Path, wait: float = 0.0, poll: float = 1.0) -> int:
    """An open descriptor of path with the kernel's exclusive flock on it, waiting up to wait seconds for a
    holder; StoreHeld when it is still held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait
    fd = open_own(path, os.O_CREAT | os.O_RDWR)  # a link, FIFO or another user's file planted there: refused
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            forks.close_in_child(fd)  # a forked engine process must not keep the store held (forks.py)
            return fd
        except OSError as error:
            if error.errno in BUSY and time.monotonic() + poll <= deadline:
                time.sleep(poll)
                continue
            os.close(fd)
            if error.errno in BUSY:
                raise StoreHeld(f"another evalkit run is writing the request store {path} (the same answers under "
                                "another name of the model or tokenizer); wait for it to finish, or pass "
                                "resume=false") from None
            raise ConfigError(f"cannot lock the request store {path} ({error.strerror}); pass output_dir= a "
                              "folder on a file system with file locks") from None


class RequestStore:
    """Append-only answers keyed by request hash, in one JSONL file, held (flock) from open to close()."""

    def __init__(self, path: Path, wait: float = 0.0) -> None:
        self.path = Path(path)
        self.answers: dict[str, dict[str, Any]] = {}
        self.origins: dict[str, Any] = {}  # key -> the memory settings of the try that computed the answer
        self.fd: int | None = None
        self.fd = hold(self.path, wait)  # before reading: no other run appends while we cut
        with os.fdopen(os.dup(self.fd), "rb+") as f:  # the file held, not whatever the path names now
            whole = 0  # bytes up to the end of the last complete line
            for line in f:
                if not line.endswith(b"\n"):
                    break  # torn by a kill mid-write: cut it, or the next append would be glued to it
                whole += len(line)
                try:
                    entry = json.loads(line)
                    self.answers[entry["key"]] = entry["answer"]
                    self.origins[entry["key"]] = entry.get("by")
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
            f.truncate(whole)

    def close(self) -> None:
        """Free the store for another run (the kernel frees it too when this process ends)."""
        if self.fd is not None:
            forks.forget(fds=(self.fd,))
            fcntl.flock(self.fd, fcntl.LOCK_UN)  # also for a process forked while it was held
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()

    def add(self, items: list[tuple[str, dict[str, Any]]], by: Any = None) -> None:
        """Append answers, each with the settings of the try that computed them (by)."""
        if self.fd is None:
            raise RuntimeError(f"the request store {self.path} was closed")
        data = "".join(json.dumps({"key": k, "answer": a, "by": by}) + "\n" for k, a in items).encode()
        end = os.lseek(self.fd, 0, os.SEEK_END)  # the file held (only its holder appends)
        while data:
            written = os.pwrite(self.fd, data, end)
            data, end = data[written:], end + written
        os.fsync(self.fd)
        self.answers.update(items)
        self.origins.update((k, by) for k, _ in items)


# generations per generate call, at least, in units of the sequences the engine runs at once: a call ends with its
# slowest answer, while the engine runs fewer and fewer sequences; at 4, it runs full for three quarters of a call
# at least (benchmarks/chunking.py measures it)
FILL = 4
DEFAULT_CHUNK = EvalConfig.chunk_size  # a chunk_size left at its default: generations sized to the engine


def generation_chunk(chunk_size: int, description: dict[str, Any]) -> int:
    """Requests per generate call: a chunk_size the user chose, as chosen (it is how much a stop may lose); at
    the default, FILL x the sequences the engine runs at once where that is more (vLLM's max_num_seqs as it
    resolved it, times the data-parallel engines: 1,024 x 4 on an H100, where 256 left three quarters of the engine
    idle). Scores are not chunked by it: a score request is one forward pass."""
    seqs = (description.get("scheduling") or {}).get("max_num_seqs")
    engines = (description.get("data_parallel") or {}).get("size") or 1
    if not seqs or chunk_size != DEFAULT_CHUNK:
        return chunk_size
    return max(chunk_size, FILL * int(seqs) * int(engines))


class ResumableEngine(Wrapped):
    """An Engine that answers from the store where it can and sends the rest in chunks, saving each. generate,
    score, trace and read_ids (a run's divergence record) go through the store; every other member, close() included, goes
    to the engine unchanged (Wrapped). scoring_counts() are the engine's: answers read from the store took no
    scoring path. close() frees the store, then closes the engine."""

    def __init__(self, engine: Engine, store: RequestStore, chunk_size: int, settings: Any = None,
                 generate_chunk: int | None = None) -> None:
        super().__init__(engine)
        self.store = store
        self.chunk_size = chunk_size
        self.generate_chunk = generate_chunk or chunk_size  # requests per generate call (generation_chunk)
        self.settings = settings  # this try's memory settings, recorded with each answer it computes
        self.counted: Counter = Counter()  # answers reused and computed: the requests a run asked
        self.traces: Counter = Counter()  # traces reused and computed, apart, for the divergence record
        self.id_reads: Counter = Counter()  # ids reads reused and computed, apart, for the divergence record
        self._reused_from: Counter = Counter()  # settings (as JSON) of the tries whose answers were reused
        self._draws: Counter = Counter()  # sampled requests seen so far in this run, by request hash

    def _key(self, request: Any, path: dict[str, Any] | None = None) -> str:
        """The request's hash, with the path that answers it (``fast``, and ``top_k`` where the answer carries
        a trace); a sampled one also counts how often it was asked this run (a task's ``repeats``, or two tasks
        with one prompt), so each draw keeps its own answer. Greedy ones share."""
        key = sha256({"kind": type(request).__name__, **asdict(request), **(path or {})})
        if isinstance(request, GenRequest) and not request.greedy:
            self._draws[key] += 1
            key = sha256({"request": key, "draw": self._draws[key]})
        return key

    @property
    def reused(self) -> int:
        return self.counted["reused"]

    @property
    def computed(self) -> int:
        return self.counted["computed"]

    def _run(self, requests: Sequence[Any], call: Callable[..., list], load: Callable[[dict], Any],
             progress: Progress | None, path: Callable[[Any], dict[str, Any] | None] = lambda r: None,
             tally: Counter | None = None, dump: Callable[[Any], Any] = asdict, chunk_size: int | None = None) -> list:
        """Each request answered from the store or by call in chunks, each chunk saved as dump(answer) (load
        reads it back); path(request) is keyed with it; reused and computed counted in tally (the answers' by
        default, so that they stay the requests a run asked)."""
        tally = self.counted if tally is None else tally
        keys = [self._key(r, path(r)) for r in requests]
        first: dict[str, int] = {}  # each missing answer once, however often it is asked
        for i, k in enumerate(keys):
            if k not in self.store.answers:
                first.setdefault(k, i)
        missing = list(first.values())
        tally["reused"] += len(requests) - len(missing)
        if progress and len(missing) < len(requests):
            progress.advance(len(requests) - len(missing))
        self._reused_from.update(json.dumps(self.store.origins.get(k), sort_keys=True)
                                 for k in keys if k in self.store.answers)
        size = chunk_size or self.chunk_size
        for start in range(0, len(missing), size):
            chunk = missing[start:start + size]
            try:
                answers = call([requests[i] for i in chunk], progress)
            except PartialAnswers as partial:  # keep what was answered, then fail: a rerun sends only the rest
                kept = [(keys[i], dump(a)) for i, a in zip(chunk, partial.answers) if a is not None]
                self.store.add(kept, by=self.settings)
                tally["computed"] += len(kept)
                raise
            self.store.add([(keys[i], dump(a)) for i, a in zip(chunk, answers)], by=self.settings)
            tally["computed"] += len(chunk)
        return [load(self.store.answers[k]) for k in keys]

    def record(self) -> dict[str, Any]:
        """For results.json: the store, answers reused and computed (the divergence record's traces and ids reads
        counted apart), and the settings the reused answers and traces came from."""
        origins = [{"settings": json.loads(s), "answers": n} for s, n in sorted(self._reused_from.items())]
        return {"store": str(self.store.path), "reused": self.reused, "computed": self.computed,
                "traces": {"reused": self.traces["reused"], "computed": self.traces["computed"]},
                "id_reads": {"reused": self.id_reads["reused"], "computed": self.id_reads["computed"]},
                "reused_from": origins,
                "other_settings": any(o["settings"] != self.settings for o in origins)}

    def close(self) -> None:
        try:
            self.store.close()
        finally:
            self.engine.close()

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *,
                 top_k: int = 0) -> list[Generation]:
        """A greedy request asked with top_k > 0 is keyed by k too (its answer carries the trace of its steps,
        an answer without one is not reused for it); a sampled one carries none, and keeps its key."""
        return self._run(requests, functools.partial(self.engine.generate, top_k=top_k), load_generation, progress,
                         path=lambda r: {"top_k": top_k} if top_k and r.greedy else None,
                         chunk_size=self.generate_chunk)

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True, top_k: int = 0) -> list[Scored]:
        """Keyed by the scoring path, and by k where top_k > 0 (the answer carries its trace); the keys of answers
        asked without one are those of every store written before traces were answered with the scores."""
        return self._run(requests, functools.partial(self.engine.score, fast=fast, top_k=top_k), load_scored,
                         progress, path=lambda r: {"fast": fast, **({"top_k": top_k} if top_k else {})})

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        """Keyed by the request and k (a trace at another k is another answer), apart from its score's key."""
        return self._run(requests, lambda chunk, progress: self.engine.trace(chunk, top_k), load_trace, None,
                         path=lambda r: {"trace_top_k": top_k}, tally=self.traces)

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        """Keyed by the read (its context and ids, in the order asked); kept as its list of log-probabilities."""
        return self._run(reads, lambda chunk, progress: self.engine.read_ids(chunk), load_ids, None,
                         tally=self.id_reads, dump=lambda values: {"logprobs": list(values)})


def load_scored(answer: dict[str, Any]) -> Scored:
    """A stored score, with its trace where it was answered with one."""
    return Scored(**{**answer, "trace": load_trace(answer["trace"]) if answer.get("trace") else None})


def load_generation(answer: dict[str, Any]) -> Generation:
    """A stored generation (token ids as a tuple), with the trace of its steps where it was answered with one."""
    return Generation(**{**answer, "token_ids": tuple(answer.get("token_ids", ())),
                         "trace": load_trace(answer["trace"]) if answer.get("trace") else None})


def load_trace(answer: dict[str, Any]) -> TokenTrace:
    """A stored trace (JSON lists) as the engine gave it: tuples of (token id, log-probability) per position."""
    return TokenTrace(logprobs=tuple(answer["logprobs"]),
                      top=tuple(tuple((int(t), float(v)) for t, v in row) for row in answer["top"]))


def load_ids(answer: dict[str, Any]) -> tuple[float, ...]:
    """A stored ids read: its log-probabilities in the order asked (-inf kept as JSON writes it, -Infinity)."""
    return tuple(float(v) for v in answer["logprobs"])
