"""Checks before the engine starts (evalkit/engine/preflight.py, evalkit/harness/tasks.py). Run: pytest tests/test_preflight.py"""

import json

import pytest

from evalkit.config import ConfigError, EvalConfig
from evalkit.engine.preflight import check_devices, check_model, model_context_length, resolve_model_path
from evalkit.harness.tasks import load_tasks


def model_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_missing_path_is_named():
    with pytest.raises(ConfigError, match="vllm_path=/nonexistent does not exist"):
        resolve_model_path("/nonexistent")


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model_path(str(tmp_path))


def test_hub_id_passes_through():
    assert resolve_model_path("Qwen/Qwen2-7B-Instruct") == "Qwen/Qwen2-7B-Instruct"


def test_context_length_from_config(tmp_path):
    assert model_context_length(model_dir(tmp_path, max_position_embeddings=4096)) == (4096, "max_position_embeddings")
    scaled = model_dir(tmp_path, max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 2.0})
    assert model_context_length(scaled)[0] == 8192


def test_max_model_len_above_the_model_fails(tmp_path):
    cfg = EvalConfig(model_name="m", vllm_path="x", max_model_len=8192)
    with pytest.raises(ConfigError, match=r"max_model_len=8192 exceeds what m supports \(4096"):
        check_model(cfg, model_dir(tmp_path, max_position_embeddings=4096))
    check_model(EvalConfig(model_name="m", vllm_path="x", max_model_len=4096), str(tmp_path))


def test_more_tensor_parallel_ranks_than_devices():
    with pytest.raises(ConfigError, match="tensor_parallel_size=4096 needs 4096 devices but this machine has"):
        check_devices(EvalConfig(model_name="m", vllm_path="x", tensor_parallel_size=4096))


def test_unknown_task_names_the_closest():
    with pytest.raises(ConfigError, match=r"unknown task 'evalkit_arth' \(did you mean evalkit_arith"):
        load_tasks(["evalkit_arth"], task_data={}, extra_dirs=[])


def test_task_data_points_a_task_at_local_files(tmp_path):
    rows = [{"id": 0, "question": "What is 1 + 1?", "answer": "2"}, {"id": 1, "question": "What is 3 - 1?", "answer": "2"}]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, (task,) = load_tasks(["evalkit_arith"], extra_dirs=[], task_data={
        "evalkit_arith": {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}}})
    docs = list(task.test_docs())
    assert [d["question"] for d in docs] == ["What is 1 + 1?", "What is 3 - 1?"]
    assert task.config.generation_kwargs["max_gen_toks"] == 16  # prompts and metrics stay the task's


def test_task_data_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="task_data.evalkit_arith: unknown keys"):
        load_tasks(["evalkit_arith"], extra_dirs=[], task_data={"evalkit_arith": {"path": "x"}})


def test_unreadable_task_data_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="task evalkit_arith: its data could not be loaded") as info:
        load_tasks(["evalkit_arith"], extra_dirs=[], task_data={
            "evalkit_arith": {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "no.jsonl")}}}})
    assert "\n" not in str(info.value)
