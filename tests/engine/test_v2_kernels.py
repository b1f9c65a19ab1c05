"""evalkit's reads of vLLM 0.32's V2 model runner (every CUDA machine) on what vLLM's own V2 code computes: its
Triton kernels run under Triton's interpreter on this CPU (tests/engine/v2_kernels.py, in a process of its own,
since the interpreter is chosen when the kernels are defined).

tests/engine/test_logprob_reads.py recreates the V2 layouts in torch, following the lines it cites; here the
recreation is held to vLLM's own ``PromptLogprobsWorker`` and ``compute_topk_scores`` for the same steps, and
evalkit's reads are run on vLLM's rows themselves: the exact sum where the rows answer the request, BadRead where
they do not. A greedy generation's steps go from ``compute_topk_scores`` through vLLM's ``LogprobsProcessor`` (as
the engine's output reaches the front end) to evalkit's trace reader.
Run: pytest tests/engine/test_v2_kernels.py
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.outputs import LogprobsLists, LogprobsTensors

from evalkit.engine.logprob_reads import BadRead
from evalkit.engine.vllm.trace_rows import trace_from_steps
from tests.engine.test_logprob_reads import (CHUNKED, HIT_IN_CONTEXT, HIT_INTO_CONTINUATION, NO_HIT, REQUEST,
                                             RESUMED, expected, flat_prompt_logprobs, read_prompt_rows,
                                             v2_token_id_scores, v2_rows)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = {"no hit": NO_HIT, "hit in context": HIT_IN_CONTEXT, "chunked": CHUNKED,
         "hit into continuation": HIT_INTO_CONTINUATION, "fixed ids from row 7": [(7, 5)]}


@pytest.fixture(scope="module")
def computed(tmp_path_factory):
    out = tmp_path_factory.mktemp("v2") / "rows.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "tests.engine.v2_kernels", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)


def tensors(rows):
    return None if rows is None else LogprobsTensors(**rows)


@pytest.mark.parametrize("case", list(STEPS))
def test_the_recreated_v2_rows_are_vllms_own(computed, case):
    """The rows test_logprob_reads.py builds for V2 are those vLLM's PromptLogprobsWorker emits for the same
    steps: the same positions, in the same order, the same ids and ranks, the log-probabilities within float32's
    rounding; and the fixed-id scores from prompt_logprob_start alike (None where vLLM drops them)."""
    real = computed["prompt"][case]
    mine = [r for r in (v2_rows(c, n) for c, n in STEPS[case]) if r is not None]
    ids = torch.cat([r.logprob_token_ids for r in mine])
    assert real["rows"]["logprob_token_ids"].tolist() == ids.tolist()
    assert real["rows"]["selected_token_ranks"].tolist() == torch.cat([r.selected_token_ranks for r in mine]).tolist()
    np.testing.assert_allclose(real["rows"]["logprobs"].numpy(), torch.cat([r.logprobs for r in mine]).numpy(),
                               atol=1e-5)
    recreated = v2_token_id_scores(STEPS[case], REQUEST.start - 1)
    if recreated is None:
        assert real["scores"] is None
    else:
        np.testing.assert_allclose(real["scores"], recreated, atol=1e-5)


@pytest.mark.parametrize("case", ["no hit", "hit in context", "chunked", "fixed ids from row 7"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_vllms_v2_rows_give_the_exact_sum(computed, case, runner):
    """Read as the engine reads them: the rows alone (runner "v1": vLLM 0.23, whose V2 has no fixed-id scores)
    or with the fixed-id scores beside them (0.32's V2)."""
    real = computed["prompt"][case]
    flat = flat_prompt_logprobs(tensors(real["rows"]))
    scored = read_prompt_rows(REQUEST, flat, runner, real["scores"] if runner == "v2" else None)
    total, greedy = expected()
    assert scored.logprob == pytest.approx(total, abs=1e-5) and scored.is_greedy == greedy


@pytest.mark.parametrize("case", ["hit into continuation", "resumed"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_vllms_v2_rows_that_miss_positions_are_refused(computed, case, runner):
    """A cache hit into the continuation, and a request preempted part-way through its prompt (vLLM drops the
    rows of its first chunk with the request's state, then emits only those computed after it resumed, and no
    fixed-id scores): no sum is made of them."""
    real = computed["prompt"][case]
    if case == "resumed":  # only the rows computed after the preemption
        assert real["rows"]["logprob_token_ids"][:, 0].tolist() == [r.logprob_token_ids[0, 0].item() for r in
                                                                  [v2_rows(9, 1), v2_rows(10, 1)]]
        assert RESUMED[1] == (9, 3)
    with pytest.raises(BadRead):
        read_prompt_rows(REQUEST, flat_prompt_logprobs(tensors(real["rows"])), runner,
                         real["scores"] if runner == "v2" else None)


def test_a_greedy_generation_traced_by_vllms_v2_kernels_is_read_exactly(computed):
    """Each decode step's compute_topk_scores (the sampled id, then the top 5, raw log-probabilities) reaches
    evalkit as vLLM's front end builds it (LogprobsProcessor, flat): the trace holds each step's sampled token
    and top 5, equal to the logits' log-softmax; a step whose sampled id is not the output's is refused."""
    generation = computed["generation"]
    logits, sampled = generation["logits"], generation["sampled"]
    request = SimpleNamespace(sampling_params=SamplingParams(logprobs=5, flat_logprobs=True))
    processor = LogprobsProcessor.from_new_request(None, request)
    for ids, values, ranks in generation["steps"]:
        processor._update_sample_logprobs(LogprobsLists(np.array(ids), np.array(values), np.array(ranks), None))
    trace = trace_from_steps(tuple(sampled), processor.logprobs, 5)
    table = logits.log_softmax(-1)
    assert trace.logprobs == pytest.approx([table[i, t].item() for i, t in enumerate(sampled)], abs=1e-5)
    for step, top in enumerate(trace.top):
        assert [t for t, _ in top] == table[step].topk(5).indices.tolist()
        assert [v for _, v in top] == pytest.approx(table[step].topk(5).values.tolist(), abs=1e-5)
    with pytest.raises(BadRead):
        trace_from_steps(tuple(sampled[:-1]) + (sampled[-1] + 1,), processor.logprobs, 5)
