"""Crash-safe resume (evalkit/store/requests.py) on the deterministic fake engine. Run: pytest tests/store/test_store.py"""

import json
import pytest

from evalkit.contracts import GenRequest, ScoreRequest
from evalkit.run.results import read_samples
from evalkit.store.fingerprint import fingerprint
from evalkit.store.requests import RequestStore, ResumableEngine
from tests.fake_engine import FakeEngine
from tests.test_compare import fake_run


def requests(n, max_tokens=8):
    return [GenRequest(prompt_ids=tuple(map(ord, f"What is {i} + 1?")), max_tokens=max_tokens, stop=("\n",))
            for i in range(n)]


def test_answers_are_saved_chunk_by_chunk_and_reused(tmp_path):
    path = tmp_path / "store.jsonl"
    engine = FakeEngine()
    first = ResumableEngine(engine, RequestStore(path), chunk_size=3)
    answers = first.generate(requests(7))
    assert (first.computed, first.reused) == (7, 0)
    assert len(path.read_text().splitlines()) == 7 and len(engine.generated) == 7
    first.close()  # frees the store for the next run
    again = ResumableEngine(FakeEngine(reply="never asked"), RequestStore(path), chunk_size=3)
    assert again.generate(requests(7)) == answers and (again.computed, again.reused) == (0, 7)


def test_a_torn_last_line_is_ignored_and_recomputed(tmp_path):
    path = tmp_path / "store.jsonl"
    ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=2).generate(requests(4))
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])  # killed mid-write
    engine = ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=2)
    engine.generate(requests(4))
    assert (engine.reused, engine.computed) == (3, 1)


def test_an_answer_appended_after_a_torn_line_survives_the_next_reload(tmp_path):
    path = tmp_path / "store.jsonl"
    ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=2).generate(requests(4))
    text = path.read_text()
    path.write_text(text[: len(text) - 10])  # the fourth line torn by a kill mid-write
    ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=2).generate(requests(4))  # recomputes it
    again = ResumableEngine(FakeEngine(reply="never asked"), RequestStore(path), chunk_size=2)
    again.generate(requests(4))
    assert (again.reused, again.computed) == (4, 0)
    assert all(line.endswith("}") for line in path.read_text().splitlines())


def sampled(n, temperature):
    prompt = tuple(map(ord, "Tell me a story."))
    return [GenRequest(prompt_ids=prompt, max_tokens=8, sampling=(("temperature", temperature),))] * n


def test_identical_sampled_requests_keep_one_answer_each_and_greedy_ones_share(tmp_path):
    path = tmp_path / "store.jsonl"
    engine = ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=8)
    engine.generate(sampled(4, temperature=0.8))  # a task with repeats: 4
    assert engine.computed == 4 and len(path.read_text().splitlines()) == 4
    engine.generate(sampled(3, temperature=0.0))  # greedy: one answer serves all three
    assert engine.computed == 5 and len(path.read_text().splitlines()) == 5
    engine.close()
    rerun = ResumableEngine(FakeEngine(reply="never asked"), RequestStore(path), chunk_size=8)
    rerun.generate(sampled(4, temperature=0.8))
    rerun.generate(sampled(3, temperature=0.0))
    assert (rerun.reused, rerun.computed) == (7, 0)
    more = rerun.generate(sampled(1, temperature=0.8))  # a fifth draw was never made: it is computed
    assert rerun.computed == 1 and more[0].text == "never as"  # max_tokens=8


def test_a_changed_request_is_never_served_a_stale_answer(tmp_path):
    path = tmp_path / "store.jsonl"
    ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=8).generate(requests(3, max_tokens=8))
    engine = ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=8)
    engine.generate(requests(3, max_tokens=1))
    assert engine.reused == 0
    engine.score([ScoreRequest(ids=(1, 2, 3), start=1)])
    assert engine.computed == 4


def test_a_rerun_reuses_everything_and_writes_the_same_samples(tmp_path):
    first = fake_run(tmp_path, "out", FakeEngine())
    second = fake_run(tmp_path, "out", FakeEngine(reply="would differ if asked"))
    assert first != second
    resume = [json.loads((run / "results.json").read_text())["evalkit"]["resume"] for run in (first, second)]
    assert resume[0]["reused"] == 0 and resume[1]["reused"] == resume[0]["computed"] and resume[1]["computed"] == 0
    assert resume[1]["store"] == resume[0]["store"] and not resume[1]["other_settings"]
    for task in ("evalkit_arith", "evalkit_facts"):
        lines = [read_samples(run, task) for run in (first, second)]
        assert lines[0] == lines[1]


def test_provenance_hashes_match_for_like_for_like_runs(tmp_path):
    runs = [fake_run(tmp_path, name, FakeEngine()) for name in ("a", "b")]
    provenance = [json.loads((r / "results.json").read_text())["evalkit"]["provenance"] for r in runs]
    assert provenance[0] == provenance[1]
    assert provenance[0]["tasks"]["evalkit_arith"]["documents"] == 12
    other = json.loads((fake_run(tmp_path, "c", FakeEngine(), limit=5) / "results.json").read_text())
    assert other["evalkit"]["provenance"]["tasks"]["evalkit_arith"]["docs_sha256"] != \
        provenance[0]["tasks"]["evalkit_arith"]["docs_sha256"]


def test_a_hub_models_commit(tmp_path):
    from evalkit import hashing

    refs = tmp_path / "hub" / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    assert hashing.hub_revision("org/model", cache=tmp_path / "hub") == "a" * 40
    assert hashing.hub_revision("org/model", "b" * 40, cache=tmp_path / "hub") == "b" * 40  # pinned by the user
    assert hashing.hub_revision("org/other", cache=tmp_path / "hub") is None


def test_a_score_is_kept_per_scoring_path(tmp_path):
    """fast_scoring=false after a default run computes its scores anew, and each path reuses its own."""
    path, request = tmp_path / "store.jsonl", [ScoreRequest(ids=(1, 2, 3), start=1)]
    ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=8).score(request, fast=True)
    plain = ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=8)
    plain.score(request, fast=False)
    assert (plain.reused, plain.computed) == (0, 1)
    plain.close()
    again = ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=8)
    again.score(request, fast=True)
    again.score(request, fast=False)
    assert (again.reused, again.computed) == (2, 0)


def test_a_resumed_run_records_the_settings_its_reused_answers_came_from(tmp_path):
    path = tmp_path / "store.jsonl"
    first_try = {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False}
    ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=2, settings=first_try).generate(requests(3))
    second_try = {**first_try, "gpu_memory_utilization": 0.8}
    engine = ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=2, settings=second_try)
    engine.generate(requests(5))
    record = engine.record()
    assert record["reused_from"] == [{"settings": first_try, "answers": 3}] and record["other_settings"]
    engine.close()
    again = ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=2, settings=second_try)
    again.generate(requests(5)[3:])
    assert again.record()["reused_from"] == [{"settings": second_try, "answers": 2}]
    assert not again.record()["other_settings"]


HOLDER = """
import sys, time
from evalkit.store.requests import RequestStore
store = RequestStore(sys.argv[1])
store.add([("held", {"text": "kept"})])
print("held", flush=True)
sys.stdin.readline()  # the test says when: then one more answer, and the store is closed
store.add([("later", {"text": "kept too"})])
store.close()
"""


def test_two_runs_that_share_a_store_cannot_both_hold_it(tmp_path):
    """A run holds its store from open to close: a second run on the same store (another name of the same model
    or tokenizer takes another run lock) is refused in one line while the first appends, waits for it with a
    wait, and never cuts a line the first wrote."""
    import subprocess
    import sys

    from evalkit.store.requests import StoreHeld

    path = tmp_path / ".requests" / "store.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreHeld, match=f"another evalkit run is writing the request store {path}"):
            RequestStore(path)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        waited = RequestStore(path, wait=60)  # freed when the holder closes it
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
    assert set(waited.answers) == {"held", "later"}  # nothing the holder appended was cut
    waited.close()
    RequestStore(path).close()  # closed: free again


class Refusing(FakeEngine):
    """Answers nothing: a rerun must take every answer from the store."""

    def score(self, requests, progress=None, *, fast=True, top_k=0):
        raise AssertionError(f"{len(requests)} scores asked of the engine")

    def generate(self, requests, progress=None, *, top_k=0):
        raise AssertionError(f"{len(requests)} generations asked of the engine")


def test_answers_asked_with_a_trace_keep_it_and_a_rerun_gives_it_back(tmp_path):
    """divergence_top_k > 0: a score or greedy generation answered without a trace is not reused for one asked
    with it, the trace is kept in the store (as a trace answer is: load_trace's shape) and a rerun gives it back;
    answers asked without one keep the keys stores had before (a sampled draw carries no trace: one key)."""
    from dataclasses import asdict

    from evalkit.hashing import sha256
    from evalkit.store.requests import load_trace

    path = tmp_path / "store.jsonl"
    scores = [ScoreRequest(ids=(1, 97, 98), start=1), ScoreRequest(ids=(1, 97, 99, 101), start=2),
              ScoreRequest(ids=(1, 97), start=2)]  # the last: nothing scored, no position to trace
    greedy, draws = sampled(2, temperature=0.0)[:1], sampled(2, temperature=0.8)
    engine = FakeEngine(traces_in_pass=True)
    first = ResumableEngine(engine, RequestStore(path), chunk_size=2)
    plain = first.score(scores), first.generate([*greedy, *draws])
    assert all(a.trace is None for answers in plain for a in answers)
    traced = first.score(scores, top_k=3), first.generate(greedy, top_k=3)
    assert (first.computed, first.reused) == (3 + 3 + 3 + 1, 0)  # nothing answered without a trace was reused
    assert [a.trace for a in traced[0]] == [*engine.trace(scores[:2], 3), None]
    assert traced[1][0].trace == engine._steps(traced[1][0].token_ids, 3) and traced[1][0].trace is not None
    assert [(a.logprob, a.is_greedy) for a in traced[0]] == [(a.logprob, a.is_greedy) for a in plain[0]]
    first.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    # the keys of answers asked without a trace are those a store had before
    assert {sha256({"kind": "ScoreRequest", **asdict(r), "fast": True}) for r in scores} <= {e["key"] for e in lines}
    assert load_trace(lines[-4]["answer"]["trace"]) == traced[0][0].trace  # the first traced score
    again = ResumableEngine(Refusing(), RequestStore(path), chunk_size=2)
    generated = again.generate([*greedy, *draws], top_k=3)  # the draws of this run: those stored without k
    assert (again.score(scores, top_k=3), generated) == (traced[0], [*traced[1], *plain[1][1:]])
    assert (again.score(scores), again.generate(greedy)) == (plain[0], plain[1][:1])
    assert (again.computed, again.reused) == (0, 3 + 3 + 3 + 1)
    with pytest.raises(AssertionError, match="scores asked of the engine"):
        again.score(scores, top_k=4)  # another k is another answer


def test_ids_reads_are_kept_and_a_rerun_replays_them_without_the_engine(tmp_path):
    """Engine.read_ids through the store: each read keyed by its context and ids (in the order asked), its
    answer kept as the engine gave it (-inf included), counted apart from the answers; a second store over the
    same file replays every read without asking its engine."""
    from evalkit.contracts import IdsRead

    class WithMinusInf(FakeEngine):
        def read_ids(self, reads):
            return [tuple(-float("inf") if t == 0 else v for t, v in zip(r.ids, values))
                    for r, values in zip(reads, super().read_ids(reads))]

    path = tmp_path / "store.jsonl"
    reads = [IdsRead(context=(1, 97), ids=(98, 0, 99)), IdsRead(context=(1, 97), ids=(99, 98)),
             IdsRead(context=(1,), ids=()), IdsRead(context=(1, 97), ids=(98, 0, 99))]  # the last: the first again
    engine = WithMinusInf()
    first = ResumableEngine(engine, RequestStore(path), chunk_size=2)
    answers = first.read_ids(reads)
    assert answers == engine.read_ids(reads) and answers[0][1] == -float("inf") and answers[2] == ()
    assert len(engine.id_reads) == 3 + 4 and +first.id_reads == {"computed": 3, "reused": 1}
    assert (first.computed, first.reused) == (0, 0) and first.record()["id_reads"] == {"reused": 1, "computed": 3}
    first.close()
    fresh = FakeEngine()
    again = ResumableEngine(fresh, RequestStore(path), chunk_size=2)
    assert again.read_ids(reads) == answers and fresh.id_reads == []
    assert again.record()["id_reads"] == {"reused": 4, "computed": 0}
    assert again.read_ids([IdsRead(context=(1, 97), ids=(99, 98, 0))]) == fresh.read_ids(
        [IdsRead(context=(1, 97), ids=(99, 98, 0))]) and len(fresh.id_reads) == 2  # another order: another read


@pytest.mark.parametrize("planted", ["link", "linked folder", "fifo", "another user's file", "hard link"])
def test_a_store_file_planted_by_another_user_is_refused_and_nothing_is_written(tmp_path, planted):
    """The store's path (.requests/<fingerprint>.jsonl) is one anyone can compute. What another user plants there
    is refused in one line before anything is read or written: a link (it would truncate and append to the file it
    points at), its folder as a link, a FIFO (opening it would hang), a file of theirs (its lines would be
    resumed as this run's answers), a hard link to a file of the user's."""
    import os
    import shutil

    from evalkit.untrusted import PlantedFile

    victim = tmp_path / "victim.jsonl"
    victim.write_text('{"key": "k", "answer": {}, "by": null}\ntorn')
    folder = tmp_path / ".requests"
    folder.mkdir()
    path = folder / "f.jsonl"
    if planted == "link":
        path.symlink_to(victim)
    elif planted == "linked folder":
        folder.rmdir()
        (tmp_path / "elsewhere").mkdir()
        folder.symlink_to(tmp_path / "elsewhere")
    elif planted == "fifo":
        os.mkfifo(path)
    elif planted == "hard link":
        os.link(victim, path)
    else:
        shutil.copy(victim, path)
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 65534, 65534)
    what = {"link": "is a link", "linked folder": "is a link", "fifo": "is not a regular file",
            "another user's file": "belongs to another user", "hard link": r"has another name \(a hard link\)"}
    with pytest.raises(PlantedFile, match=rf"^{folder if planted == 'linked folder' else path} {what[planted]}: "
                                          "evalkit writes nothing through it"):
        RequestStore(path)
    assert victim.read_text() == '{"key": "k", "answer": {}, "by": null}\ntorn'
    assert not (tmp_path / "elsewhere").exists() or not any((tmp_path / "elsewhere").iterdir())


class Calls(FakeEngine):
    """The fake engine, counting the requests of each call."""

    def __init__(self):
        super().__init__()
        self.sizes = {"generate": [], "score": []}

    def generate(self, requests, progress=None, *, top_k=0):
        self.sizes["generate"].append(len(requests))
        return super().generate(requests, progress, top_k=top_k)

    def score(self, requests, progress=None, *, fast=True, top_k=0):
        self.sizes["score"].append(len(requests))
        return super().score(requests, progress, fast=fast, top_k=top_k)


def test_generations_go_to_the_engine_in_chunks_that_keep_it_full(tmp_path):
    """A generate call ends with its slowest answer: chunks of chunk_size=4 to an engine that runs 8 sequences at
    once (vLLM's max_num_seqs, as it resolved it: 1,024 on an H100 against evalkit's 256) would leave half of it
    idle from the start; chunks of FILL x 8 keep it full but for each call's tail. Scores keep chunk_size. A
    chunk_size the user chose is kept: it bounds what a stop loses."""
    from evalkit.store.requests import DEFAULT_CHUNK, FILL, generation_chunk

    engine = Calls()
    description = {**engine.describe(), "scheduling": {"max_num_seqs": 128}}
    assert generation_chunk(DEFAULT_CHUNK, description) == FILL * 128 == 512
    assert generation_chunk(DEFAULT_CHUNK, {**description, "data_parallel": {"size": 2}}) == 1024  # every engine
    assert generation_chunk(DEFAULT_CHUNK, engine.describe()) == DEFAULT_CHUNK  # an engine that does not say
    assert generation_chunk(DEFAULT_CHUNK, {**description, "scheduling": {"max_num_seqs": 8}}) == DEFAULT_CHUNK
    assert generation_chunk(4, description) == 4  # chosen
    chunk = FILL * 8
    store = ResumableEngine(engine, RequestStore(tmp_path / "store.jsonl"), chunk_size=4, generate_chunk=chunk)
    store.generate(requests(70))
    store.score([ScoreRequest(ids=(1, 2, 3, 4), start=2) for _ in range(1)] +
                [ScoreRequest(ids=(1, 2, 3, i), start=3) for i in range(5, 14)])
    assert engine.sizes == {"generate": [32, 32, 6], "score": [4, 4, 2]}
