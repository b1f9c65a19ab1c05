"""lm-eval internals evalkit needs where lm-eval has no public API, all in this one module (STYLE rule 12).

Checked against lm-eval ``CHECKED`` (pyproject.toml allows the same range); tests/test_lm_eval_compat.py
fails the day one of them moves or changes. Everything else evalkit uses of lm-eval is public.

* ``TaskManager._factory`` and its ``_load_full_config``/``build``: building one task with overrides
  (``task_data``) through lm-eval's own loader, so includes and ``!function`` resolve as usual. The public
  ``TaskManager.load`` takes no per-task overrides.
* ``TemplateLM._encode_pair`` and the empty-context rule of ``TemplateLM.loglikelihood``: how a (context,
  continuation) pair becomes token ids, which :func:`encode_pairs` repeats so the harness keeps each request
  beside its ids (``TemplateLM`` hands ``_loglikelihood_tokens`` the ids without the requests).
"""

from __future__ import annotations

from typing import Any

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
