"""vLLM 0.32's V2 model runner's log-probability code, run on a CPU: its Triton kernels under Triton's interpreter.

Run as ``TRITON_INTERPRET=1 python -m tests.engine.v2_kernels OUT`` (tests/engine/test_v2_kernels.py does): the
CPU build of vLLM turns Triton off (vllm/triton_utils/importing.py: "doesn't include CPU backend"), so Triton's
own modules are handed to ``vllm.triton_utils`` before vLLM's V2 sampling modules are imported, and their
``@triton.jit`` kernels then run in the interpreter on CPU tensors. What a step computes comes from vLLM's own
functions: ``PromptLogprobsWorker`` (vllm/v1/worker/gpu/sample/prompt_logprob.py: which rows, the chunked
prompt's rows kept and merged, the fixed-id scores from ``prompt_logprob_start``) and ``compute_topk_scores``
(vllm/v1/worker/gpu/sample/logprob.py: a decode step's sampled id, top-k and rank). The model is the logits of
tests/engine/test_logprob_reads.py (``logits_fn`` the identity on them), the batch one request, with the
fields ``compute_prompt_logprobs`` reads of vLLM's InputBatch, as the runner fills them for a scheduled step.
A preemption between two steps removes the request from the worker and adds it again, as the runner does
(model_runner.py ``_remove_request`` for preempted_req_ids, then ``add_requests``).

Written to OUT (torch.save): per case, the rows emitted when the prompt ended (ids, log-probabilities, ranks) or
None, and the fixed-id scores or None; and the steps of one greedy generation (its logits, its sampled ids and
``compute_topk_scores``' LogprobsTensors as lists).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import torch

PREEMPTED = "preempted"  # a step marker: the request was preempted before this step


def use_triton() -> None:
    """Hand Triton to vLLM's triton_utils (the CPU build turned it off), before any V2 module is imported."""
    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True


def batch(computed: int, scheduled: int, prompt_len: int) -> SimpleNamespace:
    """The fields of vllm/v1/worker/gpu/input_batch.py InputBatch that the prompt log-probability code reads, for
    one request (slot 0) scheduled from computed for scheduled tokens, nothing generated yet."""
    return SimpleNamespace(
        req_ids=["r"], idx_mapping=torch.tensor([0], dtype=torch.int32), idx_mapping_np=np.array([0]),
        num_scheduled_tokens=np.array([scheduled], dtype=np.int32), num_tokens=scheduled,
        query_start_loc=torch.tensor([0, scheduled], dtype=torch.int32),
        query_start_loc_np=np.array([0, scheduled], dtype=np.int32),
        num_computed_prefill_tokens_np=np.array([computed]), prefill_len_np=np.array([prompt_len]))


def prompt_case(steps: list, ids: tuple[int, ...], logits: torch.Tensor, first_row: int) -> dict:
    """The rows and fixed-id scores vLLM's PromptLogprobsWorker emits for the request over steps
    ((num_computed_tokens, scheduled) or PREEMPTED)."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker

    prompt_len = len(ids)
    params = SamplingParams(prompt_logprobs=1, max_tokens=1, prompt_logprob_start=first_row,
                            prompt_logprob_token_ids=np.array([[t] for t in ids[first_row + 1:]], dtype=np.int64))
    worker = PromptLogprobsWorker(max_num_reqs=1, device=torch.device("cpu"))
    worker.add_request("r", 0, params)
    all_ids = torch.zeros((1, prompt_len + 16), dtype=torch.int64)  # the runner's rows are max_model_len long
    all_ids[0, :prompt_len] = torch.tensor(ids)
    rows, scores = None, None
    for step in steps:
        if step == PREEMPTED:
            worker.remove_request("r")
            worker.add_request("r", 0, params)
            continue
        computed, scheduled = step
        hidden = logits[computed:computed + scheduled]  # the step's query positions; logits_fn: the identity
        got = worker.compute_prompt_logprobs(lambda h: h, hidden, batch(computed, scheduled, prompt_len), all_ids,
                                             torch.tensor([computed]), np.array([prompt_len]))
        fixed = worker.compute_prompt_token_id_logprobs(lambda h: h, hidden, batch(computed, scheduled, prompt_len),
                                                        np.array([prompt_len]))
        rows = got.get("r", rows)
        scores = fixed.get("r", scores)
    if rows is not None:
        rows = {"logprob_token_ids": rows.logprob_token_ids.clone(), "logprobs": rows.logprobs.clone(),
                "selected_token_ranks": rows.selected_token_ranks.clone()}
    return {"rows": rows, "scores": None if scores is None else scores.clone().numpy()}


def generation_case(top_k: int, steps: int, vocab: int) -> dict:
    """A greedy generation of steps tokens over random logits: each decode step's compute_topk_scores, as
    lists (LogprobsTensors.tolists), with the sampled ids and the logits."""
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(1)) * 4
    sampled = logits.argmax(-1)
    lists = []
    for step in range(steps):
        out = compute_topk_scores(logits[step:step + 1], top_k, sampled[step:step + 1])
        lists.append((out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.selected_token_ranks.tolist()))
    return {"logits": logits, "sampled": sampled.tolist(), "steps": lists}


def main(out: str) -> None:
    use_triton()
    from tests.engine.test_logprob_reads import (CHUNKED, HIT_IN_CONTEXT, HIT_INTO_CONTINUATION, IDS, LOGITS,
                                                 NO_HIT, REQUEST, RESUMED)

    cases = {"no hit": NO_HIT, "hit in context": HIT_IN_CONTEXT, "chunked": CHUNKED,
             "hit into continuation": HIT_INTO_CONTINUATION, "resumed": [RESUMED[0], PREEMPTED, RESUMED[1]],
             "fixed ids from row 7": [(7, 5)]}
    first_row = REQUEST.start - 1
    torch.save({"prompt": {name: prompt_case(steps, IDS, LOGITS, first_row) for name, steps in cases.items()},
                "generation": generation_case(top_k=5, steps=6, vocab=300)}, out)


if __name__ == "__main__":
    main(sys.argv[1])
