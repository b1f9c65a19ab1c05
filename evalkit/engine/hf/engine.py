"""engine=hf: the Engine contract on HF transformers, a reference implementation of the model beside vLLM.

The same :class:`evalkit.contracts.Engine` as ``vllm/engine.py``, so every evalkit feature runs on it
unchanged. Log-likelihoods and traces follow lm-eval's own ``hf`` backend (``hf/forward.py``); generations
follow vLLM's conventions (``hf/generation.py``), so the two engines' outputs can be compared request by request
(tests/engine/hf/test_hf_engine.py). The model is loaded in ``hf/model.py``; its settings are checked in
``hf/settings.py``. torch and transformers are imported in this room only, lazily.
"""

from __future__ import annotations

from typing import Any, Sequence

from evalkit.contracts import Generation, GenRequest, IdsRead, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.backoff import DEFAULT_BATCH_SIZE
from evalkit.engine.hf import forward, generation
from evalkit.engine.hf.model import load
from evalkit.engine.hf.settings import check_settings
from evalkit.engine.machine.environment import hardware, library_versions
from evalkit.engine.tokenizer import TokenizerSide


class HFEngine(TokenizerSide):
    """The :class:`evalkit.contracts.Engine` backed by ``transformers.AutoModelForCausalLM``."""

    template_from = "tokenizer"  # lm-eval's hf backend: the tokenizer's own template

    def __init__(self, *, model: str, tokenizer: str | None, dtype: str, max_model_len: int, batch_size: int | None,
                 seed: int, trust_remote_code: bool, add_bos_token: bool | None,
                 engine_kwargs: dict[str, Any]) -> None:
        import torch

        check_settings(engine_kwargs=engine_kwargs, sampling_kwargs={}, tensor_parallel_size=1,
                       pipeline_parallel_size=1)
        self.loaded = load(model=model, tokenizer=tokenizer, dtype=dtype, trust_remote_code=trust_remote_code,
                           add_bos_token=add_bos_token, engine_kwargs=engine_kwargs)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = max_model_len
        self.logits_dtype = str(self.loaded.model.dtype).removeprefix("torch.")  # "auto" resolved
        self.batch_size = batch_size or DEFAULT_BATCH_SIZE
        torch.manual_seed(seed)  # once, as vLLM seeds its sampler at start: draws follow the requests sent before
        self.args: dict[str, Any] = {
            "model": model, "tokenizer": tokenizer or model,
            "dtype": str(self.loaded.model.dtype).removeprefix("torch."), "device_map": self.loaded.device_map,
            "max_model_len": max_model_len, "max_num_seqs": self.batch_size, "seed": seed,
            "trust_remote_code": trust_remote_code, "attn_implementation": engine_kwargs.get("attn_implementation")}

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True, top_k: int = 0) -> list[Scored]:
        """Log-probabilities of ids[start:] given ids[:start]. One path: fast changes nothing. With top_k > 0,
        each answer's trace from the same forward pass."""
        return forward.score(self.loaded, requests, progress, batch_size=self.batch_size, top_k=top_k)

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        return forward.trace(self.loaded, requests, top_k, batch_size=self.batch_size)

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        """From one forward pass over each context, its last row log_softmax'ed in float32 (hf/forward.py)."""
        return forward.read_ids(self.loaded, reads, batch_size=self.batch_size)

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *,
                 top_k: int = 0) -> list[Generation]:
        """No trace, whatever top_k: the harness traces the greedy outputs in a call of its own (read here, it
        would mean keeping the logits of every step of model.generate)."""
        return generation.generate(self.loaded, requests, progress, max_model_len=self.max_model_len,
                                   batch_size=self.batch_size)

    def scoring_counts(self) -> dict[str, int]:
        return {}  # one scoring path: the whole sequence in one forward pass

    def describe(self) -> dict[str, Any]:
        return {"name": "hf", "engine_args": dict(self.args), "versions": library_versions(), "hardware": hardware()}

    def close(self) -> None:
        import gc

        import torch

        self.loaded = None  # the weights go with the last reference to them
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
