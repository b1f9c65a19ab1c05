"""`evalkit.compare` on runs made through lm-eval with the deterministic fake engine.

The fake answers arithmetic right unless told to reply a fixed text, so the expected flips are known.
Run: pytest tests/test_compare.py
"""

import json

import pytest

from evalkit import compare
from evalkit.config import EvalConfig
from evalkit.run import evaluate
from tests.fake_engine import FakeEngine


def fake_run(tmp_path, name, engine, **cfg):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    settings = dict(model_name="fake", vllm_path=str(model), output_dir=str(tmp_path / name), limit=12) | cfg
    return evaluate(EvalConfig(**settings), engine_factory=lambda c, d: engine, check_devices=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    return {
        "ref": fake_run(tmp, "a", FakeEngine()),
        "same": fake_run(tmp, "b", FakeEngine()),
        "broken": fake_run(tmp, "c", FakeEngine(reply=" 13")),
        "fewer": fake_run(tmp, "d", FakeEngine(), limit=8),
        "arith_only": fake_run(tmp, "e", FakeEngine(), tasks=["evalkit_arith"]),
    }


def test_identical_runs_are_equivalent_and_exit_zero(runs):
    table, details = compare.compare_runs(compare.load_run(runs["ref"]), compare.load_run(runs["same"]))
    assert set(table.verdict) == {"equivalent"} and (table["diff"] == 0).all()
    assert all(not d.generations for d in details)
    assert compare.main([str(runs["ref"]), str(runs["same"])]) == 0


def test_a_broken_candidate_is_worse_with_its_flips_and_divergences(runs, capsys):
    ref, cand = compare.load_run(runs["ref"]), compare.load_run(runs["broken"])
    table, details = compare.compare_runs(ref, cand)
    arith = table[table.task == "evalkit_arith"].iloc[0]
    assert arith.verdict == "worse" and arith["diff"] == pytest.approx(-11 / 12)  # only doc 0 (14-1) is 13
    assert (arith.mcnemar_b, arith.mcnemar_c) == (11, 0) and arith.mcnemar_p == pytest.approx(2 / 2 ** 11)
    (detail,) = [d for d in details if d.task == "evalkit_arith"]
    assert detail.flips["exact_match"]["right_to_wrong"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert detail.flips["exact_match"]["wrong_to_right"] == []
    first = next(g for g in detail.generations if g["doc_id"] == 1)  # " 16" vs " 13": second token
    assert (first["token_index"], first["char_index"], first["reference"], first["candidate"]) == (2, 2, "6", "3")
    facts = table[table.task == "evalkit_facts"]
    assert set(facts.verdict) == {"equivalent"}
    assert compare.main([str(runs["ref"]), str(runs["broken"])]) == 1
    out = capsys.readouterr().out
    assert "| evalkit_arith" in out and "right -> wrong on 11" in out
    written = sorted(p.name for p in runs["broken"].iterdir() if p.name.startswith("compare-vs-"))
    assert [p.rsplit(".", 1)[1] for p in written] == ["html", "md"]
    page = (runs["broken"] / written[0]).read_text()
    assert page.count("data:image/png;base64,") == 3  # differences, log-prob drift, length shift


@pytest.mark.parametrize("other, message", [
    ("fewer", "different documents"),
    ("arith_only", "different tasks"),
])
def test_unlike_for_like_is_refused(runs, other, message, capsys):
    with pytest.raises(compare.CompareError, match=message):
        compare.compare_runs(compare.load_run(runs["ref"]), compare.load_run(runs[other]))
    assert compare.main([str(runs["ref"]), str(runs[other])]) == 2
    assert capsys.readouterr().err.startswith("evalkit.compare: error: ")


def test_a_changed_prompt_is_refused(runs, tmp_path):
    cand = compare.load_run(runs["same"])
    sample = cand.samples["evalkit_arith"][(3, "first-integer")]
    sample["prompt_hash"] = "0" * 64
    with pytest.raises(compare.CompareError, match="document 3 differs \\(prompt_hash\\)"):
        compare.compare_runs(compare.load_run(runs["ref"]), cand)


def test_not_a_run(tmp_path):
    with pytest.raises(compare.CompareError, match="not an evalkit run"):
        compare.load_run(tmp_path)


def test_noise_command_rejects_bad_input_in_one_line(capsys):
    from evalkit import noise

    assert noise.main(["max_tokenz=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("evalkit.noise: error: unknown config key 'max_tokenz' (did you mean max_tokens")
    assert err.count("\n") == 1
