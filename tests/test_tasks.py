"""Tasks are built after lm-eval's own seeds are set (evalkit/run/evaluate.py, tasks.py); task indexes hold only what the
requested names need (evalkit/harness/task_index.py). Run: pytest tests/test_tasks.py (walks lm-eval's full index once, ~20 s)"""

import json
import logging
import random
from pathlib import Path

import pytest

from evalkit.harness import task_index
from evalkit.harness import tasks
from evalkit.config import ConfigError, EvalConfig, TaskSeeds
from evalkit.run.results import read_samples
from tests.test_compare import fake_run
from tests.fake_engine import FakeEngine

SHUFFLED = str(Path(__file__).parent / "parity_tasks")


def documents(tmp_path, name, **cfg):
    run = fake_run(tmp_path, name, FakeEngine(), tasks=["shuffled_facts"], tasks_dirs=[SHUFFLED], **cfg)
    return [(s["doc_hash"], s["target"]) for s in read_samples(run, "shuffled_facts")]


def test_a_task_that_shuffles_its_documents_gets_the_same_order_whatever_the_engine_seed(tmp_path):
    first = documents(tmp_path, "a", seed=1)
    random.random()  # whatever ran in between leaves the global state elsewhere
    assert documents(tmp_path, "b", seed=2) == first
    assert documents(tmp_path, "c", seed=1, task_seeds=TaskSeeds(random=5)) != first


def test_tasks_are_built_after_lm_evals_seeds_are_set(tmp_path):
    """process_docs runs when a task is built (before the engine starts), as in simple_evaluate: seeded."""
    from evalkit.run.evaluate import Stopwatch, prepare

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    cfg = EvalConfig(model_name="fake", vllm_path=str(tmp_path), tasks=["shuffled_facts"], tasks_dirs=[SHUFFLED])
    built = []
    for _ in range(2):
        _, _, (task,) = prepare(cfg, check_devices=False, watch=Stopwatch())
        built.append([doc["answer"] for doc in task.task_docs])
        random.random()
    assert built[0] == built[1]


# ---- the small task index (issue 11): only the folders the requested names need --------------------------

OWN = {"evalkit_arith", "evalkit_facts"}


def walked_the_full_index():
    raise AssertionError("walked lm-eval's full task index")


@pytest.fixture(scope="session")
def full_builtin():
    """lm-eval's index of its built-in tasks, built once per session (it walks ~15,000 YAMLs, ~17 s)."""
    return task_index._builtin_index()


@pytest.fixture(scope="session")
def records(full_builtin):
    return task_index.builtin_records(full_builtin, task_index._lm_eval_install()[1])


@pytest.fixture(scope="session")
def warm_dir(records, tmp_path_factory):
    folder = tmp_path_factory.mktemp("evalkit_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVALKIT_CACHE", str(folder))
        task_index.save_builtin_map(records)
    return folder


@pytest.fixture
def warm_cache(warm_dir, monkeypatch):
    """A cache holding the map; neither the map nor the full index may be rebuilt."""
    monkeypatch.setenv("EVALKIT_CACHE", str(warm_dir))
    monkeypatch.setattr(task_index, "_builtin_index", walked_the_full_index)
    monkeypatch.setattr(task_index, "task_manager", lambda extra_dirs: walked_the_full_index())
    return warm_dir


@pytest.fixture
def cold_cache(tmp_path, monkeypatch, full_builtin):
    """An empty cache; rebuilding the map reuses the session's full index, and each rebuild is counted."""
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path))
    walks = []
    monkeypatch.setattr(task_index, "_builtin_index", lambda: walks.append(1) or full_builtin)
    return walks


def map_file():
    return task_index._map_file(*task_index._lm_eval_install())


def leaves(index, name, seen=frozenset()):
    """The tasks (name, YAML) a name expands to through group and tag members."""
    entry = index.get(name)
    if entry is None or name in seen:
        return set()
    if entry.kind.name in ("TASK", "PY_TASK"):
        return {(name, str(entry.yaml_path))}
    return set().union(*(leaves(index, m, seen | {name}) for m in task_index.members(entry)))


def test_evalkit_tasks_load_without_the_map_or_the_full_index(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(task_index, "builtin_map", walked_the_full_index)
    manager, loaded = tasks.load_tasks(sorted(OWN), task_data={}, extra_dirs=[])
    assert [t.task_name for t in loaded] == sorted(OWN)
    assert set(manager.task_index) == OWN
    assert not list(tmp_path.iterdir())  # nothing cached


def test_a_builtin_task_indexes_its_own_folder(warm_cache):
    root = task_index._lm_eval_install()[1]
    manager = task_index.task_manager_for(["gsm8k"])
    assert Path(manager.task_index["gsm8k"].yaml_path).parent == root / "gsm8k"
    assert {Path(e.yaml_path).parent for e in manager.task_index.values() if e.yaml_path} <= {
        root / "gsm8k", task_index.TASKS_DIR / "evalkit_arith", task_index.TASKS_DIR / "evalkit_facts"}


@pytest.mark.parametrize("name", ["mmlu", "leaderboard", "ai2_arc", "super-glue-lm-eval-v1"])
def test_groups_and_tags_reach_the_same_tasks_as_in_the_full_index(warm_cache, full_builtin, name):
    """mmlu: a group of groups of tags; leaderboard: groups over several folders; super-glue-lm-eval-v1: a tag
    whose tasks lie in several folders."""
    small = task_index.task_manager_for([name])
    assert len(small.task_index) < len(full_builtin.task_index) / 10
    assert leaves(small.task_index, name) == leaves(full_builtin.task_index, name)
    assert len(leaves(small.task_index, name)) > 1


def test_evalkit_groups_of_builtin_tasks_get_their_folders(tmp_path, warm_cache):
    (tmp_path / "mix.yaml").write_text("group: my_mix\ntask:\n  - gsm8k\n  - task: arc_easy\n    num_fewshot: 0\n"
                                       "  - evalkit_arith\n")
    manager = task_index.task_manager_for(["my_mix"], [str(tmp_path)])
    assert {"my_mix", "gsm8k", "arc_easy", "evalkit_arith"} <= set(manager.task_index)
    assert leaves(manager.task_index, "my_mix") >= {("gsm8k", str(task_index._lm_eval_install()[1] / "gsm8k/gsm8k.yaml"))}


def test_include_order_keeps_lm_evals_precedence(tmp_path):
    """In one walk of a folder the first YAML (by path) wins; across include paths the last path wins."""
    from lm_eval.tasks import TaskManager

    for folder in ("a", "a-x", "a/b"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "dup.yaml").write_text(f"task: dup\ndataset_path: {folder}\n")
    (tmp_path / "a/b/only.yaml").write_text("task: only\ndataset_path: json\n")
    whole = TaskManager(include_path=[str(tmp_path)], include_defaults=False).task_index
    order = task_index._include_order({"a", "a-x", "a/b"}, tmp_path)
    assert order == [str(tmp_path / "a"), str(tmp_path / "a-x")]  # a/b is inside a
    small = TaskManager(include_path=order, include_defaults=False).task_index
    assert {n: e.yaml_path for n, e in small.items()} == {n: e.yaml_path for n, e in whole.items()}


def test_the_map_is_built_once_and_kept_per_lm_eval_version_and_folder(cold_cache):
    version, root = task_index._lm_eval_install()
    assert "gsm8k" in task_index.builtin_map() and len(cold_cache) == 1
    stored = json.loads(map_file().read_text())
    assert (stored["lm_eval"], stored["tasks_folder"]) == (version, str(root))
    assert task_index.builtin_map()["mmlu"]["kind"] == "GROUP" and len(cold_cache) == 1  # read from the cache
    for key, other in (("lm_eval", "0.0.1"), ("tasks_folder", "/another/venv/lm_eval/tasks")):
        map_file().write_text(json.dumps({**stored, key: other}))
        task_index.builtin_map()
    assert len(cold_cache) == 3
    assert len({task_index._map_file(version, root), task_index._map_file("0.0.1", root), task_index._map_file(version, Path("/x"))}) == 3


@pytest.mark.parametrize("damage", ["{", "truncated", '{"format": 1}', "records"])
def test_a_damaged_map_is_rebuilt(cold_cache, records, damage):
    version, root = task_index._lm_eval_install()
    good = json.dumps({"format": task_index.MAP_FORMAT, "lm_eval": version, "tasks_folder": str(root), "names": records},
                      separators=(",", ":"))
    bad = {"truncated": good[: len(good) // 2],
           "records": good.replace('"folders":["gsm8k"]', '"folders":"gsm8k"', 1)}.get(damage, damage)
    map_file().parent.mkdir(parents=True, exist_ok=True)
    map_file().write_text(bad)
    assert task_index.builtin_map()["gsm8k"]["folders"] == ["gsm8k"] and len(cold_cache) == 1
    assert json.loads(map_file().read_text())["names"] == records
    assert [p.name for p in map_file().parent.iterdir()] == [map_file().name]  # no temp file left


def test_an_unknown_name_gets_suggestions_from_the_map(warm_cache, full_builtin):
    with pytest.raises(ConfigError, match=r"unknown task 'gsm8kk' \(did you mean gsm8k") as info:
        tasks.load_tasks(["gsm8kk"], task_data={}, extra_dirs=[])
    assert f"; {len(set(full_builtin.all_tasks) | OWN)} tasks are known" in str(info.value)
    with pytest.raises(ConfigError, match=r"unknown task 'evalkit_arth' \(did you mean evalkit_arith"):
        tasks.load_tasks(["evalkit_arth"], task_data={}, extra_dirs=[])


def test_a_small_index_that_differs_falls_back_to_the_full_one(tmp_path, monkeypatch, records, caplog):
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path))
    task_index.save_builtin_map({**records, "gsm8k": {**records["gsm8k"], "folders": ["arc"]}})  # a stale map
    monkeypatch.setattr(task_index, "task_manager", lambda extra_dirs, metadata=None: "the full index")
    with caplog.at_level(logging.DEBUG, logger="evalkit.harness.task_index"):
        assert task_index.task_manager_for(["gsm8k"]) == "the full index"
    assert "gsm8k is missing" in caplog.text
