"""evalkit.engine.machine.tuning: what evalkit fills in for a machine, on fake machines (no engine). Run: pytest tests/engine/machine/test_tuning.py"""

import json

from evalkit.engine.machine.tuning import Choice, Machine, apply, choose, core_ranges, kv_bytes_per_token, thread_binding

GIB = 2**30
SMALL_CPU = Machine(device="cpu", cores=(0, 1), ram_bytes=24 * GIB)
GPU_NODE = Machine(device="cuda", cores=tuple(range(64)), ram_bytes=512 * GIB)
EMBEDDED_KV = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M in float32: 30 layers, 3 KV heads of 64


def chosen(machine=SMALL_CPU, engine_kwargs=None, env=None, tp=1, pp=1, executor=None, kv=EMBEDDED_KV, max_model_len=4096,
           sole=True):
    choices = choose(machine=machine, engine_kwargs=engine_kwargs or {}, env=env or {}, max_model_len=max_model_len,
                     tensor_parallel_size=tp, pipeline_parallel_size=pp, executor_backend=executor,
                     gpu_memory_utilization=0.9, kv_token_bytes=kv, sole_engine=sole)
    return {c.setting: c.value for c in choices}


def test_cpu_gets_eager_all_cores_and_a_sized_kv_cache():
    assert chosen() == {"engine_kwargs.enforce_eager": True, "engine_kwargs.block_size": 32,
                        "env.VLLM_CPU_OMP_THREADS_BIND": "0-1",
                        "env.VLLM_ENABLE_V1_MULTIPROCESSING": 0,
                        "engine_kwargs.kv_cache_memory_bytes": 32768 * EMBEDDED_KV}


def test_the_engine_runs_in_process_only_with_one_rank_as_the_sole_engine_of_its_process():
    assert "env.VLLM_ENABLE_V1_MULTIPROCESSING" not in chosen(sole=False)
    assert "env.VLLM_ENABLE_V1_MULTIPROCESSING" not in chosen(tp=2)
    assert "env.VLLM_ENABLE_V1_MULTIPROCESSING" not in chosen(pp=2)
    assert "env.VLLM_ENABLE_V1_MULTIPROCESSING" not in chosen(executor="mp")
    assert "env.VLLM_ENABLE_V1_MULTIPROCESSING" not in chosen(env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})


def test_gpu_gets_no_cpu_settings():
    assert chosen(GPU_NODE) == {}


def test_the_users_settings_win():
    assert "engine_kwargs.enforce_eager" not in chosen(engine_kwargs={"enforce_eager": False})
    assert "engine_kwargs.enforce_eager" not in chosen(engine_kwargs={"compilation_config": {"mode": 3}})
    assert "env.VLLM_CPU_OMP_THREADS_BIND" not in chosen(env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert "engine_kwargs.kv_cache_memory_bytes" not in chosen(env={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert "engine_kwargs.kv_cache_memory_bytes" not in chosen(engine_kwargs={"kv_cache_memory_bytes": 10**9})
    assert "engine_kwargs.block_size" not in chosen(engine_kwargs={"block_size": 128})


def test_kv_cache_follows_the_context_length_and_never_exceeds_the_share_of_ram():
    assert chosen(max_model_len=16384)["engine_kwargs.kv_cache_memory_bytes"] == 8 * 16384 * EMBEDDED_KV
    huge = 2 * 80 * 8 * 128 * 2  # a 70B model in bfloat16
    assert "engine_kwargs.kv_cache_memory_bytes" not in chosen(kv=huge, max_model_len=131072)
    assert "engine_kwargs.kv_cache_memory_bytes" not in chosen(kv=None)


def test_threads_are_split_between_tensor_parallel_ranks():
    assert thread_binding(tuple(range(8)), 2) == "0-3|4-7"
    assert thread_binding((0, 1, 2, 4, 5, 6), 1) == "0-2,4-6"
    assert thread_binding((0,), 2) is None
    assert chosen(Machine("cpu", tuple(range(16)), 64 * GIB), tp=4)["env.VLLM_CPU_OMP_THREADS_BIND"] == \
        "0-3|4-7|8-11|12-15"
    assert chosen(Machine("cpu", tuple(range(16)), 64 * GIB), tp=2, pp=2)[
        "env.VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7|8-11|12-15"
    assert core_ranges((3,)) == "3"


def test_kv_bytes_per_token_from_config(tmp_path, embedded_model_dir):
    assert kv_bytes_per_token(embedded_model_dir, "float32") == EMBEDDED_KV
    assert kv_bytes_per_token(embedded_model_dir, "bfloat16") == EMBEDDED_KV // 2
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096, "torch_dtype": "bfloat16"}))
    assert kv_bytes_per_token(str(tmp_path), "auto") == 2 * 32 * 32 * 128 * 2
    assert kv_bytes_per_token(str(tmp_path / "missing"), "auto") is None


def test_apply_splits_engine_arguments_from_environment():
    kwargs, env = apply([Choice("engine_kwargs.enforce_eager", True, ""), Choice("env.X", 3, "")], {"seed": 1})
    assert kwargs == {"seed": 1, "enforce_eager": True} and env == {"X": "3"}
    assert Choice("env.X", "0-1", "why").line() == "evalkit: chose env.X=0-1 (why)"


def test_the_environment_is_set_while_the_engine_starts_then_put_back(monkeypatch):
    from evalkit.engine.machine.tuning import environment

    monkeypatch.setenv("EVALKIT_TEST_KEPT", "mine")
    monkeypatch.delenv("EVALKIT_TEST_NEW", raising=False)
    with environment({"EVALKIT_TEST_KEPT": "chosen", "EVALKIT_TEST_NEW": "0"}):
        import os

        assert os.environ["EVALKIT_TEST_KEPT"] == "chosen" and os.environ["EVALKIT_TEST_NEW"] == "0"
    assert os.environ["EVALKIT_TEST_KEPT"] == "mine" and "EVALKIT_TEST_NEW" not in os.environ


# --- on GPUs (issue 27): what the engine needs to start ---

def h100(index, free_gib):
    from evalkit.engine.machine.gpus import Gpu

    return Gpu(index, "NVIDIA H100 80GB HBM3", f"GPU-{index}", 80 * GIB, int(free_gib * GIB))


def on_gpus(free=(79, 79), env=None, ranks=1, initialised=False, tune=True, utilization=0.9):
    from evalkit.engine.machine.tuning import gpu_choices

    machine = Machine(device="cuda", cores=(0, 1), ram_bytes=512 * GIB, gpus=tuple(h100(i, f) for i, f in enumerate(free)))
    choices = gpu_choices(machine=machine, env=env or {}, gpu_memory_utilization=utilization, ranks=ranks,
                          weights_per_gpu=15 * GIB, cuda_initialised=initialised, tune=tune)
    return {c.setting: c.value for c in choices}


def test_idle_gpus_get_nothing():
    assert on_gpus() == {}


def test_a_busy_gpu_of_the_engine_gets_a_utilization_that_fits_and_others_do_not_count():
    assert on_gpus(free=(40, 79)) == {"gpu_memory_utilization": 0.48}
    assert on_gpus(free=(79, 40)) == {}  # GPU 1 is not the engine's (one rank)
    assert on_gpus(free=(79, 40), ranks=2) == {"gpu_memory_utilization": 0.48}
    assert on_gpus(free=(40, 79), tune=False) == {}  # preflight fails the run instead, in one line


def test_vllm_spawns_after_cuda_was_initialised_unless_the_user_chose():
    assert on_gpus(initialised=True) == {"env.VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert on_gpus(initialised=True, tune=False) == {"env.VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert on_gpus(initialised=True, env={"VLLM_WORKER_MULTIPROC_METHOD": "fork"}) == {}


def test_a_chosen_utilization_is_an_engine_argument_printed_by_its_name():
    choice = Choice("gpu_memory_utilization", 0.48, "why")
    kwargs, env = apply([choice], {"seed": 1})
    assert kwargs == {"seed": 1, "gpu_memory_utilization": 0.48} and env == {}
    assert choice.line() == "evalkit: chose gpu_memory_utilization=0.48 (why)"


def test_the_cpu_build_of_vllm_on_a_gpu_machine_is_tuned_as_on_a_cpu_one(monkeypatch, tmp_path):
    """The installed vLLM build decides, not the GPUs NVML reports: vllm-cpu (installed here) computes on the
    processor, so a machine with two H100s gets CPU tuning (a KV cache sized in RAM, no utilization fitted to GPU
    memory); the CUDA build there sees its GPUs."""
    from evalkit import config
    from evalkit.config import compose_config
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.machine.tuning import choices_for, this_machine
    from tests.fake_gpus import on_fake_gpus

    on_fake_gpus(monkeypatch, tmp_path, [{"name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i}", "total": 80 * GIB,
                                          "free": 20 * GIB} for i in range(2)])
    assert config.installed_vllm_build() == "cpu"
    assert this_machine().device == "cpu" and this_machine().gpus == ()
    model_dir = resolve_model_path("embedded://smollm2-135m-instruct")
    settings = {c.setting for c in choices_for(compose_config([]), model_dir, sole_engine=True)}
    assert "engine_kwargs.kv_cache_memory_bytes" in settings and "gpu_memory_utilization" not in settings
    monkeypatch.setattr(config, "installed_vllm_build", lambda: "cuda")
    assert this_machine().device == "cuda" and len(this_machine().gpus) == 2


def test_the_command_a_chosen_line_advises_is_one_evalkit_takes():
    import re

    from evalkit.config import compose_config
    from evalkit.overrides import check_overrides

    choices = choose(machine=SMALL_CPU, engine_kwargs={}, env={}, max_model_len=4096, tensor_parallel_size=1,
                     gpu_memory_utilization=0.9, kv_token_bytes=EMBEDDED_KV, sole_engine=True)
    advised = [found.group(1).replace("=N", "=16") for c in choices if (found := re.search(r"pass (\S+)", c.why))]
    assert len(advised) == 2, [c.why for c in choices]
    check_overrides(advised)
    assert compose_config(advised).engine_kwargs == {"enforce_eager": False, "block_size": 16}
