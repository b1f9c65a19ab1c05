"""lm-eval's --samples, --predict_only and --metadata as evalkit's keys (samples=, predict_only=, metadata=), each
held to what lm-eval itself does with them: the documents a run evaluates are lm-eval's selection, a predict-only
run has lm-eval's bypass metric, a task's metadata is what lm-eval's TaskManager gives it. Runs go through lm-eval
with the deterministic fake engine (what is checked here is lm-eval's side, not the engine's).

Run: pytest tests/test_lm_eval_options.py
"""

import json

import pytest

from evalkit.config import ConfigError, EvalConfig, Gate, validate
from evalkit.harness.tasks import load_tasks
from evalkit.run.evaluate import evaluate
from tests.fake_engine import FakeEngine


def fake_run(tmp_path, **cfg):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    settings = dict(model_name="fake", vllm_path=str(model), output_dir=str(tmp_path / "result")) | cfg
    return evaluate(EvalConfig(**settings), engine_factory=lambda c, d: FakeEngine(), check_devices=False)


def samples_file(run_dir, task):
    return [json.loads(line) for line in next(run_dir.glob(f"samples_{task}_*.jsonl")).read_text().splitlines()]


def test_samples_evaluates_lm_evals_selection_of_the_documents(tmp_path):
    asked = [17, 3, 40, 3]  # out of order, one twice: lm-eval asks `i in samples` of each document
    run_dir = fake_run(tmp_path, samples={"evalkit_arith": asked})
    _, tasks = load_tasks(["evalkit_arith"], task_data={}, extra_dirs=[])
    expected = [doc for _, doc in tasks[0].doc_iterator(samples=asked)]  # lm-eval's own selection
    lines = samples_file(run_dir, "evalkit_arith")
    assert [line["doc"] for line in lines] == expected and [line["doc_id"] for line in lines] == [3, 17, 40]
    assert all(line["prompt_tokens"] > 0 for line in lines)  # each request's record under its document's own index
    assert len(samples_file(run_dir, "evalkit_facts")) == 40  # a task samples does not name: every document
    results = json.loads((run_dir / "results.json").read_text())
    assert results["evalkit"]["config"]["samples"] == {"evalkit_arith": asked}
    assert results["evalkit"]["counts"]["evalkit_arith"]["requests"] == 3


def test_predict_only_answers_and_computes_no_metric(tmp_path):
    run_dir = fake_run(tmp_path, limit=4, predict_only=True)
    results = json.loads((run_dir / "results.json").read_text())
    metrics = {k.split(",")[0] for k in results["results"]["evalkit_arith"] if "," in k}
    assert metrics == {"bypass", "bypass_stderr"}, results["results"]["evalkit_arith"]
    lines = samples_file(run_dir, "evalkit_arith")
    assert len(lines) == 4 and all(line["resps"] for line in lines) and "exact_match" not in lines[0]
    assert results["evalkit"]["config"]["predict_only"] is True


def test_metadata_reaches_every_task_as_lm_evals_task_manager_gives_it(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    from evalkit.config import TASKS_DIR

    given = {"pretrained": "/weights", "max_seq_lengths": [4096]}
    _, tasks = load_tasks(["evalkit_facts"], task_data={}, extra_dirs=[], metadata=given)
    with monkeypatch.context() as here:
        here.chdir(TASKS_DIR / "evalkit_facts")  # lm-eval reads a task's relative data_files from here
        theirs = TaskManager(include_path=[str(TASKS_DIR)], include_defaults=False, metadata=given).load(
            "evalkit_facts")
    assert tasks[0].config.metadata == theirs["tasks"]["evalkit_facts"].config.metadata
    assert tasks[0].config.metadata["max_seq_lengths"] == [4096]
    run_dir = fake_run(tmp_path, limit=2, tasks=["evalkit_facts"], metadata={"max_seq_lengths": [4096]})
    config = json.loads((run_dir / "results.json").read_text())["configs"]["evalkit_facts"]
    assert config["metadata"]["max_seq_lengths"] == [4096] and config["metadata"]["pretrained"] == str(
        tmp_path / "model")  # the weights' folder, as lm-eval adds its model_args


@pytest.mark.parametrize("settings, message", [
    (dict(samples={"evalkit_arith": [1]}, limit=5), "samples= names the documents and limit= the first N"),
    (dict(samples={"evalkit_arith": [-1]}), "samples.evalkit_arith=[-1] must list document indices"),
    (dict(samples={"evalkit_arith": [1]}, gate=Gate(reference="/r")), "leave samples unset"),
    (dict(predict_only=True, log_samples=False), "predict_only keeps the answers in the samples files only"),
])
def test_lm_eval_options_that_cannot_go_together(settings, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        validate(EvalConfig(vllm_path="/w", **settings))


@pytest.mark.parametrize("samples, message", [
    ({"evalkit_arithm": [1]}, "samples.evalkit_arithm: the run evaluates no task 'evalkit_arithm' (did you mean "
                              "evalkit_arith?)"),
    ({"evalkit_arith": [2, 60]}, "samples.evalkit_arith: document 60 is past the task's 60 documents (0 to 59)"),
])
def test_samples_are_checked_against_the_tasks_before_the_engine(tmp_path, samples, message):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    with pytest.raises(ConfigError) as error:
        evaluate(EvalConfig(model_name="fake", vllm_path=str(tmp_path), output_dir=str(tmp_path / "r"),
                            samples=samples), engine_factory=lambda c, d: pytest.fail("the engine started"),
                 check_devices=False)
    assert str(error.value).startswith(message)
