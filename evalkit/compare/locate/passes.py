"""``python -m evalkit.compare REF CAND --locate``: every document whose answer changed, explained at the token
where it changed (the analysis is evalkit/compare/locate/why.py; this module runs the engines for it).

Each run's engine is started again from the settings its results.json records that decide its numbers
(``evalkit.config``, the model folder from ``evalkit.engine.model_dir`` where it is a folder of this machine;
never a recorded endpoint, secret name, remote code, hub id or extra engine argument: those are printed for the
user to pass), or with ``--ref-engine``/``--cand-engine key=value ...`` laid
over it (evalkit/compare/locate/engines.py sets them up, checks and starts them). One engine lives at a
time: the reference's (once for every candidate), then each candidate's (an engine whose settings equal
the reference's is not started twice). Each rebuilds the prompts of the
differing generations from the recorded prompt text as the harness encodes it (evalkit/harness/lm.py),
checked against the recorded ``prompt_tokens``, and teacher-forces both runs' outputs after them with
``Engine.trace``: two prefills per document, all in one batch. Log-likelihood documents need no engine.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from evalkit.compare.locate import why
from evalkit.compare.locate.engines import FLAGS, EngineChoice, LocateError, advice, engine_choice, start, trace
from evalkit.compare.runs import Run, check_like_for_like, load_run
from evalkit.contracts import TokenTrace

TOP_K = 5  # alternatives shown on each side at the divergent token
PROMPT_TAIL = 120  # characters of the prompt shown before each flip


def prompt_ids(lm: Any, sample: dict[str, Any]) -> tuple[int, ...]:
    """The prompt ids the harness sent, rebuilt from the recorded text with its own encoding rule (BOS,
    add_bos_token) less the tokens truncated on the left; ValueError when the count is not the recorded one."""
    record = why.generation_record(sample)
    ids = lm.tok_encode(sample.get("prompt") or "")[record.get("truncated_tokens") or 0:]
    if len(ids) != record.get("prompt_tokens"):
        raise ValueError(f"the prompt rebuilt from its text has {len(ids)} tokens, the run sent "
                         f"{record.get('prompt_tokens')}")
    return tuple(ids)


@dataclass
class Pass:
    """What one engine gave: per job its prompt ids and (reference, candidate) traces, or why not."""

    prompts: dict[why.Differing, tuple[int, ...]]
    traces: dict[why.Differing, tuple[TokenTrace, TokenTrace]]
    problems: dict[why.Differing, str]
    text: dict[int, str]  # decoded tokens at the divergences
    shared: dict[why.Differing, str]  # decoded output before the divergence
    seconds: dict[str, float]


def engine_pass(choice: EngineChoice, jobs: list[why.Differing], *, top_k: int) -> Pass:
    """Start choice's engine, rebuild every job's prompt, trace both outputs of all jobs in one call, close."""
    from evalkit.harness.lm import EvalkitLM

    clock = time.perf_counter()
    engine = start(choice)
    started = time.perf_counter()
    try:
        lm = EvalkitLM(engine, model_name=choice.cfg.model_name, max_tokens=choice.cfg.max_tokens,
                       add_bos_token=choice.cfg.add_bos_token)
        prompts, problems = {}, {}
        for job in jobs:
            try:
                prompts[job] = prompt_ids(lm, job.ref if choice.side == "reference" else job.cand)
            except ValueError as error:
                problems[job] = f"{choice.side} engine: {error}"
        ready = [job for job in jobs if job in prompts]
        seqs = {job: job.sequences(prompts[job]) for job in ready}
        flat = trace(choice, engine, [r for job in ready for r in seqs[job].requests()], top_k) if ready else []
        traces = {job: (flat[2 * i], flat[2 * i + 1]) for i, job in enumerate(ready)}
        text: dict[int, str] = {}
        shared = {}
        for job, seq in seqs.items():
            at = why.divergence(seq.reference, seq.candidate) or 0
            top = why.side(seq, at, traces[job]).top
            ids = {*seq.reference[at:at + 1], *seq.candidate[at:at + 1], *(t for t, _ in top)}
            text.update({t: engine.decode([t]) for t in ids - text.keys()})
            shared[job] = engine.decode(list(seq.reference[:at]))
    finally:
        engine.close()
    return Pass(prompts=prompts, traces=traces, problems=problems, text=text, shared=shared,
                seconds={f"{choice.side} engine start": round(started - clock, 2),
                         f"{choice.side} traces": round(time.perf_counter() - started, 2)})


def explain_jobs(jobs: list[why.Differing], ref_pass: Pass, cand_pass: Pass, *, near_tie: float,
                 floor: float) -> tuple[list[why.Flip], list[str]]:
    flips, skipped = [], []
    for job in jobs:
        problem = ref_pass.problems.get(job) or cand_pass.problems.get(job)
        if not problem and ref_pass.prompts[job] != cand_pass.prompts[job]:
            problem = "the two engines' tokenizers encode the prompt differently"
        if problem:
            skipped.append(f"{job.task} doc {job.doc_id}: {problem}")
            continue
        flip = why.explain(job.task, job.doc_id, job.sequences(ref_pass.prompts[job]), ref_engine=ref_pass.traces[job],
                           cand_engine=cand_pass.traces[job], near_tie=near_tie, floor=floor,
                           prompt_tail=(job.ref.get("prompt") or "")[-PROMPT_TAIL:])
        if flip is not None:
            text = {**cand_pass.text, **ref_pass.text}
            flips.append(replace(flip, shared_output=ref_pass.shared[job], text={
                t: text[t] for t in flip.token_ids() if t in text}))
    return flips, skipped


def locate(reference: Run | str | Path, candidates: Sequence[Run | str | Path], *, ref_overrides: Sequence[str] = (),
           cand_overrides: Sequence[str] = (), near_tie: float = why.NEAR_TIE, floor: float | None = why.NOISE_FLOOR,
           floor_source: str = "default", top_k: int = TOP_K, name: str = "evalkit compare") -> list[why.Localisation]:
    """Every changed document of each candidate against the reference, located and classified (why.py).
    Engines start only where generations differ, every one checked before the first starts; a LocateError
    says what to pass (floor None: no floor known for these runs, an error once something must be classified).
    name: the command as typed, which starts each line said on stderr."""
    reference = reference if isinstance(reference, Run) else load_run(reference)
    candidates = [c if isinstance(c, Run) else load_run(c) for c in candidates]
    for candidate in candidates:
        check_like_for_like(reference, candidate)
    found = [why.differing(reference.samples, c.samples) for c in candidates]
    everything = [job for jobs, _ in found for job in jobs]  # no differing generation: no engine needed
    ref_choice = engine_choice(reference, ref_overrides, side="reference") if everything else None
    choices = [engine_choice(c, cand_overrides, side="candidate") if jobs else None
               for c, (jobs, _) in zip(candidates, found)]
    if floor is None and (everything or any(why.choice_changes(reference.samples, c.samples, near_tie=near_tie,
                                                               floor=0.0) for c in candidates)):
        raise LocateError(f"--locate: {floor_source}; pass --noise RUN_A RUN_B (two runs of the candidate's config, "
                          "evalkit noise) to measure the floor for these runs")
    for line in filter(None, map(advice, filter(None, [ref_choice, *choices]))):
        print(f"{name}: {line}", file=sys.stderr)
    ref_pass = engine_pass(ref_choice, everything, top_k=top_k) if everything else None
    out = []
    for candidate, choice, (jobs, skipped) in zip(candidates, choices, found):
        same = bool(jobs) and choice.settings() == ref_choice.settings()
        cand_pass = (ref_pass if same else engine_pass(choice, jobs, top_k=top_k)) if jobs else None
        analysed = time.perf_counter()
        flips, unlocated = explain_jobs(jobs, ref_pass, cand_pass, near_tie=near_tie, floor=floor) if jobs else ([], [])
        changes = why.choice_changes(reference.samples, candidate.samples, near_tie=near_tie, floor=floor)
        seconds = {**(ref_pass.seconds if jobs else {}), **(cand_pass.seconds if jobs and not same else {})}
        seconds["total"] = round(sum(seconds.values()) + time.perf_counter() - analysed, 2)  # as if located alone
        engines = {"reference": ref_choice.describe(), "candidate": choice.describe() + (
            " (the reference's engine: same settings)" if same else "")} if jobs else {}
        out.append(why.Localisation(
            reference=reference.name, candidate=candidate.name, flips=flips, choices=changes, near_tie=near_tie,
            floor=floor, floor_source=floor_source, skipped=skipped + unlocated, seconds=seconds, engines=engines))
    return out


def add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("--locate", "why each changed document changed (evalkit/compare/locate/passes.py)")
    group.add_argument("--locate", action="store_true",
                       help="restart both runs' engines and find, for every differing generation, the first divergent "
                            "token and why (near-tie, logit drift, other)")
    group.add_argument("--near-tie", type=float, default=why.NEAR_TIE, metavar="NATS",
                       help=f"a flip is a near-tie when both engines' margins (the log-probability of the reference's "
                            f"token less the candidate's) lie within this (default {why.NEAR_TIE})")
    group.add_argument("--top-k", type=int, default=TOP_K, help="alternatives shown at each divergent token")
    for side, flag in FLAGS.items():
        group.add_argument(flag, nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                           help=f"settings over the {side} run's recorded config, e.g. {flag} vllm_path=/path/to/model "
                                "engine=hf")


def default_floor_applies(run: Run) -> str | None:
    """None when the default floor (measured on CPU float32) fits the run, else why not."""
    section = run.results.get("evalkit") or {}
    engine, config = section.get("engine") or {}, section.get("config") or {}
    dtype = (engine.get("engine_args") or {}).get("dtype") or config.get("dtype")
    if (engine.get("hardware") or {}).get("gpus"):
        return f"run {run.name} ran on a GPU"
    return None if dtype == "float32" else f"run {run.name} ran in dtype {dtype or 'unknown'}"


def from_args(args: Any, reference: Run, candidates: list[Run], noise: tuple[Run, Run] | None = None,
              name: str = "evalkit compare") -> dict[Path, why.Localisation]:
    """--locate as main runs it: candidate folder -> its Localisation, the floor from the noise pair (--noise)
    when given; the default floor only for CPU float32 runs (None otherwise: locate() asks for --noise if it
    needs a floor)."""
    floor, source = why.NOISE_FLOOR, "default: float32 batch noise measured in this project on CPU"
    unfit = next(filter(None, map(default_floor_applies, [reference, *candidates])), None)
    if unfit and not noise:
        floor = None
        source = f"the default noise floor ({why.NOISE_FLOOR:g} nats) was measured on CPU float32 and {unfit}"
    if noise:
        measured = why.noise_floor(noise[0].samples, noise[1].samples)
        if measured is None:
            floor, source = (None, "the --noise runs recorded no log-likelihoods to measure a floor from") if unfit \
                else (floor, "default: the --noise runs recorded no log-likelihoods to measure it")
        else:
            floor, source = measured, "--noise: max per-choice log-likelihood difference between the two noise runs"
    found = locate(reference, candidates, ref_overrides=args.ref_engine, cand_overrides=args.cand_engine,
                   near_tie=args.near_tie, floor=floor, floor_source=source, top_k=args.top_k, name=name)
    return {candidate.path: loc for candidate, loc in zip(candidates, found)}
