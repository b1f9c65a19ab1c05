"""Settings left out of the resume fingerprint change scheduling and memory only, never answers: evidence on
the real CPU engine (evalkit/store/fingerprint.py, SCHEDULING_ONLY; README "Runs that survive").

A second engine with a smaller KV cache (gpu_memory_utilization, and kv_cache_memory_bytes, which evalkit.engine.machine.tuning
otherwise sizes alike for both), at most 4 sequences at once (max_num_seqs), none of evalkit's automatic
choices (tune=false: vLLM's own process layout) and compiled (enforce_eager=false, as vLLM starts by default)
answers the same documents as the session's (tuned, eager, vLLM's default max_num_seqs): identical
generations, chosen answers and scores; log-likelihoods within
FLOAT_TOL (float32 sums in another order: measured 2.7e-05 nats at most).
Run: pytest -m engine -s tests/store/test_scheduling.py
"""

import pytest

from evalkit.config import compose_config
from evalkit.engine.wrapper import KeptRunning
from evalkit.engine.vllm.start import start_vllm
from evalkit.run.evaluate import evaluate
from tests.conftest import PAIR_LIMIT, samples_by_doc

pytestmark = pytest.mark.engine
LIMIT = PAIR_LIMIT  # 20
FLOAT_TOL = 1e-4  # nats per choice


def test_memory_batching_and_compilation_do_not_change_answers(noise_pair, embedded_model_dir, tmp_path):
    """The reference: the session's float32 run of the default tasks on PAIR_LIMIT documents, computed (resume
    off) on the session's engine (tests/conftest.py noise_pair, shared with the comparison tests)."""
    tasks = compose_config([]).tasks  # the default tasks, as noise_pair runs them
    reference = samples_by_doc(noise_pair[0], tasks)
    other_cfg = compose_config([f"limit={LIMIT}", "resume=false", f"output_dir={tmp_path}", "tune=false",
                                "gpu_memory_utilization=0.15", "batch_size=4", "+engine_kwargs.enforce_eager=false",
                                f"+engine_kwargs.kv_cache_memory_bytes={2**29}"])
    other = start_vllm(other_cfg, embedded_model_dir)
    assert other.describe()["choices"] == []  # tune=false: no setting chosen for this machine
    try:
        candidate = samples_by_doc(evaluate(other_cfg, engine_factory=lambda c, d: KeptRunning(other)), tasks)
    finally:
        other.close()
    drift, differ = [], []
    for task, docs in reference.items():
        for key, ref in docs.items():
            cand = candidate[task][key]
            if ref["raw_output"] is not None:
                differ += [key] if ref["raw_output"] != cand["raw_output"] else []
            else:
                drift += [abs(float(a[0][0]) - float(b[0][0])) for a, b in zip(ref["resps"], cand["resps"])]
                assert [a[0][1] for a in ref["resps"]] == [b[0][1] for b in cand["resps"]]  # is_greedy
            assert {m: ref[m] for m in ref["metrics"]} == {m: cand[m] for m in cand["metrics"]}, (task, key)
    print(f"\nutilization 0.25 -> 0.15, KV cache 1.4 -> 0.5 GiB, max_num_seqs default -> 4, eager -> compiled: {len(differ)} of "
          f"{LIMIT} generations differ, log-likelihood drift max {max(drift):.1e} over {len(drift)} choices")
    assert not differ and max(drift) <= FLOAT_TOL
