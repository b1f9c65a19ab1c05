"""Which of lm-eval's task folders a run's task names need, so a run indexes those instead of every built-in task.

lm-eval's full task index walks all its ~15,000 built-in YAMLs (about 17 s), so a run indexes only the
folders its names need: evalkit's own folders, plus, for built-in names, the folders recorded in a map
built once from the full index and cached as JSON under ``$EVALKIT_CACHE`` (one per lm-eval version and
install). The small index is checked against that map; where it differs, the full index is used.
Only lm-eval's public ``TaskManager(include_path=..., include_defaults=...)`` and its index entries are used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evalkit.config import TASKS_DIR, ConfigError, cache_dir
MAP_FORMAT = 1  # bump when the cached map's records change shape
log = logging.getLogger(__name__)


def own_dirs(extra_dirs: list[str]) -> list[str]:
    """evalkit's tasks/ and the user's tasks_dirs, checked, in lm-eval's precedence order (later wins)."""
    dirs = [str(TASKS_DIR)] + [str(Path(d).resolve()) for d in extra_dirs]
    for d in dirs:
        if not Path(d).is_dir():
            raise ConfigError(f"tasks_dirs: {d} is not a folder")
    return dirs


def task_manager(extra_dirs: list[str], metadata: dict[str, Any] | None = None):
    """The full index: every built-in task plus evalkit's own folders (slow: walks all of lm-eval's YAMLs); metadata:
    added to every task's metadata when it is built (lm-eval's --metadata)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=own_dirs(extra_dirs), metadata=metadata)


def members(entry: Any) -> list[str]:
    """The names an index entry refers to: a tag's tasks, or the names in a group's ``task`` list."""
    if entry.kind.name == "TAG":
        return sorted(entry.tags)
    if entry.kind.name != "GROUP":
        return []
    return _listed_names((entry.cfg or {}).get("task"))


def _listed_names(items: Any) -> list[str]:
    """Names in a group's ``task`` list: plain names, ``{task: name, ...}``, and ``{group: name, task: [...]}``
    (a reference to a group, or an inline group whose own list is read too)."""
    names: list[str] = []
    for item in items if isinstance(items, list) else [items]:
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, dict) and isinstance(item.get("group"), str):
            names += [item["group"], *_listed_names(item.get("task"))]
        elif isinstance(item, dict) and isinstance(item.get("task"), str):
            names.append(item["task"])
    return names


def _lm_eval_install() -> tuple[str, Path]:
    """lm-eval's version and its built-in tasks folder: what the cached map is valid for."""
    import importlib.metadata

    import lm_eval.tasks

    return importlib.metadata.version("lm_eval"), Path(lm_eval.tasks.__file__).parent


def _map_file(version: str, root: Path) -> Path:
    """One file per lm-eval version and install, so two venvs sharing a cache do not rebuild each other's."""
    digest = hashlib.sha256(f"{version}\n{root}".encode()).hexdigest()[:16]
    return cache_dir() / f"lm_eval_tasks-{digest}.json"


def builtin_records(manager: Any, root: Path) -> dict[str, dict[str, Any]]:
    """For each name in a built-in-only index: kind, YAML (relative to ``root``), the folders that must be
    indexed for it and, for tags, their tasks. A group needs its folder and its members' folders; a tag
    needs the common parent of its tasks' folders (lm-eval assembles a tag within one indexed folder)."""
    index, memo, prefix = manager.task_index, {}, f"{root}{os.sep}"

    def relative(path: Any) -> str:
        return str(path).removeprefix(prefix)  # plain strings: pathlib made this walk three times slower

    def folders(name: str, path: frozenset[str]) -> set[str]:
        entry = index.get(name)
        if name in memo or entry is None or name in path:
            return memo.get(name, set())
        found = {os.path.dirname(relative(entry.yaml_path)) or "."} if entry.yaml_path else set()
        below = set().union(*(folders(m, path | {name}) for m in members(entry)))
        found |= {os.path.commonpath(sorted(below)) or "."} if entry.kind.name == "TAG" and below else below
        memo[name] = found
        return found

    records = {}
    for name, entry in index.items():
        record = {"kind": entry.kind.name, "folders": sorted(folders(name, frozenset()))}
        if entry.yaml_path:
            record["yaml"] = relative(entry.yaml_path)
        if entry.kind.name == "TAG":
            record["members"] = sorted(entry.tags)
        records[name] = record
    return records


def _valid(record: Any) -> bool:
    """Whether a stored record has the shape builtin_records gives it (a damaged file may parse)."""
    return (isinstance(record, dict) and isinstance(record.get("kind"), str)
            and isinstance(record.get("folders"), list) and all(isinstance(f, str) for f in record["folders"])
            and isinstance(record.get("yaml", ""), str) and isinstance(record.get("members", []), list))


def _read_map(path: Path, version: str, root: Path) -> dict[str, dict[str, Any]] | None:
    """The cached map, or None when it is missing, damaged or made for another lm-eval (debug log says which)."""
    try:
        stored = json.loads(path.read_text())
        names = stored["names"]
        if (stored["format"], stored["lm_eval"], stored["tasks_folder"]) != (MAP_FORMAT, version, str(root)):
            log.debug("task map %s is for another lm-eval; rebuilding it", path)
            return None
        if all(_valid(record) for record in names.values()):
            return names
        log.debug("task map %s has damaged records; rebuilding it", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.debug("task map %s is unreadable (%s); rebuilding it", path, error)
    return None


def save_builtin_map(records: dict[str, dict[str, Any]]) -> Path:
    """Write the map atomically (temp file, then rename), so a reader never sees half of it."""
    version, root = _lm_eval_install()
    path = _map_file(version, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = {"format": MAP_FORMAT, "lm_eval": version, "tasks_folder": str(root), "names": records}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        try:
            json.dump(stored, tmp, separators=(",", ":"))
            tmp.close()
            os.chmod(tmp.name, 0o644)  # as an ordinary file, not the temp file's 0600
            os.replace(tmp.name, path)
        except BaseException:
            Path(tmp.name).unlink(missing_ok=True)
            raise
    return path


def _builtin_index() -> Any:
    """lm-eval's index of its built-in tasks alone: the slow walk (~17 s) the cached map saves later runs."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def _build_builtin_map() -> dict[str, dict[str, Any]]:
    records = builtin_records(_builtin_index(), _lm_eval_install()[1])
    try:
        save_builtin_map(records)
    except OSError as error:  # an unwritable cache costs speed, not the run
        log.debug("could not cache the task map: %s", error)
    return records


def builtin_map() -> dict[str, dict[str, Any]]:
    """Every built-in task, group and tag name with what indexing it needs; from the cache when it fits."""
    version, root = _lm_eval_install()
    return _read_map(_map_file(version, root), version, root) or _build_builtin_map()


def _outside(names: list[str], own_index: dict[str, Any]) -> set[str]:
    """The names, and the members of evalkit's own groups reached from them, not defined in evalkit's folders."""
    todo, seen, outside = list(names), set(), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in own_index:
            todo += members(own_index[name])
        else:
            outside.add(name)
    return outside


def _include_order(folders: set[str], root: Path) -> list[str]:
    """Built-in folders as include paths: those inside another dropped (it indexes them), and in reverse path
    order, since a later include path wins where, in one walk of lm-eval's folder, the first YAML found wins."""
    kept: list[str] = []
    for folder in sorted(f"{(root / f).as_posix()}/" for f in folders):
        if not kept or not folder.startswith(kept[-1]):
            kept.append(folder)
    return [f.rstrip("/") for f in reversed(kept)]


def _same(entry: Any, record: dict[str, Any], root: Path) -> bool:
    """Whether a small-index entry is the full index's: same kind, same YAML, and for a tag the same tasks."""
    expected = root / record["yaml"] if "yaml" in record else None
    found = Path(entry.yaml_path) if entry.yaml_path else None
    tasks = sorted(entry.tags)
    return entry.kind.name == record["kind"] and found == expected and record.get("members", tasks) == tasks


def _mismatch(manager: Any, names: list[str], own: set[str], builtin: dict[str, dict], root: Path) -> str | None:
    """Why the small index would resolve a name, or a member reached from it, unlike the full index; None if not."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        entry, record = manager.task_index.get(name), None if name in own else builtin.get(name)
        if entry is None and (name in own or record):
            return f"{name} is missing"
        if entry is None:
            continue  # unknown (load_tasks says so) or a group's inline task, as in the full index
        if record and not _same(entry, record, root):
            return f"{name} resolves to {entry.yaml_path or entry.kind.name}, unlike the full index"
        todo += members(entry)
    return None


def task_manager_for(names: list[str], extra_dirs: Sequence[str] = (), metadata: dict[str, Any] | None = None) -> Any:
    """A TaskManager indexing only what ``names`` need: evalkit's own folders, plus the built-in folders the
    cached map records for the built-in names among them (and among the members of evalkit's own groups);
    metadata as task_manager takes it.

    The full index instead when the small one would resolve a name differently (why: at debug level)."""
    from lm_eval.tasks import TaskManager

    dirs = own_dirs(list(extra_dirs))
    own = TaskManager(include_path=dirs, include_defaults=False, metadata=metadata)
    outside = _outside(list(names), own.task_index)
    if not outside:
        return own
    builtin, root = builtin_map(), _lm_eval_install()[1]
    folders = set().union(*(builtin[name]["folders"] for name in outside if name in builtin))
    if not folders:
        return own  # only unknown names: load_tasks reports them
    small = TaskManager(include_path=_include_order(folders, root) + dirs, include_defaults=False, metadata=metadata)
    why = _mismatch(small, list(names), set(own.task_index), builtin, root)
    if why is None:
        return small
    log.debug("the small task index for %s does not fit (%s); using the full index", list(names), why)
    return task_manager(list(extra_dirs), metadata=metadata)


def known_names(manager: Any) -> list[str]:
    """Every name a run may use, for "did you mean": lm-eval's built-in ones (from the map) and the index's."""
    return sorted(set(manager.all_tasks) | set(builtin_map()))
