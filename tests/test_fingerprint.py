"""What a stored answer is keyed on (evalkit/engine/fingerprint.py): outputs, never scheduling.
Run: pytest tests/test_fingerprint.py"""

import ast
import os
import shutil
from pathlib import Path

import pytest

from evalkit.engine import fingerprint as fingerprints
from evalkit.engine.fingerprint import fingerprint

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
    monkeypatch.setattr(fingerprints, "SMALL_FILE", 1024)
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    (model / "model.safetensors").write_bytes(b"a" * 4096)
    other = tmp_path / "other"
    shutil.copytree(model, other)
    (other / "model.safetensors").write_bytes(b"b" * 4096)
    stat = (model / "model.safetensors").stat()
    os.utime(other / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p leaves it
    assert fingerprint(str(model), description(model)) != fingerprint(str(other), description(other))
    reads = []
    monkeypatch.setattr(fingerprints, "file_sha256", lambda path: reads.append(path) or "digest")
    fingerprints.model_files(str(model))
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
    assert {"harness/lm.py", "engine/vllm_engine.py", "engine/logprob_reads.py", "engine/dataparallel.py"} <= builders
    assert builders - set(fingerprints.answer_code()) == set()
    assert {"engine/tuning.py", "contracts.py", "engine/hf_engine.py"} <= set(fingerprints.answer_code())


def test_a_changed_answer_module_changes_the_fingerprint(model, tmp_path, monkeypatch):
    module = tmp_path / "answers.py"  # stands for one of evalkit's modules, changed by an upgrade
    module.write_text("def read(): return 1\n")
    original = fingerprints.answer_code
    monkeypatch.setattr(fingerprints, "answer_code", lambda: [*original(), str(module)])
    before = fingerprint(str(model), description(model))
    module.write_text("def read(): return 2\n")
    assert fingerprint(str(model), description(model)) != before
