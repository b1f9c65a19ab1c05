"""Top-k log-probabilities of a generation recorded as ids and numbers, without vLLM making a string of each.

A greedy generation traced with ``logprobs=k`` (engine.py) makes vLLM's front-end process turn every one of the
k + 1 ids of every step into a string (``LogprobsProcessor._update_sample_logprobs``: a tokenizer ``decode``
per id, then a check against the context), in the process that also feeds the engine: about 0.12 ms a sequence
a step on a 2-core CPU, 32 ms a step at 256 sequences, longer than a decode step of a 7B model on a GPU
(``python -m benchmarks.logprob_strings``). evalkit reads ids and log-probabilities only (trace_rows.py); the
strings are never read. vLLM makes them whenever the request is detokenized, and a request that is not
(``detokenize=False``) may not have stop strings, which generation tasks need.

So the request carries ``extra_args={IDS_ONLY: True}``, and :func:`install` wraps
``LogprobsProcessor.from_new_request`` (vLLM 0.23 and 0.32 alike: ``(tokenizer, request)``) in the process that
builds the engine's front end, so that such a request's log-probabilities get no tokenizer, as a request that is
not detokenized gets none. Its text is detokenized as before (the incremental detokenizer is built apart), and
every other request is untouched. Where vLLM's class has another shape, nothing is wrapped and the strings are
made as before (:func:`install` says so).
"""

from __future__ import annotations

import inspect
from typing import Any

IDS_ONLY = "evalkit_logprob_ids_only"  # the key in SamplingParams.extra_args that asks for ids alone


def install() -> bool:
    """Wrap vLLM's LogprobsProcessor.from_new_request once in this process; whether it is wrapped."""
    try:
        from vllm.v1.engine.logprobs import LogprobsProcessor
    except ImportError:
        return False
    current = LogprobsProcessor.__dict__.get("from_new_request")
    if getattr(current, "__func__", None) is not None and getattr(current.__func__, "evalkit_ids_only", False):
        return True
    if not isinstance(current, classmethod):
        return False
    original = current.__func__
    if list(inspect.signature(original).parameters) != ["cls", "tokenizer", "request"]:
        return False

    def from_new_request(cls: Any, tokenizer: Any, request: Any) -> Any:
        params = getattr(request, "sampling_params", None)
        if params is not None and (getattr(params, "extra_args", None) or {}).get(IDS_ONLY):
            tokenizer = None  # ids and log-probabilities only: decoded_token stays None
        return original(cls, tokenizer, request)

    from_new_request.evalkit_ids_only = True  # type: ignore[attr-defined]
    from_new_request.__doc__ = original.__doc__
    LogprobsProcessor.from_new_request = classmethod(from_new_request)  # type: ignore[method-assign]
    return True
