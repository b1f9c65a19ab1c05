"""A run on disk, as compare reads it (results.json, and of each line of the per-sample files what compare, its
pages and --locate read), and the like-for-like check: two runs are compared only when they saw the same tasks at
the same versions, documents, prompts and targets."""

from __future__ import annotations

import contextlib
import gc
import json
import operator
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from evalkit.run import sample_index
from evalkit.run.results import sample_files
from evalkit.run.sample_index import BLANK, held, line_value, shared_metrics
from evalkit.untrusted import (OutsideFolder, TooLarge, file_limit, inside, json_data, open_regular, printable,
                               read_bounded, too_large)


class CompareError(ValueError):
    """The two runs cannot be compared (missing files, different tasks, documents or prompts)."""


@dataclass
class Run:
    path: Path  # the run folder
    results: dict[str, Any]
    samples: dict[str, dict[tuple[int, str], dict[str, Any]]]  # task -> (doc_id, filter) -> sample line (held)

    @property
    def name(self) -> str:
        """<model folder>/<run folder>, control characters (a newline, an escape) escaped: a folder may come from
        elsewhere, and its name is shown on the terminal, in the text report and on the page."""
        return printable(f"{self.path.parent.name}/{self.path.name}")


def names_escaped(value: Any) -> Any:
    """value (a results.json) with the control characters of every key escaped (untrusted.printable): task,
    metric and filter names are shown line by line, so a newline in one would start a line of its own."""
    if isinstance(value, dict):
        return {printable(k) if isinstance(k, str) else k: names_escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [names_escaped(v) for v in value]
    return value


def _text(file: Path) -> str:
    """The file's text, read up to untrusted.file_limit() (a run folder may come from elsewhere)."""
    try:
        return read_bounded(file).decode("utf-8")
    except TooLarge as error:
        raise CompareError(str(error)) from None
    except (OSError, UnicodeDecodeError) as error:
        raise CompareError(f"{file}: cannot be read ({getattr(error, 'strerror', None) or error})") from None


def _json(text: str, where: str) -> Any:
    try:
        return json_data(text)
    except ValueError as error:
        raise _not_json(error, where) from None


def _not_json(error: ValueError, where: str) -> CompareError:
    """json_data's refusal of the text at where, in one line."""
    if isinstance(error, json.JSONDecodeError):
        return CompareError(f"{where}: not JSON ({error.msg} at line {error.lineno}, column {error.colno}): a "
                            "truncated or damaged file; rerun or copy it again")
    return CompareError(f"{where}: {error}")


def _lines(file: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number, offset, bytes) of each line of file, read up to untrusted.file_limit() (a run folder may come
    from elsewhere) one line at a time: the file is never held whole."""
    limit = file_limit()
    try:
        with open_regular(file) as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise too_large(file, size, limit)
            offset = 0
            for number, line in enumerate(f, 1):
                if offset + len(line) > limit:  # it grows while read
                    raise too_large(file, offset + len(line), limit)
                yield number, offset, line
                offset += len(line)
    except TooLarge as error:
        raise CompareError(str(error)) from None
    except OSError as error:
        raise CompareError(f"{file}: cannot be read ({error.strerror or error})") from None


def _undecodable(error: UnicodeDecodeError, offset: int, file: Path) -> CompareError:
    """A byte that is not UTF-8 in the line at offset, as the file's CompareError, its position counted in the
    file."""
    where = re.sub(r"position (\d+)(-(\d+))?", lambda m: "position " + "-".join(
        str(int(n) + offset) for n in m.group(1, 3) if n is not None), str(error), count=1)
    return CompareError(f"{file}: cannot be read ({where})")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a pass over every document of the runs (restored after, as it
    was): a run's samples are millions of small objects with no cycle among them, and each full collection would
    walk them all again, which costs several times the pass itself. What the pass leaves alive is then frozen out
    of later collections (gc.freeze), which would walk it too (drawing a page, importing a module); it is freed as
    ever once no longer referenced. As a decorator, for one call."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


@collector_paused()
def read_samples(file: Path, task: str, index: Path | None = None) -> dict[tuple[int, str], dict[str, Any]]:
    """(doc_id, filter) -> what compare holds of each sample line of task's samples file (held), each line checked:
    an object with an integer doc_id, and the only one of its document and filter (lm-eval writes one line per
    document and filter; a second would silently replace the first). Lines are JSON Lines' (split at newlines
    only), read by orjson; a line orjson refuses or may read otherwise (NaN, an integer past 64 bits, ...) is read
    by the stdlib json, as untrusted.json_data reads it, so that the values and every refusal are the stdlib's.
    index: the file's sample index (sample_index.py), read instead where it was made from these very bytes and
    passes the same checks; else the file is read."""
    lines = sample_index.read(file, index) if index is not None else None
    if lines is not None:
        try:  # held when the index was written
            return _keyed_at_once(lines) or _keyed(enumerate(lines, 1), file, task, _shared)
        except CompareError:  # an index whose lines compare refuses: the file's own reading says where
            pass
    with contextlib.closing(_lines(file)) as numbered:  # closed, and the file with it, when a line is refused
        return _keyed(_parsed(numbered, file), file, task, held)


def _shared(sample: dict[str, Any], seen: dict[Any, Any]) -> dict[str, Any]:
    """A held line read from an index, its list of metrics held once per file as held() holds it."""
    shared_metrics(sample, seen)
    return sample


def _keyed_at_once(lines: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]] | None:
    """_keyed(enumerate(lines, 1), ..., _shared) of an index's lines (dicts, as its decoder reads them, their
    lists of metrics shared as held shares them), each check made of all lines at once, in C: where every doc_id
    is an int and every filter a text, each (doc_id, filter) once. None where not so: _keyed then checks line by
    line, and names the line it refuses."""
    ids, filters = (list(map(get, lines)) for get in (_DOC_ID, _FILTER))
    if not lines or set(map(type, ids)) != {int} or set(map(type, filters)) != {str}:
        return None
    shown = {filt: printable(filt) for filt in set(filters)}
    samples = dict(zip(zip(ids, map(shown.__getitem__, filters)), lines))
    return samples if len(samples) == len(lines) else None


_DOC_ID, _FILTER = (operator.methodcaller("get", *key) for key in (("doc_id",), ("filter", "none")))


def _parsed(numbered: Iterator[tuple[int, int, bytes]], file: Path) -> Iterator[tuple[int, Any]]:
    """(line number, JSON value) of each line that is not blank."""
    for number, offset, line in numbered:
        try:
            sample = line_value(line)
        except UnicodeDecodeError as error:
            raise _undecodable(error, offset, file) from None
        except ValueError as error:
            raise _not_json(error, f"{file}, line {number}") from None
        if sample is not BLANK:
            yield number, sample


def _keyed(numbered: Iterator[tuple[int, Any]], file: Path, task: str,
           hold: Callable[[dict[str, Any], dict[Any, Any]], dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    samples, lines, seen, filters = {}, {}, {}, {}
    for number, sample in numbered:
        if not isinstance(sample, dict) or not isinstance(sample.get("doc_id"), int):
            raise CompareError(f"{file}, line {number}: a sample without an integer doc_id; not a samples "
                               "file evalkit (lm-eval) wrote")
        filt = sample.get("filter", "none")
        shown = filters.get(filt) if isinstance(filt, str) else None
        if shown is None:
            shown = printable(str(filt))  # as results.json's names
            filters.update({filt: shown} if isinstance(filt, str) else {})
        key = (sample["doc_id"], shown)
        if key in samples:
            raise CompareError(f"{file}, line {number}: task {task}, doc_id {key[0]}, filter {key[1]!r} again "
                               f"(first on line {lines[key]}); a samples file holds one line per document and "
                               "filter: a damaged or concatenated file, rerun or copy it again")
        samples[key], lines[key] = hold(sample, seen), number
    return samples


@collector_paused()
def load_run(path: str | Path) -> Run:
    """A run folder written by ``python -m evalkit``, or its results.json. Anything unreadable (missing,
    truncated, damaged) is a CompareError in one line; so is a samples file results.json names that is not there,
    which would leave its task out of the comparison unsaid."""
    folder = Path(path)
    folder = folder.parent if folder.name == "results.json" else folder
    results_file = folder / "results.json"
    if not results_file.is_file():
        raise CompareError(f"{path}: not an evalkit run (no results.json)")
    try:
        inside(folder, "results.json")  # a link to a file elsewhere on this machine would show it in the report
    except OutsideFolder as error:
        raise CompareError(f"{folder}: {error}; a run folder holds its own results") from None
    results = names_escaped(_json(_text(results_file), str(results_file)))
    try:
        files = sample_files(folder, results)
    except OutsideFolder as error:
        raise CompareError(f"{results_file}: samples file {error}; a run folder names only its own files") from None
    except (AttributeError, TypeError):
        files = None
    if not isinstance(results, dict) or not isinstance(files, dict):
        raise CompareError(f"{results_file}: not an evalkit results file (no evalkit.files.samples object)")
    missing = sorted(task for task, file in files.items() if not file.is_file())
    if missing:
        raise CompareError(f"{results_file}: names {files[missing[0]].name} as task {missing[0]}'s samples, but the "
                           f"folder has no such file ({len(missing)} of {len(files)} tasks' files missing); copy the "
                           "whole run folder, or rerun")
    indexes = _indexes(folder, results)
    samples = {task: read_samples(file, task, indexes.get(task)) for task, file in files.items()}
    if not samples:
        raise CompareError(f"{path}: no samples_<task>_<date>.jsonl files; rerun with log_samples=true")
    return Run(path=folder.resolve(), results=results, samples=samples)


def _indexes(folder: Path, results: dict[str, Any]) -> dict[str, Path]:
    """task -> its samples file's index where results.json names one inside the folder (runs written before
    indexes name none; one named elsewhere is passed over: an index is only ever a shortcut)."""
    names = ((results.get("evalkit") or {}).get("files") or {}).get("sample_index")
    found = {}
    for task, name in (names.items() if isinstance(names, dict) else ()):
        with contextlib.suppress(OutsideFolder, TypeError, ValueError):
            found[task] = inside(folder, name)
    return found


def recorded_scores(run: Run) -> dict[tuple[str, str, str], float]:
    """(task, filter, metric) -> the score results.json records ("metric,filter"), for every task that is not a
    group (lm-eval lists its groups among the tasks too); their standard errors left out."""
    results = run.results.get("results")
    groups = set(run.results.get("group_subtasks") or {}) | set(run.results.get("groups") or {})
    return {(task, *reversed(key.split(",", 1))): value
            for task, scores in (results.items() if isinstance(results, dict) else ())
            if task not in groups and isinstance(scores, dict)
            for key, value in scores.items()
            if "," in key and "_stderr," not in key and isinstance(value, (int, float)) and not isinstance(value, bool)}


@collector_paused()
def check_like_for_like(reference: Run, candidate: Run) -> None:
    """Same tasks at the same versions, documents, few-shot counts, prompts and targets; a CompareError if not.
    A run its gate stopped early is refused first: its documents were chosen by when the gate decided, so a
    fixed-n test on them would claim more than the gate did (its verdict is in results.json, evalkit.gate)."""
    for run in (reference, candidate):
        gate = (run.results.get("evalkit") or {}).get("gate")
        if isinstance(gate, dict) and gate.get("stopped_early"):
            raise CompareError(f"{run.name}: stopped early by its gate ({gate.get('verdict')} after "
                               f"{sum((gate.get('documents') or {}).values())} documents; results.json, evalkit.gate):"
                               " its verdict is the gate's; run it again without gate.reference to compare all")
    if reference.samples.keys() != candidate.samples.keys():
        raise CompareError(f"different tasks: {sorted(reference.samples)} vs {sorted(candidate.samples)}")
    versions = [run.results.get("versions") or {} for run in (reference, candidate)]
    for name in sorted(set(versions[0]) | set(versions[1])):
        if versions[0].get(name) != versions[1].get(name):
            raise CompareError(f"{name}: task version {versions[0].get(name)} vs {versions[1].get(name)}; the runs "
                               "used different task definitions")
    for task, ref in reference.samples.items():
        cand = candidate.samples[task]
        if ref.keys() != cand.keys():
            raise CompareError(f"{task}: different documents ({len(ref)} vs {len(cand)} samples); "
                               "use the same limit and task data")
        shots = [run.results.get("n-shot", {}).get(task) for run in (reference, candidate)]
        if shots[0] != shots[1]:
            raise CompareError(f"{task}: different few-shot counts {shots[0]} vs {shots[1]}")
        try:  # every document the same (its three hashes at once, compared in C)
            if all(map(operator.eq, map(HASHES, ref.values()), map(HASHES, map(cand.__getitem__, ref)))):
                continue
        except KeyError:  # a sample without one of them: looked at one by one
            pass
        for key, sample in ref.items():
            other = cand[key]
            for hash_key in ("doc_hash", "prompt_hash", "target_hash"):
                if sample.get(hash_key) != other.get(hash_key):
                    raise CompareError(f"{task}: document {key[0]} differs ({hash_key}); the runs did not "
                                       "see the same documents, prompts and answers")


HASHES = operator.itemgetter("doc_hash", "prompt_hash", "target_hash")
