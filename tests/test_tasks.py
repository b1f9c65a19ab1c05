"""Tasks are built after lm-eval's own seeds are set (evalkit/run.py, tasks.py). Run: pytest tests/test_tasks.py"""

import random
from pathlib import Path

from evalkit.config import EvalConfig, TaskSeeds
from evalkit.results import read_samples
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
    from evalkit.run import Stopwatch, prepare

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    cfg = EvalConfig(model_name="fake", vllm_path=str(tmp_path), tasks=["shuffled_facts"], tasks_dirs=[SHUFFLED])
    built = []
    for _ in range(2):
        _, _, (task,) = prepare(cfg, check_devices=False, watch=Stopwatch())
        built.append([doc["answer"] for doc in task.task_docs])
        random.random()
    assert built[0] == built[1]
