"""A run on disk, as compare reads it (results.json and the per-sample files), and the like-for-like check:
two runs are compared only when they saw the same tasks at the same versions, documents, prompts and targets."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalkit.run.results import sample_files


class CompareError(ValueError):
    """The two runs cannot be compared (missing files, different tasks, documents or prompts)."""


@dataclass
class Run:
    path: Path  # the run folder
    results: dict[str, Any]
    samples: dict[str, dict[tuple[int, str], dict[str, Any]]]  # task -> (doc_id, filter) -> sample line

    @property
    def name(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}"


def load_run(path: str | Path) -> Run:
    """A run folder written by ``python -m evalkit``, or its results.json."""
    folder = Path(path)
    folder = folder.parent if folder.name == "results.json" else folder
    results_file = folder / "results.json"
    if not results_file.is_file():
        raise CompareError(f"{path}: not an evalkit run (no results.json)")
    results = json.loads(results_file.read_text())
    samples = {}
    for task, file in sample_files(folder, results).items():
        if file.is_file():
            lines = (json.loads(line) for line in file.read_text().splitlines() if line.strip())
            samples[task] = {(s["doc_id"], s.get("filter", "none")): s for s in lines}
    if not samples:
        raise CompareError(f"{path}: no samples_<task>_<date>.jsonl files; rerun with log_samples=true")
    return Run(path=folder.resolve(), results=results, samples=samples)


def check_like_for_like(reference: Run, candidate: Run) -> None:
    """Same tasks at the same versions, documents, few-shot counts, prompts and targets; a CompareError if not."""
    if set(reference.samples) != set(candidate.samples):
        raise CompareError(f"different tasks: {sorted(reference.samples)} vs {sorted(candidate.samples)}")
    versions = [run.results.get("versions") or {} for run in (reference, candidate)]
    for name in sorted(set(versions[0]) | set(versions[1])):
        if versions[0].get(name) != versions[1].get(name):
            raise CompareError(f"{name}: task version {versions[0].get(name)} vs {versions[1].get(name)}; the runs "
                               "used different task definitions")
    for task, ref in reference.samples.items():
        cand = candidate.samples[task]
        if set(ref) != set(cand):
            raise CompareError(f"{task}: different documents ({len(ref)} vs {len(cand)} samples); "
                               "use the same limit and task data")
        shots = [run.results.get("n-shot", {}).get(task) for run in (reference, candidate)]
        if shots[0] != shots[1]:
            raise CompareError(f"{task}: different few-shot counts {shots[0]} vs {shots[1]}")
        for key, sample in ref.items():
            other = cand[key]
            for hash_key in ("doc_hash", "prompt_hash", "target_hash"):
                if sample.get(hash_key) != other.get(hash_key):
                    raise CompareError(f"{task}: document {key[0]} differs ({hash_key}); the runs did not "
                                       "see the same documents, prompts and answers")
