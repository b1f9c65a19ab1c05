"""Writes a run's files under ``result/<model_name>/<run id>/``; nothing else writes there.

A run folder is built under a hidden temporary name (random, created exclusively) and renamed into place once
complete, so a crash leaves no half-written run and one run never overwrites another. The files (see
docs/results.md), named and laid out as lm-eval's EvaluationTracker writes them, so lm-eval's own tools read them:

* ``results.json`` -- lm-eval's aggregate schema plus an ``evalkit`` section (:class:`EvalkitSection`);
  ``results_<date>.json`` is a link to it, under lm-eval's name
* ``samples_<task>_<date>.jsonl`` -- one line per document and filter (:class:`SampleLine`)
* ``samples_<task>_<date>.index.msgpack`` -- what compare reads of each line, bound to the samples file's bytes
  (``sample_index.py``): compare reads it instead of the file's JSON, never needs it
* ``divergence_<task>_<date>.npz`` -- the task's divergence record (``divergence_record.py``), with divergence_top_k > 0
* ``config.yaml`` -- the resolved config
* ``summary.csv`` / ``summary.md`` -- one row per task, metric and filter (:data:`SUMMARY_COLUMNS`)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from datetime import datetime
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterable, NotRequired, TypedDict

import pandas as pd

from evalkit.errors import ConfigError
from evalkit.contracts import RequestRecord
from evalkit.run import divergence_record, recording, sample_index
from evalkit.untrusted import fresh_folder, inside, write_atomic


class OutputError(ConfigError):
    """The run folder could not be written (disk full, read-only, no permission): one line, nothing half-written."""

SUMMARY_COLUMNS = ["task", "metric", "filter", "value", "stderr", "n_samples", "num_fewshot", "version",
                   "finish_length", "clamped", "truncated", "prompt_tokens", "output_tokens"]


class TaskCounts(TypedDict):
    requests: int
    prompt_tokens: int  # summed over requests, after any truncation
    output_tokens: int  # generated tokens, summed
    finish_length: int  # generations that stopped at their token limit
    clamped: int  # generations whose max_tokens was lowered to fit max_model_len
    truncated: int  # requests whose prompt lost tokens on the left (overflow=truncate_left)
    truncated_tokens: int


class Prompting(TypedDict):
    add_bos_token: bool | None  # the config key: null is the tokenizer's default
    adds_bos: bool  # whether prompts got a BOS token (text that starts with the BOS text never does)
    bos_token: list[Any]  # [text, id]: the token before an empty context
    eos_token: list[Any]  # [text, id]: added to every generation's stop strings
    apply_chat_template: bool
    system_instruction: str | None
    fewshot_as_multiturn: bool
    task_seeds: dict[str, int]  # lm-eval's random/numpy/torch/fewshot seeds
    temperature_override: float | None  # null: each task's own sampling settings
    sampling_kwargs: dict[str, Any]  # evalkit's overrides of every generation's SamplingParams


class EvalkitSection(TypedDict):
    run_id: str
    model_name: str
    config: dict[str, Any]  # the resolved config, as given
    engine: dict[str, Any]  # engine_args actually passed to vllm.LLM, versions, hardware
    untested_versions: list[str]  # vLLM, lm-eval outside the tested versions: "vllm 0.33.0 (tested: 0.32.0)"
    prompting: Prompting  # special tokens, chat template settings, seeds, sampling overrides
    # seconds per stage: startup (python -m evalkit to this try's evaluate: the supervisor's checks, the try's
    # process start and imports), prepare_model, load_tasks, engine_start, evaluate, close, total (of the stages
    # after startup); engine_start_stages (vLLM engines: import_vllm, engine_init, and tokenizer where add_bos_token
    # makes evalkit load its own); engine_calls
    # (seconds in the engine per request kind)
    timings: dict[str, Any]
    counts: dict[str, TaskCounts]  # per task
    sampling: dict[str, list[dict[str, Any]]]  # per task: each generation setting as the engine got it, with its count
    scoring: dict[str, Any]  # fast_scoring, the model runner ("v1" | "v2"), requests per scoring path, cache hits,
    #   resubmitted (V1 rows the cache covered, sent again), mismatched (reads that failed their check, sent again)
    provenance: dict[str, Any]  # content hashes: config, model fingerprint, each task's documents and prompts
    resume: dict[str, Any] | None  # request store file, answers reused from it and computed now
    attempts: list[dict[str, Any]]  # every try of this run: settings, status, error, seconds (OOM back-off)
    files: dict[str, Any]  # written by write_run: {"results": lm-eval's name, "samples": {task: file name},
    #   "divergence": {task: file name}}
    divergence: dict[str, Any]  # written by write_run: what the divergence record holds (recording.section)
    # gate.reference runs: the gate's reference, tolerance, alpha, order, every look's rows and intervals, the
    # documents evaluated of each task, whether it stopped early, its verdict and why (evalkit/run/gate.py)
    gate: NotRequired[dict[str, Any]]


class SampleLine(TypedDict, total=False):
    """lm-eval's sample fields as its EvaluationTracker writes them (doc_id, doc, target as text, arguments
    as {"gen_args_<i>": {"arg_<j>": ...}}, resps and filtered_resps as text, filter, metrics, doc_hash,
    prompt_hash, target_hash, and each metric's value) plus evalkit's below."""

    prompt: str  # the text of the first request (context), as sent after any chat template
    raw_output: str | None  # generation before the thinking section was stripped (generation tasks)
    filtered_output: Any  # what the metric scored
    scores: dict[str, Any]  # metric -> value for this document
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    requests: list[dict[str, Any]]  # one RequestRecord per request of this document


def count_records(records: dict[tuple[str, int], list[RequestRecord]]) -> dict[str, TaskCounts]:
    counts: dict[str, Counter] = {}
    for (task, _), recs in records.items():
        c = counts.setdefault(task, Counter())
        for r in recs:
            c.update(requests=1, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
                     finish_length=r.finish_reason == "length", clamped=r.clamped,
                     truncated=r.truncated_tokens > 0, truncated_tokens=r.truncated_tokens)
    return {task: TaskCounts(**{k: int(c[k]) for k in TaskCounts.__annotations__}) for task, c in counts.items()}


def provenance(results: dict[str, Any], *, config: dict[str, Any], model_fingerprint: str) -> dict[str, Any]:
    """Hashes that show two runs are like-for-like: same config, model, documents and prompts."""
    from evalkit.hashing import sha256

    tasks = {}
    for task, samples in (results.get("samples") or {}).items():
        docs = sorted({(s["doc_id"], s.get("doc_hash")) for s in samples})
        prompts = sorted({(s["doc_id"], s.get("prompt_hash")) for s in samples})
        tasks[task] = {"documents": len(docs), "docs_sha256": sha256(docs), "prompts_sha256": sha256(prompts)}
    settings = {k: v for k, v in config.items()
                if k not in ("output_dir", "resume", "chunk_size", "log_samples", "divergence_top_k",
                             "divergence_reference")}
    return {"config_sha256": sha256(settings), "model_fingerprint": model_fingerprint, "tasks": tasks}


def sample_line(sample: dict[str, Any], records: list[RequestRecord]) -> SampleLine:
    metrics = sample.get("metrics") or []
    arguments = sample.get("arguments") or []
    first = arguments[0] if arguments else None
    prompt = first[0] if isinstance(first, (list, tuple)) and first else first
    filtered = sample.get("filtered_resps")
    gens = [r for r in records if r.kind == "generate_until"]
    line: SampleLine = {
        **sample,
        "prompt": prompt,
        "raw_output": gens[0].raw_output if gens else None,
        "filtered_output": filtered[0] if isinstance(filtered, list) and len(filtered) == 1 else filtered,
        "scores": {m: sample.get(m) for m in metrics},
        "finish_reason": gens[0].finish_reason if gens else None,
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "output_tokens": sum(r.output_tokens for r in records),
        "requests": [request_fields(r) for r in records],
    }
    return {**line, **lm_eval_layout(sample)}


def request_fields(record: RequestRecord) -> dict[str, Any]:
    """A request's record as the samples show it: its traces go to the divergence record instead."""
    return {k: v for k, v in asdict(replace(record, traced=[])).items() if k != "traced"}


def lm_eval_layout(sample: dict[str, Any]) -> dict[str, Any]:
    """The fields lm-eval's EvaluationTracker.save_results_samples rewrites before writing a sample."""
    from lm_eval.utils import sanitize_list

    return {"arguments": {f"gen_args_{i}": {f"arg_{j}": value for j, value in enumerate(args)}
                          for i, args in enumerate(sample.get("arguments") or [])},
            "resps": sanitize_list(sample.get("resps")), "filtered_resps": sanitize_list(sample.get("filtered_resps")),
            "target": str(sample.get("target"))}


def summary_frame(results: dict[str, Any], counts: dict[str, TaskCounts]) -> pd.DataFrame:
    rows = []
    for task, values in results.get("results", {}).items():
        c = counts.get(task, {})
        for key, value in values.items():
            if "," not in key or "_stderr" in key.split(",")[0]:
                continue
            metric, filt = key.split(",", 1)
            stderr = values.get(f"{metric}_stderr,{filt}")
            rows.append({
                "task": task, "metric": metric, "filter": filt, "value": value,
                "stderr": stderr if isinstance(stderr, (int, float)) else None,
                "n_samples": results.get("n-samples", {}).get(task, {}).get("effective"),
                "num_fewshot": results.get("n-shot", {}).get(task),
                "version": results.get("versions", {}).get(task),
                **{k: c.get(k) for k in ("finish_length", "clamped", "truncated", "prompt_tokens", "output_tokens")},
            })
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def task_hashes(samples: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """lm-eval's per-task hash of its documents, prompts and targets (EvaluationTracker.save_results_aggregated)."""
    from lm_eval.utils import hash_string

    return {task: hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in task_samples))
            for task, task_samples in samples.items()}


def _json(obj: Any) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(obj, default=handle_non_serializable, ensure_ascii=False)


def _write_jsonl(path: Path, lines: Iterable[Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(_json(line) + "\n")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def lm_eval_date_id() -> str:
    """The timestamp lm-eval's EvaluationTracker puts in its file names."""
    return datetime.now().isoformat().replace(":", "-")


def sample_files(run_dir: Path, results: dict[str, Any]) -> dict[str, Path]:
    """task -> its samples file in a run folder, as the run's results.json (results) names them; OutsideFolder
    where a name leads out of the folder (absolute, .., a link elsewhere): a run folder names only its own files."""
    names = (results.get("evalkit") or {}).get("files", {}).get("samples", {})
    return {task: inside(Path(run_dir), name) for task, name in names.items()}


def read_samples(run_dir: Path, task: str) -> list[dict[str, Any]]:
    results = json.loads((Path(run_dir) / "results.json").read_text())
    with open(sample_files(run_dir, results)[task], encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_run(
    *,
    output_dir: str,
    model_name: str,
    run_id: str,
    results: dict[str, Any],
    records: dict[tuple[str, int], list[RequestRecord]],
    config_yaml: str,
    evalkit: EvalkitSection,
    divergence: dict[str, Any] | None = None,
) -> Path:
    """Write one run folder atomically and return its final path. divergence: the harness's summary of its
    traces (TraceLog.summary), whose top_k > 0 writes the divergence record from the records' traces."""
    parent = Path(output_dir) / model_name
    parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = fresh_folder(parent, f".tmp-{run_id}-")
    except OSError as error:
        raise OutputError(f"could not write the run into {parent} ({error.strerror or error}); free space or pass "
                          "output_dir= a writable folder, then rerun: the answers computed so far are kept in "
                          "the request store") from error
    try:
        date_id = lm_eval_date_id()
        samples = results.get("samples") or {}
        top_k = (divergence or {}).get("top_k", 0)
        built = recording.task_positions(records, top_k) if top_k else {}
        files = {"results": f"results_{date_id}.json",
                 "samples": {task: f"samples_{task}_{date_id}.jsonl" for task in samples},
                 "divergence": {task: f"divergence_{task}_{date_id}.npz" for task in built}}
        for task, columns in built.items():
            divergence_record.write(tmp / files["divergence"][task], columns)
        sizes = {task: (tmp / name).stat().st_size for task, name in files["divergence"].items()}
        for task, task_samples in samples.items():
            _write_jsonl(tmp / files["samples"][task],
                         (sample_line(s, records.get((task, s["doc_id"]), [])) for s in task_samples))
        indexes = {task: f"samples_{task}_{date_id}.index.msgpack" for task in samples}
        files["sample_index"] = {task: name for task, name in indexes.items()
                                 if sample_index.write(tmp / files["samples"][task], tmp / name)}
        aggregate = {k: v for k, v in results.items() if k != "samples"}
        aggregate["task_hashes"] = task_hashes(samples)
        aggregate["evalkit"] = {**evalkit, "files": files, "divergence": recording.section(divergence, built, sizes)}
        (tmp / "results.json").write_text(json.dumps(json.loads(_json(aggregate)), indent=2) + "\n")
        (tmp / files["results"]).symlink_to("results.json")
        (tmp / "config.yaml").write_text(config_yaml)
        frame = summary_frame(results, evalkit["counts"])
        frame.to_csv(tmp / "summary.csv", index=False)
        (tmp / "summary.md").write_text(frame.to_markdown(index=False, floatfmt=".4f") + "\n")
        return _publish(tmp, parent, run_id)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"could not write the run into {parent} ({error.strerror or error}); free space or pass "
                          "output_dir= a writable folder, then rerun: the answers computed so far are kept in "
                          "the request store") from error
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, parent: Path, run_id: str) -> Path:
    """Rename tmp to the first free <run_id>[-N]; never replaces an existing run."""
    for n in range(1000):
        final = parent / (run_id if n == 0 else f"{run_id}-{n}")
        if final.exists():
            continue
        try:
            os.rename(tmp, final)  # fails if another run took the name meanwhile (non-empty folder)
            return final
        except OSError:
            continue
    raise RuntimeError(f"no free run folder name under {parent}")


def write_beside(run_dir: Path, files: dict[str, str]) -> list[Path]:
    """Add files to an existing run folder (a comparison report), each written atomically through a temporary
    created exclusively (untrusted.write_atomic): nothing half-written is left, and no link planted in the
    folder redirects a write."""
    return [write_atomic(Path(run_dir) / name, text) for name, text in files.items()]


def attach_log(run_dir: Path, log_path: Path, name: str = "engine.log") -> Path:
    """Move a run's log (every try's output, written while it ran) into its run folder as engine.log.

    Never replaces a file: the hard link fails when the name is taken; where the file system has no hard
    links, the name is checked first (the run's lock keeps others out) and the log renamed in."""
    final = Path(run_dir) / name
    try:
        os.link(log_path, final)
    except FileExistsError:
        raise
    except OSError:
        if final.exists():
            raise FileExistsError(f"{final} already exists") from None
        os.rename(log_path, final)
        return final
    os.unlink(log_path)
    return final
