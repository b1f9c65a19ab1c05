"""The divergence bound on the real embedded model: SmolLM2-135M in float32 against the same weights in bfloat16,
through transformers on the CPU, every position of two short texts. No position's top-k bound is above the exact
full-vocabulary KL, and the exact path and the bound agree on the text token. About 10 s (benchmarks/
divergence_bound.py measures the same on 40 documents). Run: pytest tests/test_divergence_model.py"""

import os
from pathlib import Path

import numpy as np
import pytest

from evalkit.compare.divergence import PAD, full_distribution, measure, top_entries

MODEL = Path(os.path.expanduser("~/.cache/evalkit/smollm2-135m-instruct"))
TEXTS = ["Question: Which animal says \"woof\"?\nAnswer: dog",
         "Question: What is 14 - 1?\nAnswer: 13"]

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason=f"no embedded model in {MODEL}")


@pytest.fixture(scope="module")
def log_probs():
    """Both runs' float32 log-probabilities (L - 1, V) for each text, and each text's next tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared: spinning OpenMP workers make each forward ten times slower
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    out = []
    models = [AutoModelForCausalLM.from_pretrained(MODEL, dtype=d).eval() for d in (torch.float32, torch.bfloat16)]
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            ref, cand = (torch.log_softmax(m(ids).logits[0, :-1].float(), -1).numpy() for m in models)
            out.append((ref.astype(float), cand.astype(float), ids[0, 1:].numpy()))
    torch.set_num_threads(threads)  # as it was, for the tests that run after these
    return out


def test_no_position_s_bound_is_above_the_exact_kl_on_the_real_model(log_probs):
    for ref, cand, text in log_probs:
        exact = measure(full_distribution(text, ref), full_distribution(text, cand))
        assert (exact.kld > 1e-7).all()  # bfloat16 moves every position: the bound has something to miss
        rows = np.arange(len(text))
        for k in (5, 20, 100):
            r_ids = np.argsort(-ref, axis=1)[:, :k]
            c_ids = np.argsort(-cand, axis=1)[:, :k]
            ref_side = top_entries(text, ref[rows, text], r_ids, np.take_along_axis(ref, r_ids, axis=1))
            own = top_entries(text, cand[rows, text], c_ids, np.take_along_axis(cand, c_ids, axis=1))
            repeated = (c_ids[:, :, None] == r_ids[:, None, :]).any(axis=2)
            asked_ids = np.concatenate([r_ids, np.where(repeated, PAD, c_ids)], axis=1)
            asked_lp = np.where(asked_ids == PAD, np.nan, np.take_along_axis(cand, np.maximum(asked_ids, 0), axis=1))
            asked = top_entries(text, cand[rows, text], asked_ids, asked_lp)
            for bound in (measure(ref_side, own), measure(ref_side, asked)):
                assert (bound.kld <= exact.kld + 1e-6).all(), (k, float((bound.kld - exact.kld).max()))
                assert 0.3 < bound.kld.sum() / exact.kld.sum() < 1.0
                assert bound.delta_p == pytest.approx(exact.delta_p)
                assert np.nanmean(bound.same_top) == np.mean(exact.same_top)
