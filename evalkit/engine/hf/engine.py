"""Stage 2, the engine, on HF transformers (``engine=hf``): a reference implementation of the model beside vLLM.

The same :class:`evalkit.contracts.Engine` as ``vllm/engine.py``, so every evalkit feature runs on it
unchanged. Log-likelihoods follow lm-eval's own ``hf`` backend (the whole sequence but its last token in
one forward pass, no attention mask, log_softmax in the model's dtype, is_greedy when every scored token is the argmax); generations
follow vLLM's conventions (its sampling settings, stop strings cut from the text, the token ids up to the
one that completed a stop, finish reasons), so the two engines' outputs can be compared request by request
(tests/engine/hf/test_hf_engine.py). torch and transformers are imported here only, lazily.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from evalkit.contracts import Generation, GenRequest, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.backoff import DEFAULT_BATCH_SIZE
from evalkit.engine.machine.environment import hardware, library_versions
from evalkit.engine.hf.settings import Row, Sampling, check_settings, sampling_for_hf
from evalkit.engine.tokenizer import TokenizerSide

LOGIT_ROWS = 4096  # rows of logits (batch x longest input) one scoring pass may hold; 49152 x 4 bytes each here
DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16"}


def score_batches(requests: Sequence[ScoreRequest], batch_size: int, logit_rows: int = LOGIT_ROWS) -> list[list[int]]:
    """Indices of requests in forward passes, in lm-eval's hf order (longest first, then by token ids), at most
    batch_size each and at most logit_rows rows of logits (batch times its longest input; one request at least)."""
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].ids), requests[i].ids))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and \
                (len(batches[-1]) + 1) * (len(requests[batches[-1][0]].ids) - 1) <= logit_rows:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class HFEngine(TokenizerSide):
    """The :class:`evalkit.contracts.Engine` backed by ``transformers.AutoModelForCausalLM``."""

    template_from = "tokenizer"  # lm-eval's hf backend: the tokenizer's own template

    def __init__(self, *, model: str, tokenizer: str | None, dtype: str, max_model_len: int, batch_size: int | None,
                 seed: int, trust_remote_code: bool, add_bos_token: bool | None,
                 engine_kwargs: dict[str, Any]) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        check_settings(engine_kwargs=engine_kwargs, sampling_kwargs={}, tensor_parallel_size=1,
                       pipeline_parallel_size=1)
        on_gpu = torch.cuda.is_available()
        device_map = engine_kwargs.get("device_map", "cuda" if on_gpu else "cpu")
        wanted = DTYPES.get(dtype, "float32" if not on_gpu else "auto")  # auto: float32 on CPU, the checkpoint's on GPU
        extra = {"add_bos_token": add_bos_token} if add_bos_token is not None else {}
        # as lm-eval's hf backend loads it (HFLM._create_tokenizer)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model, trust_remote_code=trust_remote_code,
                                                       use_fast=True, **extra)
        kwargs = {k: v for k, v in engine_kwargs.items() if k == "attn_implementation"}
        if device_map != "cpu":
            kwargs["device_map"] = device_map
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=wanted if wanted == "auto" else getattr(torch, wanted), trust_remote_code=trust_remote_code,
            **kwargs).eval()
        own = self.model.generation_config
        eos = [own.eos_token_id] if isinstance(own.eos_token_id, int) else list(own.eos_token_id or [])
        self.eos_ids = sorted({t for t in (self.tokenizer.eos_token_id, *eos) if t is not None})  # as vLLM: both
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        # sampling comes from each request's settings alone, never from the model's generation_config.json
        self.model.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=self.eos_ids,
                                                        pad_token_id=pad)
        self.pad_id = pad
        self.max_model_len = max_model_len
        self.batch_size = batch_size or DEFAULT_BATCH_SIZE
        torch.manual_seed(seed)  # once, as vLLM seeds its sampler at start: draws follow the requests sent before
        self.args: dict[str, Any] = {
            "model": model, "tokenizer": tokenizer or model, "dtype": str(self.model.dtype).removeprefix("torch."),
            "device_map": device_map, "max_model_len": max_model_len, "max_num_seqs": self.batch_size, "seed": seed,
            "trust_remote_code": trust_remote_code, "attn_implementation": engine_kwargs.get("attn_implementation")}

    def _padded(self, seqs: list[Sequence[int]], *, left: bool) -> tuple[Any, Any]:
        """(input ids, attention mask) of seqs padded to the longest, on the model's device."""
        import torch

        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for n, seq in enumerate(seqs):
            where = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[n, where], mask[n, where] = torch.tensor(seq, dtype=torch.long), 1
        return ids.to(self.model.device), mask.to(self.model.device)

    # --- log-likelihoods ---
    def _logprobs(self, batch: Sequence[ScoreRequest]) -> list[Any]:
        """Per request, log-probabilities [positions, vocab] of the positions predicting ids[max(start, 1):], as
        lm-eval's hf backend computes them (``HFLM._loglikelihood_tokens``): one forward pass of the batch,
        right-padded, over each sequence but its last token, with no attention mask (right padding comes after
        every position a causal model reads), log_softmax in the model's dtype, and kept in it (lm-eval sums a
        continuation's values in that dtype). All logits are computed: asking for the scored positions only
        (logits_to_keep) would change them by rounding (measured: up to 8e-6 nats per request in float32). In
        bfloat16, a float32 log_softmax and sum moved a continuation by up to 3.6e-2 nats from lm-eval's
        (tests/engine/hf/test_hf_engine.py holds the two equal in bfloat16)."""
        import torch

        ids, _ = self._padded([r.ids[:-1] for r in batch], left=False)
        with torch.inference_mode():
            rows = torch.log_softmax(self.model(input_ids=ids).logits, dim=-1)
            return [rows[row, max(r.start, 1) - 1:len(r.ids) - 1] for row, r in enumerate(batch)]

    def _each_batch(self, requests: Sequence[ScoreRequest], read: Callable[[ScoreRequest, Any], Any], empty: Any,
                    progress: Progress | None) -> list[Any]:
        """read(request, the log-probabilities of its scored positions) for each request, in request order.

        Requests with the same input (ids[:-1]: the choices of a question with one-token answers) share one
        forward pass, that of the one with the longest continuation, as lm-eval's hf backend shares them."""
        results: list[Any] = [empty] * len(requests)
        shared: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            if len(r.ids) > max(r.start, 1):  # the others score no token
                shared.setdefault(r.ids[:-1], []).append(i)
        first = {i: max(requests[i].start, 1) for members in shared.values() for i in members}
        heads = [min(members, key=lambda i: first[i]) for members in shared.values()]
        if progress and len(first) < len(requests):
            progress.advance(len(requests) - len(first))
        for batch in score_batches([requests[i] for i in heads], self.batch_size):
            chosen = [requests[heads[b]] for b in batch]
            answered = 0
            for b, rows in zip(batch, self._logprobs(chosen)):
                for i in shared[requests[heads[b]].ids[:-1]]:
                    results[i] = read(requests[i], rows[first[i] - first[heads[b]]:])
                    answered += 1
            if progress:
                progress.advance(answered, sum(len(r.ids) for r in chosen))
        return results

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True) -> list[Scored]:
        """Log-probabilities of ids[start:] given ids[:start] (from position 1 when start is 0, as vLLM), and
        is_greedy as lm-eval's hf backend reads it: each scored token is the argmax. One path: fast changes nothing."""
        import torch

        def read(r: ScoreRequest, rows: Any) -> Scored:
            target = torch.tensor(r.ids[max(r.start, 1):], device=rows.device)
            return Scored(logprob=float(rows.gather(1, target[:, None]).sum()),
                          is_greedy=bool((rows.argmax(dim=-1) == target).all()))

        return self._each_batch(requests, read, Scored(logprob=0.0, is_greedy=True), progress)

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        import torch

        def read(r: ScoreRequest, rows: Any) -> TokenTrace:
            target = torch.tensor(r.ids[max(r.start, 1):], device=rows.device)
            values, tokens = rows.topk(top_k, dim=-1)
            rows = rows.float()
            return TokenTrace(logprobs=tuple(rows.gather(1, target[:, None])[:, 0].tolist()),
                              top=tuple(tuple(zip(t, v)) for t, v in zip(tokens.tolist(), values.tolist())))

        return self._each_batch(requests, read, TokenTrace(logprobs=(), top=()), None)

    # --- generation ---
    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None) -> list[Generation]:
        """Batches of one sampling setting, left-padded, in lm-eval's hf order (longest prompt first, then by its
        text); a request with its own seed runs alone, from that seed, leaving the engine's random state as it was."""
        import torch

        plans = [sampling_for_hf(dict(r.sampling)) for r in requests]
        groups: dict[Sampling, list[int]] = {}
        for i, plan in enumerate(plans):
            groups.setdefault(plan, []).append(i)
        results: list[Generation | None] = [None] * len(requests)
        for plan, members in groups.items():
            members.sort(key=lambda i: (-len(requests[i].prompt_ids), self.decode(requests[i].prompt_ids)))
            size = 1 if plan.seed is not None else self.batch_size
            for start in range(0, len(members), size):
                batch = members[start:start + size]
                with torch.random.fork_rng(enabled=plan.seed is not None):
                    if plan.seed is not None:
                        torch.manual_seed(plan.seed)
                    rows = self._generate([requests[i] for i in batch], plan)
                for i, row in zip(batch, rows):
                    results[i] = row.generation()
                if progress:
                    progress.advance(len(batch), sum(len(row.ids) for row in rows))
        return results  # type: ignore[return-value]

    def _generate(self, batch: list[GenRequest], plan: Sampling) -> list[Row]:
        import torch
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        stop_ids = {*self.eos_ids, *plan.stop_token_ids}
        if any(len(r.prompt_ids) >= self.max_model_len for r in batch):
            raise ValueError(f"a prompt of {max(len(r.prompt_ids) for r in batch)} tokens leaves no room to generate "
                             f"within max_model_len={self.max_model_len}")
        rows = [Row(r, self._detokenizer(r.prompt_ids, plan), stop_ids,
                    limit=min(r.max_tokens, self.max_model_len - len(r.prompt_ids))) for r in batch]

        class Rows(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                for row, token in zip(rows, input_ids[:, -1].tolist()):
                    row.add(token)
                return torch.tensor([row.finish is not None for row in rows], device=input_ids.device)

        ids, mask = self._padded([r.prompt_ids for r in batch], left=True)
        config = GenerationConfig(**dict(plan.options), max_new_tokens=max(row.limit for row in rows),
                                  eos_token_id=sorted(stop_ids), pad_token_id=self.pad_id,
                                  bos_token_id=self.model.generation_config.bos_token_id)
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                stopping_criteria=StoppingCriteriaList([Rows()]))
        return rows

    def _detokenizer(self, prompt_ids: Sequence[int], plan: Sampling) -> Callable[[int], str]:
        """The text each new token adds, as vLLM's FastIncrementalDetokenizer gives it: a DecodeStream primed with
        the prompt, and two special tokens in a row joined without a space unless spaces_between_special_tokens.
        A tokenizer without a Rust backend: the growth of the decoded output."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            seen: list[int] = []

            def by_prefix(token: int) -> str:
                before = self.tokenizer.decode(seen, skip_special_tokens=plan.skip_special_tokens)
                seen.append(token)
                return self.tokenizer.decode(seen, skip_special_tokens=plan.skip_special_tokens)[len(before):]

            return by_prefix
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=plan.skip_special_tokens)
        added = {} if plan.skip_special_tokens or plan.spaces_between_special_tokens else {
            t: tok.content for t, tok in backend.get_added_tokens_decoder().items()}
        last_special = [False]

        def step(token: int) -> str:
            text = stream.step(backend, token) or ""
            if added:
                if token in added and last_special[0]:
                    text = added[token]
                last_special[0] = token in added
            return text

        return step

    def scoring_counts(self) -> dict[str, int]:
        return {}  # one scoring path: the whole sequence in one forward pass

    def describe(self) -> dict[str, Any]:
        return {"name": "hf", "engine_args": dict(self.args), "versions": library_versions(), "hardware": hardware()}

    def close(self) -> None:
        import gc

        import torch

        self.model = None  # the weights go with the last reference to them
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
