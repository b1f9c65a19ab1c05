"""What a run's tasks read, as one hash (evalkit/run/sources.py), from files alone. Run: pytest tests/test_sources.py

The sweep that skips a completed point only when this hash is unchanged: tests/test_sweep.py."""

import shutil

import pytest

from evalkit.config import TASKS_DIR
from evalkit.run.sources import task_sources


@pytest.fixture
def tasks(tmp_path):
    folder = tmp_path / "tasks" / "mine"
    folder.mkdir(parents=True)
    shutil.copy(TASKS_DIR / "evalkit_facts" / "test.jsonl", folder)
    text = (TASKS_DIR / "evalkit_facts" / "evalkit_facts.yaml").read_text().replace("evalkit_facts", "mine")
    (folder / "mine.yaml").write_text(text + "\n")
    return folder


def sources(tasks, **kwargs):
    return task_sources(names=["mine"], tasks_dirs=[str(tasks.parent)], task_data={}, **kwargs)


def test_an_edited_prompt_or_data_file_in_tasks_dirs_changes_it_and_nothing_else_does(tasks):
    before = sources(tasks)
    assert sources(tasks) == before  # computed the same way every time
    (tasks / "mine.yaml").touch()
    assert sources(tasks) == before  # content, not times
    yaml = tasks / "mine.yaml"
    yaml.write_text(yaml.read_text().replace("Question:", "Q:"))
    edited = sources(tasks)
    assert edited != before
    with open(tasks / "test.jsonl", "a") as f:
        f.write('{"id": 99, "question": "?", "choices": ["a", "b"], "answer": 0}\n')
    assert sources(tasks) not in (before, edited)


def test_a_task_data_file_changes_it(tmp_path):
    data = tmp_path / "facts.jsonl"
    shutil.copy(TASKS_DIR / "evalkit_facts" / "test.jsonl", data)
    task_data = {"evalkit_facts": {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}}}
    before = task_sources(names=["evalkit_facts"], tasks_dirs=[], task_data=task_data)
    data.write_text(data.read_text().replace("woof", "moo"))
    assert task_sources(names=["evalkit_facts"], tasks_dirs=[], task_data=task_data) != before


def test_a_hub_datasets_revision_in_the_local_cache_changes_it(tasks, tmp_path, monkeypatch):
    """A task on a hub dataset: its commit in the local hub cache is part of the hash (a re-download of another
    revision changes it); a revision the YAML pins is taken as it is."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    yaml = tasks / "mine.yaml"
    yaml.write_text(yaml.read_text().replace("dataset_path: json", "dataset_path: org/facts"))
    never_downloaded = sources(tasks)
    refs = tmp_path / "hub" / "datasets--org--facts" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    first = sources(tasks)
    (refs / "main").write_text("b" * 40)
    assert len({never_downloaded, first, sources(tasks)}) == 3


def test_a_builtin_tasks_hub_dataset_is_found_in_its_lm_eval_yaml():
    from evalkit.run.sources import builtin_configs, dataset_of

    found = {dataset_of(c) for c in builtin_configs(["arc_easy", "mmlu_anatomy"])}
    assert ("allenai/ai2_arc", None) in found and ("cais/mmlu", None) in found
