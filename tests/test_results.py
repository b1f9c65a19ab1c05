"""A whole run on the fake engine through lm-eval, and the files it writes (evalkit/run/evaluate.py, evalkit/run/results.py).

The fake engine answers arithmetic correctly, so the scores are known. Run: pytest tests/test_results.py
"""

import json
import re

import pandas as pd
import pytest
import yaml

from evalkit.run import results
from evalkit.config import EvalConfig
from evalkit.run.results import read_samples
from evalkit.run.evaluate import evaluate
from tests.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("result")
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    cfg = EvalConfig(model_name="fake-model", vllm_path=str(model), max_model_len=1024, output_dir=str(out),
                     limit=10)
    engines = []

    def factory(cfg, model_dir):
        engines.append(FakeEngine(max_model_len=cfg.max_model_len))
        return engines[-1]

    path = evaluate(cfg, engine_factory=factory, check_devices=False)
    assert engines[0].closed
    return path


def test_run_folder_holds_every_file(run_dir):
    assert run_dir.parent.name == "fake-model"
    names = {p.name for p in run_dir.iterdir()}
    stamp = json.loads((run_dir / "results.json").read_text())["evalkit"]["files"]["results"][len("results_"):-5]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d\.\d+", stamp)  # lm-eval's date_id
    assert names == {"results.json", f"results_{stamp}.json", f"samples_evalkit_arith_{stamp}.jsonl",
                     f"samples_evalkit_facts_{stamp}.jsonl", f"samples_evalkit_arith_{stamp}.index.msgpack",
                     f"samples_evalkit_facts_{stamp}.index.msgpack", "config.yaml", "summary.csv", "summary.md",
                     f"divergence_evalkit_arith_{stamp}.npz", f"divergence_evalkit_facts_{stamp}.npz"}
    assert (run_dir / f"results_{stamp}.json").resolve() == (run_dir / "results.json").resolve()
    assert not [p for p in run_dir.parent.iterdir() if p.name.startswith(".tmp")]


def test_results_json_has_lm_evals_schema_and_evalkits(run_dir):
    data = json.loads((run_dir / "results.json").read_text())
    for key in ("results", "configs", "versions", "n-shot", "n-samples", "higher_is_better", "evalkit"):
        assert key in data
    assert data["results"]["evalkit_arith"]["exact_match,first-integer"] == 1.0  # the fake answers right
    ek = data["evalkit"]
    assert ek["model_name"] == "fake-model" and ek["config"]["max_model_len"] == 1024
    assert ek["engine"]["engine_args"]["model"] == "fake"
    assert set(ek["timings"]) >= {"load_tasks", "prepare_model", "engine_start", "evaluate", "total"}
    arith = ek["counts"]["evalkit_arith"]
    assert arith["requests"] == 10 and arith["finish_length"] == 0 and arith["clamped"] == 0
    assert ek["counts"]["evalkit_facts"]["requests"] == 40  # 10 documents x 4 choices


def test_samples_carry_prompt_raw_output_metrics_and_tokens(run_dir):
    lines = read_samples(run_dir, "evalkit_arith")
    assert len(lines) == 10
    first = lines[0]
    assert first["prompt"].endswith("Question: What is 14 - 1?\nAnswer:")
    assert first["raw_output"] == " 13" and first["filtered_output"] == "13" and first["target"] == "13"
    assert first["scores"] == {"exact_match": 1.0} and first["finish_reason"] == "stop"
    assert first["prompt_tokens"] == len(first["prompt"]) and first["output_tokens"] == 3
    facts = read_samples(run_dir, "evalkit_facts")[0]
    assert len(facts["requests"]) == 4 and facts["raw_output"] is None


def test_summary_table_and_config(run_dir):
    frame = pd.read_csv(run_dir / "summary.csv")
    assert list(frame.columns) == results.SUMMARY_COLUMNS
    assert set(frame.task) == {"evalkit_arith", "evalkit_facts"}
    assert set(frame.metric) == {"exact_match", "acc", "acc_norm"}
    assert "| evalkit_arith" in (run_dir / "summary.md").read_text()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model_name"] == "fake-model"


def test_runs_never_overwrite_each_other(tmp_path):
    args = dict(output_dir=str(tmp_path), model_name="m", results={"results": {}}, records={},
                config_yaml="a: 1\n", evalkit={"counts": {}})
    first = results.write_run(run_id="same", **args)
    second = results.write_run(run_id="same", **args)
    assert (first.name, second.name) == ("same", "same-1")


def test_a_failed_write_leaves_nothing(tmp_path):
    bad = {"results": {}, "samples": {"t": [{"no_doc_id": 1}]}}
    with pytest.raises(KeyError):
        results.write_run(output_dir=str(tmp_path), model_name="m", run_id="x", results=bad, records={},
                          config_yaml="", evalkit={"counts": {}})
    assert list((tmp_path / "m").iterdir()) == []
