"""engine=hf, generation by vLLM's conventions on HF's ``model.generate``: its sampling settings
(``hf/settings.py``), each new token detokenized as vLLM's incremental detokenizer writes it, stop strings cut
from the text, the token ids kept up to the one that completed a stop, and vLLM's finish reasons; so the two
engines' outputs can be compared request by request (tests/engine/hf/test_hf_engine.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from evalkit.contracts import Generation, GenRequest, Progress
from evalkit.engine.hf.model import Loaded
from evalkit.engine.hf.settings import Sampling, sampling_for_hf


def generate(loaded: Loaded, requests: Sequence[GenRequest], progress: Progress | None, *, max_model_len: int,
             batch_size: int) -> list[Generation]:
    """Batches of one sampling setting, left-padded, in lm-eval's hf order (longest prompt first, then by its
    text); a request with its own seed runs alone, from that seed, leaving the engine's random state as it was."""
    import torch

    plans = [sampling_for_hf(dict(r.sampling)) for r in requests]
    groups: dict[Sampling, list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(plan, []).append(i)
    results: list[Generation | None] = [None] * len(requests)
    for plan, members in groups.items():
        members.sort(key=lambda i: (-len(requests[i].prompt_ids),
                                    loaded.tokenizer.decode(list(requests[i].prompt_ids))))
        size = 1 if plan.seed is not None else batch_size
        for start in range(0, len(members), size):
            batch = members[start:start + size]
            with torch.random.fork_rng(enabled=plan.seed is not None):
                if plan.seed is not None:
                    torch.manual_seed(plan.seed)
                rows = _generate(loaded, [requests[i] for i in batch], plan, max_model_len)
            for i, row in zip(batch, rows):
                results[i] = row.generation()
            if progress:
                progress.advance(len(batch), sum(len(row.ids) for row in rows))
    return results  # type: ignore[return-value]


def _generate(loaded: Loaded, batch: list[GenRequest], plan: Sampling, max_model_len: int) -> list[Row]:
    """One batch of one sampling setting through model.generate, each sequence's tokens read into its Row as
    they come; the batch stops when every Row has finished."""
    import torch
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    stop_ids = {*loaded.eos_ids, *plan.stop_token_ids}
    if any(len(r.prompt_ids) >= max_model_len for r in batch):
        raise ValueError(f"a prompt of {max(len(r.prompt_ids) for r in batch)} tokens leaves no room to generate "
                         f"within max_model_len={max_model_len}")
    rows = [Row(r, _detokenizer(loaded.tokenizer, r.prompt_ids, plan), stop_ids,
                limit=min(r.max_tokens, max_model_len - len(r.prompt_ids))) for r in batch]

    class Rows(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            for row, token in zip(rows, input_ids[:, -1].tolist()):
                row.add(token)
            return torch.tensor([row.finish is not None for row in rows], device=input_ids.device)

    ids, mask = loaded.padded([r.prompt_ids for r in batch], left=True)
    config = GenerationConfig(**dict(plan.options), max_new_tokens=max(row.limit for row in rows),
                              eos_token_id=sorted(stop_ids), pad_token_id=loaded.pad_id,
                              bos_token_id=loaded.model.generation_config.bos_token_id)
    with torch.inference_mode():
        loaded.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                              stopping_criteria=StoppingCriteriaList([Rows()]))
    return rows


def _detokenizer(tokenizer: Any, prompt_ids: Sequence[int], plan: Sampling) -> Callable[[int], str]:
    """The text each new token adds, as vLLM's FastIncrementalDetokenizer gives it: a DecodeStream primed with
    the prompt, and two special tokens in a row joined without a space unless spaces_between_special_tokens.
    A tokenizer without a Rust backend: the growth of the decoded output."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        seen: list[int] = []

        def by_prefix(token: int) -> str:
            before = tokenizer.decode(seen, skip_special_tokens=plan.skip_special_tokens)
            seen.append(token)
            return tokenizer.decode(seen, skip_special_tokens=plan.skip_special_tokens)[len(before):]

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


class Row:
    """One sequence being generated, detokenized token by token as vLLM's detokenizer does: a stop token ends
    it (its text left out), a stop string ends it (the text cut before it, the ids kept up to the token that
    completed it), or its own max_tokens does."""

    def __init__(self, request: GenRequest, step: Callable[[int], str], stop_ids: set[int], limit: int) -> None:
        self.request, self.step, self.stop_ids, self.limit = request, step, stop_ids, limit
        self.ids: list[int] = []
        self.text = ""
        self.finish: str | None = None

    def add(self, token: int) -> None:
        if self.finish:
            return
        self.ids.append(token)
        if token in self.stop_ids:
            self.finish = "stop"
            return
        before = len(self.text)
        self.text += self.step(token)
        best = None  # (end, start) of the stop string that completes first, the first listed on a tie
        for stop in self.request.stop:
            start = self.text.find(stop, max(before + 1 - len(stop), 0))
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start)
        if best:
            self.text, self.finish = self.text[:best[1]], "stop"
        elif len(self.ids) >= self.limit:
            self.finish = "length"

    def generation(self) -> Generation:
        return Generation(text=self.text, finish_reason=self.finish or "length", output_tokens=len(self.ids),
                          token_ids=tuple(self.ids))
