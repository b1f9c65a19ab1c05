"""What a run's tasks read, as one hash: their YAMLs and data files, and the revisions of their hub datasets.

``results.json`` → ``evalkit.provenance.task_sources`` records it, and a sweep's point is skipped only when an
earlier run with its config read the same (evalkit/sweep/points.py). It is computed from files alone, without
loading a task, lm-eval's index or a dataset, so a check costs milliseconds:

* every file of the folders a run indexes (evalkit's ``tasks/`` and ``tasks_dirs``), by content: a prompt, a
  ``data_files`` file or a ``utils.py`` edited anywhere in them changes it;
* the local files and folders ``task_data`` names, by content;
* for each hub dataset a task may read (``dataset_path`` in those folders' YAMLs, in ``task_data``, or in the
  YAMLs of the lm-eval built-in tasks, groups and tags the run names), the commit the local hub cache holds
  (or the ``revision`` the YAML pins). lm-eval's own YAMLs change with its version, which the model's
  fingerprint holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import yaml

from evalkit.hashing import SMALL_FILE, file_sha256, large_file_sha256, sha256
from evalkit.harness.task_index import _listed_names, own_dirs


class _AnyTag(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser where PyYAML has it: 6x faster
    """A task YAML with lm-eval's own tags (``!function``) read as plain values."""


_AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        found = yaml.load(path.read_text(errors="replace"), Loader=_AnyTag)
    except (OSError, yaml.YAMLError):
        return {}  # the run itself says what is wrong with it
    return found if isinstance(found, dict) else {}


def content(path: Path) -> str:
    return file_sha256(path) if path.stat().st_size <= SMALL_FILE else large_file_sha256(path)


def files_of(root: Path) -> dict[str, str]:
    """Every file under root (or root itself), by content."""
    if root.is_file():
        return {root.name: content(root)}
    return {str(p.relative_to(root)): content(p) for p in sorted(root.rglob("*")) if p.is_file()
            and "__pycache__" not in p.parts}


def local_paths(value: Any) -> list[Path]:
    """The existing local files and folders named anywhere in a task_data value (data_files, a dataset path)."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in local_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in local_paths(v)]
    if isinstance(value, str) and "://" not in value and Path(value).expanduser().exists():
        return [Path(value).expanduser().resolve()]
    return []


def dataset_of(config: dict[str, Any]) -> tuple[str, str | None] | None:
    """(dataset_path, pinned revision) of a task config, None without a dataset_path."""
    path = config.get("dataset_path")
    kwargs = config.get("dataset_kwargs") if isinstance(config.get("dataset_kwargs"), dict) else {}
    return (path, kwargs.get("revision")) if isinstance(path, str) else None


def hub_commit(path: str, revision: str | None) -> str | None:
    """The commit of a hub dataset in the local hub cache: a pinned one as it is, None for a local path or a
    dataset never downloaded here."""
    from huggingface_hub.constants import HF_HUB_CACHE

    if revision and len(revision) == 40:
        return revision
    if "://" in path or Path(path).expanduser().exists():
        return None
    ref = Path(HF_HUB_CACHE) / f"datasets--{path.replace('/', '--')}" / "refs" / (revision or "main")
    return ref.read_text().strip() if ref.is_file() else None


def builtin_configs(names: Iterable[str]) -> list[dict[str, Any]]:
    """The YAMLs (with their includes) of lm-eval's built-in tasks, groups and tags reached from names."""
    from evalkit.harness.task_index import _lm_eval_install, builtin_map

    records, root = builtin_map(), _lm_eval_install()[1]
    todo, seen, found = list(names), set(), []
    while todo:
        name = todo.pop()
        if name in seen or name not in records:
            continue
        seen.add(name)
        record = records[name]
        todo += record.get("members", [])
        if "yaml" in record:
            config = with_includes(root / record["yaml"])
            found.append(config)
            todo += _listed_names(config.get("task")) if record["kind"] == "GROUP" else []
    return found


def with_includes(path: Path, depth: int = 0) -> dict[str, Any]:
    config = read_yaml(path)
    include = config.get("include")
    if isinstance(include, str) and depth < 5:
        config = {**with_includes(path.parent / include, depth + 1), **config}
    return config


def task_sources(*, names: list[str], tasks_dirs: list[str], task_data: dict[str, Any]) -> str:
    """The hash of everything the run's tasks read (the module docstring), as 64 hex digits."""
    dirs = own_dirs(list(tasks_dirs))
    own = [read_yaml(p) for d in dirs for p in sorted(Path(d).rglob("*.y*ml"))]
    own_names = {c.get(k) for c in own for k in ("task", "group", "tag") if isinstance(c.get(k), str)}
    wanted = [n for n in [*names, *task_data] if n not in own_names]
    configs = own + [dict(v) for v in task_data.values() if isinstance(v, dict)]
    configs += builtin_configs(wanted) if wanted else []
    datasets = sorted({d for d in map(dataset_of, configs) if d}, key=str)
    return sha256({"folders": {d: files_of(Path(d)) for d in dirs},
                   "task_data": {str(p): files_of(p) for p in local_paths(task_data)},
                   "hub": {f"{path}@{revision}": hub_commit(path, revision) for path, revision in datasets}})
