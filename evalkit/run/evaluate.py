"""One evaluation run, stage by stage: check -> load tasks -> start the engine -> lm-eval -> write results.

Everything that can fail on bad input (config values, task names, task data, the model's path and
length, the devices) is checked before the engine starts, because starting it takes minutes.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from evalkit.engine.machine import preflight
from evalkit.run import before_engine, gate, reference, results
from evalkit.run.progress import Progress
from evalkit.run.sources import task_sources
from evalkit.store import replay
from evalkit.store.fingerprint import fingerprint as model_fingerprint
from evalkit.store.requests import RequestStore, ResumableEngine, generation_chunk
from evalkit.engine.factory import start_engines
from evalkit.engine.tokenizer import load_tokenizer
from evalkit.engine.wrapper import Deferred
from evalkit.versions import check as check_versions
from evalkit.config import ConfigError, EvalConfig, TaskSeeds, memory_settings, validate
from evalkit.contracts import Engine
from evalkit.untrusted import scrubbed
from evalkit.harness import lm_eval_compat
from evalkit.harness.lm import EvalkitLM
from evalkit.harness.tasks import load_tasks, scoring_tasks

log = logging.getLogger("evalkit")
EngineFactory = Callable[[EvalConfig, str], Engine]


class EngineStartError(RuntimeError):
    """vLLM could not start with these settings (memory, an unsupported model, a driver)."""


class Stopwatch:
    """Seconds per stage, in the order the stages ran."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._clock = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = round(now - self._clock, 3)
        self._clock = now


def prepare(cfg: EvalConfig, *, check_devices: bool, watch: Stopwatch) -> tuple[str, Any, list[Any]]:
    """Every check that needs no engine, then the model folder and the loaded tasks."""
    validate(cfg)
    if check_devices:
        preflight.check_devices(cfg)
    model_dir = preflight.resolve_model_path(cfg.vllm_path)
    preflight.check_model(cfg, model_dir)
    watch.lap("prepare_model")
    seed_as_lm_eval(cfg.task_seeds)  # simple_evaluate seeds before it builds tasks: process_docs may shuffle
    manager, tasks = load_tasks(list(cfg.tasks), task_data=dict(cfg.task_data), extra_dirs=list(cfg.tasks_dirs),
                                confirm_run_unsafe_code=cfg.confirm_run_unsafe_code,
                                metadata=before_engine.task_metadata(cfg, model_dir))
    watch.lap("load_tasks")
    leaves = {}
    # the leaves the checks read: a group's tasks built as simple_evaluate builds them, seeded first
    if cfg.samples or before_engine.lengths_checked(cfg):
        seed_as_lm_eval(cfg.task_seeds)
        leaves = manager.load(list(tasks))["tasks"]
    before_engine.check_samples(cfg.samples, leaves)
    before_engine.check_lengths(cfg, model_dir, leaves)
    watch.lap("check_lengths")
    return model_dir, manager, tasks


def seed_as_lm_eval(seeds: TaskSeeds) -> None:
    import numpy as np
    from lm_eval.utils import set_torch_seed

    random.seed(seeds.random)
    np.random.seed(seeds.numpy)
    set_torch_seed(seeds.torch)


def score_with_lm_eval(cfg: EvalConfig, lm: EvalkitLM, manager: Any, tasks: list[Any],
                       samples: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """lm-eval's simple_evaluate on the built tasks (those documents of each where samples names them), plus the
    fields its EvaluationTracker adds to results."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker

    template = before_engine.chat_template(cfg, lm)
    tracker = GeneralConfigTracker()
    tracker.log_experiment_args(
        model_source="evalkit", model_args={"pretrained": cfg.model_name},
        system_instruction=cfg.system_instruction, fewshot_as_multiturn=cfg.fewshot_as_multiturn,
        chat_template=template)
    with lm_eval_compat.env_info_ahead():
        outcome = simple_evaluate(
            model=lm, tasks=tasks, task_manager=manager, num_fewshot=cfg.num_fewshot,
            limit=before_engine.lm_eval_limit(cfg.limit) if samples is None else None, samples=samples,
            log_samples=cfg.log_samples, apply_chat_template=cfg.apply_chat_template,
            system_instruction=cfg.system_instruction, fewshot_as_multiturn=cfg.fewshot_as_multiturn,
            random_seed=cfg.task_seeds.random, numpy_random_seed=cfg.task_seeds.numpy,
            torch_random_seed=cfg.task_seeds.torch, fewshot_random_seed=cfg.task_seeds.fewshot,
            bootstrap_iters=1000, confirm_run_unsafe_code=cfg.confirm_run_unsafe_code, predict_only=cfg.predict_only,
        )
    tracker.log_end_time()
    outcome.update(asdict(tracker))
    return outcome


def refuse_unanswerable(description: dict[str, Any], tasks: list[Any]) -> None:
    """Log-likelihood tasks on a served engine whose server cannot score (its echo failed the probe): refused
    before any request is sent or stored."""
    why, needs = description.get("cannot_score"), scoring_tasks(tasks)
    if why and needs:
        raise ConfigError(f"{', '.join(needs)} need log-likelihoods, and {why}")


def recording_top_k(cfg: EvalConfig, description: dict[str, Any]) -> tuple[int, str | None]:
    """The k the run's divergence record is traced at, and why nothing is recorded where it is 0: a served
    engine whose server cannot score (its echo failed the probe) cannot trace either."""
    if not cfg.divergence_top_k:
        return 0, "divergence_top_k=0"
    if description.get("cannot_score"):
        print(f"evalkit: no divergence record: {description['cannot_score']}", file=sys.stderr)
        return 0, str(description["cannot_score"])
    return cfg.divergence_top_k, None


def prompting(cfg: EvalConfig, lm: EvalkitLM) -> results.Prompting:
    """How prompts were built, with what the tokenizer did by default, for the results file."""
    bos, eos = lm.prefix_token_id, lm.eot_token_id
    return {"add_bos_token": cfg.add_bos_token, "adds_bos": lm.tok_encode("a")[:1] == [bos],
            "bos_token": [lm.engine.decode([bos]), bos], "eos_token": [lm.engine.decode([eos]), eos],
            "apply_chat_template": cfg.apply_chat_template, "system_instruction": cfg.system_instruction,
            "fewshot_as_multiturn": cfg.fewshot_as_multiturn, "task_seeds": asdict(cfg.task_seeds),
            "temperature_override": cfg.temperature, "sampling_kwargs": dict(cfg.sampling_kwargs)}


def started(cfg: EvalConfig, model_dir: str, engine_factory: EngineFactory) -> Engine:
    """engine_factory's engine for cfg; EngineStartError in one line where it does not start."""
    try:
        return engine_factory(cfg, model_dir)
    except ConfigError:
        raise
    except Exception as error:
        raise EngineStartError(f"the {cfg.engine} engine did not start ({type(error).__name__}: {error}); "
                               "its own log above names the cause") from error


def deferred(cfg: EvalConfig, model_dir: str) -> Deferred | None:
    """A run's own vLLM engine (the default engine_factory) as one started only when an answer is missing from
    the request store, where an earlier run of this very config left its store here (evalkit.store.replay);
    None where there is none, or the run keeps no store (resume=false)."""
    if not cfg.resume or cfg.engine != "vllm":
        return None
    stored = replay.stored_engine(cfg.output_dir, cfg.model_name, asdict(cfg), model_dir)
    if stored is None:
        return None
    tokenizer = load_tokenizer(cfg.tokenizer or model_dir, trust_remote_code=cfg.trust_remote_code,
                               add_bos_token=cfg.add_bos_token, with_vllm=False)
    return Deferred(lambda: started(cfg, model_dir, start_engines), description=stored[0], tokenizer=tokenizer,
                    max_model_len=cfg.max_model_len, trust_remote_code=cfg.trust_remote_code)


def evaluate(cfg: EvalConfig, *, engine_factory: EngineFactory = start_engines, check_devices: bool = True,
             attempts: list[dict[str, Any]] | None = None, started_at: float | None = None) -> Path:
    """Run cfg end to end and return the run folder. Raises ConfigError on bad input, before the engine starts.

    attempts: earlier tries of this run that failed for lack of memory (supervise.py), for the record.
    started_at: when ``python -m evalkit`` started (time.time()), for the startup figure of the timings."""
    startup = round(time.time() - started_at, 3) if started_at is not None else None
    watch = Stopwatch()
    untested_versions = check_versions()  # one line where vLLM or lm-eval is not a tested version
    model_dir, manager, tasks = prepare(cfg, check_devices=check_devices, watch=watch)
    sources = task_sources(names=list(cfg.tasks), tasks_dirs=list(cfg.tasks_dirs), task_data=dict(cfg.task_data))
    run_id = results.new_run_id()
    against = reference.load(cfg.divergence_reference) if cfg.divergence_reference else None
    planned = gate.plan(cfg, tasks) if cfg.gate.reference else None
    engine = (deferred(cfg, model_dir) if engine_factory is start_engines else None) or \
        started(cfg, model_dir, engine_factory)
    watch.lap("engine_start")
    try:
        description = engine.describe()
        refuse_unanswerable(description, tasks)
        top_k, unrecorded = recording_top_k(cfg, description)
        fingerprint = model_fingerprint(model_dir, description)
        if cfg.resume:
            answers = RequestStore(Path(cfg.output_dir) / cfg.model_name / ".requests" / f"{fingerprint}.jsonl")
            engine = ResumableEngine(engine, answers, cfg.chunk_size, settings=memory_settings(cfg),
                                     generate_chunk=generation_chunk(cfg.chunk_size, description))
        def new_lm() -> EvalkitLM:
            return before_engine.harness_lm(cfg, engine, order_seed=cfg.order_seed, fast_scoring=cfg.fast_scoring,
                                            seed=cfg.seed, progress=Progress, divergence_top_k=top_k,
                                            reference=against.ids if against is not None and top_k else None)

        def look(samples: dict[str, list[int]] | None) -> tuple[EvalkitLM, dict[str, Any]]:
            """lm-eval on those documents of the tasks samples names (every document of every task: None)."""
            fresh = new_lm()  # one per look: its records are the documents of this look, each once
            named = tasks if samples is None else [t for t in tasks if t.config.task in samples]
            return fresh, score_with_lm_eval(cfg, fresh, manager, named, samples=samples)

        scoring_before = engine.scoring_counts()  # a lent engine counts earlier runs too
        if planned is None:
            lm, gated, selected = new_lm(), None, before_engine.selected_documents(cfg.samples)
            outcome = score_with_lm_eval(cfg, lm, manager, tasks, samples=selected)
            if selected is not None:
                lm.records = gate.renumbered(lm.records, selected)
        else:
            lm, outcome, gated = gate.run(cfg, planned, look)
        scoring = Counter(engine.scoring_counts())
        scoring.subtract(scoring_before)
        description = engine.describe()  # a deferred engine's own, where a missing answer started it
        watch.lap("evaluate")
    finally:
        engine.close()
    watch.lap("close")

    timings = {**({"startup": startup} if startup is not None else {}), **watch.laps,
               "total": round(sum(watch.laps.values()), 3), "engine_start_stages": description.get("start_seconds"),
               "engine_calls": dict(lm.engine_seconds)}
    recorded = scrubbed(asdict(cfg))  # no user:password of a URL in what is written
    section: results.EvalkitSection = {
        "run_id": run_id, "model_name": cfg.model_name, "config": recorded,
        "engine": {**description, "model_dir": model_dir}, "prompting": prompting(cfg, lm), "timings": timings,
        "untested_versions": untested_versions,
        "counts": results.count_records(lm.records),
        "sampling": lm.effective_sampling(),
        "scoring": {"fast_scoring": cfg.fast_scoring, "model_runner": description.get("model_runner"),
                    **{k: v for k, v in sorted(scoring.items()) if v}},
        "provenance": {**results.provenance(outcome, config=recorded, model_fingerprint=fingerprint),
                       "task_sources": sources},  # what the tasks read (evalkit/run/sources.py)
        "attempts": [*(attempts or []), {"settings": memory_settings(cfg), "status": "ok", "error": None,
                                          "seconds": timings["total"]}],
        "resume": engine.record() if cfg.resume else None,
        **({"gate": gated} if gated is not None else {}),
    }
    divergence = lm.traces.summary() if top_k else {"top_k": 0, "recorded": f"nothing: {unrecorded}"}
    if against is not None and top_k:
        divergence["reference"] = {**against.describe(), **divergence.get("reference", {})}
    run_dir = results.write_run(output_dir=cfg.output_dir, model_name=cfg.model_name, run_id=run_id,
                                results=outcome, records=lm.records,
                                config_yaml=OmegaConf.to_yaml(OmegaConf.create(recorded)), evalkit=section,
                                divergence=divergence)
    if description.get("server_log") and Path(description["server_log"]).is_file():  # endpoint.serve=true
        results.attach_log(run_dir, Path(description["server_log"]), "server.log")
    return run_dir
