"""lm-eval internals evalkit needs where lm-eval has no public API, all in this one module (STYLE rule 12).

Checked against lm-eval ``CHECKED`` (pyproject.toml allows the same range); tests/test_lm_eval_compat.py
fails the day one of them moves or changes. Everything else evalkit uses of lm-eval is public.

* ``TaskManager._factory`` and its ``_load_full_config``/``build``: building one task with overrides
  (``task_data``) through lm-eval's own loader, so includes and ``!function`` resolve as usual. The public
  ``TaskManager.load`` takes no per-task overrides.
* ``TemplateLM._encode_pair`` and the empty-context rule of ``TemplateLM.loglikelihood``: how a (context,
  continuation) pair becomes token ids, which :func:`encode_pairs` repeats so the harness keeps each request
  beside its ids (``TemplateLM`` hands ``_loglikelihood_tokens`` the ids without the requests).
* ``lm_eval.evaluator.add_env_info``, the name ``simple_evaluate`` calls when it has scored: its facts (torch's
  ``collect_env``: a dozen subprocesses, 0.3 s on 2 cores) gathered once per process in a thread while the
  requests run (:func:`env_info_ahead`), the same dict. lm-eval takes no precomputed environment.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from typing import Any, Iterator

CHECKED = ">=0.4.13,<0.5"  # the lm-eval versions these internals were checked against


def full_config(manager: Any, entry: Any) -> dict[str, Any]:
    """A task entry's whole YAML config (includes resolved), as lm-eval's loader reads it."""
    return manager._factory._load_full_config(entry)


def build_task(manager: Any, entry: Any, overrides: dict[str, Any] | None) -> Any:
    """The task of entry built by lm-eval's own loader, with config overrides."""
    return manager._factory.build(entry, overrides=overrides, registry=manager.task_index)


def encode_pairs(lm: Any, requests: list[Any]) -> list[tuple[tuple[str, str], list[int], list[int]]]:
    """((context, continuation), context ids, continuation ids) of each loglikelihood request, exactly as
    ``TemplateLM.loglikelihood`` encodes them: an empty context is the prefix token (BOS or EOS), unless the
    continuation starts with it; otherwise ``TemplateLM._encode_pair``."""
    pairs = []
    for context, continuation in (request.args for request in requests):
        if context == "":
            continuation_enc = lm.tok_encode(continuation, add_special_tokens=False)
            context_enc, continuation_enc = (
                ([lm.prefix_token_id], continuation_enc) if lm.prefix_token_id != continuation_enc[0]
                else (continuation_enc[:1], continuation_enc[1:]))
        else:
            context_enc, continuation_enc = lm._encode_pair(context, continuation)
        pairs.append(((context, continuation), context_enc, continuation_enc))
    return pairs


class _Gathered:
    """lm-eval's add_env_info facts, gathered in a daemon thread (a Ctrl-C leaves it behind) at the lowest CPU
    priority, its subprocesses too: on a machine whose cores the engine or a local server keeps busy, they take
    what the evaluation leaves idle."""

    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._gather, daemon=True, name="evalkit-env-info")
        self._thread.start()

    def _gather(self) -> None:
        from lm_eval.loggers.utils import add_env_info

        with contextlib.suppress(AttributeError, OSError):  # Linux: a thread's own nice value, which children inherit
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        add_env_info(self.facts)

    def into(self, storage: dict[str, Any]) -> None:
        from lm_eval.loggers.utils import add_env_info

        if os.getpid() != self._pid:  # a forked child: the thread and its facts are its parent's
            add_env_info(storage)
            return
        self._thread.join()
        if not self.facts:  # the thread failed: lm-eval's own function, here, raises what it raised
            add_env_info(self.facts)
        storage.update(self.facts)


_GATHERED: dict[str, _Gathered] = {}  # by working directory: upper_git_hash is the folder above it
_GATHERING = threading.Lock()
_AHEAD: contextvars.ContextVar[_Gathered | None] = contextvars.ContextVar("evalkit_env_info", default=None)


def _forget_in_child() -> None:
    """A forked child (vLLM's EngineCore on GPUs) has none of its parent's threads: the facts a gathering thread
    had not finished stay unfinished, and _GATHERING, held by another thread at the fork, would stay held. The
    child gathers its own when asked (:meth:`_Gathered.into` checks the process too)."""
    global _GATHERING
    _GATHERED.clear()
    _GATHERING = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def gather_env_info() -> _Gathered:
    """This process's environment facts for lm-eval's results (torch's collect_env, the versions, the git hash
    above the working directory), gathered once per working directory: they do not change while the process
    runs, and a sweep's later points or a second run on a lent engine reuse them."""
    folder = os.getcwd()
    with _GATHERING:
        if folder not in _GATHERED:
            _GATHERED[folder] = _Gathered()
        return _GATHERED[folder]


def _add_env_info(storage: dict[str, Any]) -> None:
    """lm_eval.evaluator.add_env_info from evalkit's first run in the process on (:func:`env_info_ahead` puts it
    there): the facts gathered ahead where this context has them, else lm-eval's own function now (lm-eval's
    simple_evaluate called by anyone else in the process is left as it was)."""
    from lm_eval.loggers.utils import add_env_info

    ahead = _AHEAD.get()
    if ahead is None:
        add_env_info(storage)
    else:
        ahead.into(storage)


@contextlib.contextmanager
def env_info_ahead() -> Iterator[None]:
    """Within: simple_evaluate's environment facts are this process's (:func:`gather_env_info`), gathered beside
    its requests where no run gathered them before; it waits for them only when it adds them to its results."""
    import lm_eval.evaluator

    lm_eval.evaluator.add_env_info = _add_env_info  # type: ignore[attr-defined]
    token = _AHEAD.set(gather_env_info())
    try:
        yield
    finally:
        _AHEAD.reset(token)
