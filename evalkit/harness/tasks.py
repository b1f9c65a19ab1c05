"""Loads a run's tasks by name before any engine starts: lm-eval's, evalkit's own YAMLs in ``tasks/``, and local data.

Task data is loaded here, before any engine starts, so that a wrong name or an unreachable dataset fails
in seconds. Two ways to keep data local (air-gapped clusters are the common case):

* ``task_data.<task>`` in the config replaces a task's ``dataset_path`` / ``dataset_name`` /
  ``dataset_kwargs`` and keeps its prompts and metrics, e.g.
  ``+task_data.gsm8k={dataset_path:json,dataset_kwargs:{data_files:{test:/data/gsm8k/test.jsonl}}}``.
* relative ``data_files`` in a task YAML are read relative to that YAML's folder.

Only the folders the names need are indexed (evalkit/harness/task_index.py).
"""


from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jinja2
import yaml

from evalkit.config import TASKS_DIR, ConfigError, closest
from evalkit.harness.lm_eval_compat import build_task, full_config
from evalkit.harness.task_index import known_names, task_manager_for

DATA_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs")


def _resolve_data_files(data_files: Any, base: Path) -> Any:
    if isinstance(data_files, str):
        return data_files if "://" in data_files else str((base / data_files).resolve())
    if isinstance(data_files, list):
        return [_resolve_data_files(f, base) for f in data_files]
    if isinstance(data_files, dict):
        return {k: _resolve_data_files(v, base) for k, v in data_files.items()}
    return data_files


def _overrides(entry: Any, full_config: dict[str, Any], user_data: dict[str, Any] | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if user_data:
        unknown = set(user_data) - set(DATA_KEYS)
        if unknown:
            raise ConfigError(f"task_data.{entry.name}: unknown keys {sorted(unknown)}; use {', '.join(DATA_KEYS)}")
        overrides.update(user_data)
        base = Path.cwd()
    else:
        base = Path(entry.yaml_path).parent if entry.yaml_path else Path.cwd()
    kwargs = dict(overrides.get("dataset_kwargs", full_config.get("dataset_kwargs")) or {})
    if "data_files" in kwargs:
        kwargs["data_files"] = _resolve_data_files(kwargs["data_files"], base)
        overrides["dataset_kwargs"] = kwargs
    return overrides


class _AnyTag(yaml.SafeLoader):
    """Reads a task YAML with lm-eval's own tags (``!function``) taken as plain values."""


_AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)


def broken_yaml(name: str, dirs: list[str]) -> str | None:
    """One line naming a task YAML that mentions ``name`` but does not parse (lm-eval's index skips it quietly)."""
    for folder in dirs:
        for path in sorted(Path(folder).rglob("*.yaml")):
            text = path.read_text(errors="replace")
            if name not in text:
                continue
            try:
                yaml.load(text, Loader=_AnyTag)
            except yaml.YAMLError as error:
                where = getattr(error, "problem_mark", None)
                line = f"line {where.line + 1}: " if where else ""
                problem = getattr(error, "problem", None) or str(error).splitlines()[0]
                return f"task {name}: {path} is not valid YAML ({line}{problem}); fix the file"
    return None


def runs_model_code(yaml_path: Path, depth: int = 0) -> bool:
    """Whether a task's YAML (or one it includes) says ``unsafe_code: true``: read as text, without importing the
    task's functions (humaneval's load a code-running metric at import)."""
    class Plain(yaml.SafeLoader):
        pass

    Plain.add_multi_constructor("!", lambda loader, suffix, node: None)  # lm-eval's !function
    try:
        config = yaml.load(yaml_path.read_text(), Loader=Plain)
    except (OSError, yaml.YAMLError):
        return False  # the task's own loading reports it
    if not isinstance(config, dict):
        return False
    if "unsafe_code" in config or depth > 8:
        return bool(config.get("unsafe_code"))
    include = config.get("include")
    return isinstance(include, str) and runs_model_code(yaml_path.parent / include, depth + 1)


def indexed(names: list[str], *, task_data: dict[str, Any], extra_dirs: list[str],
            metadata: dict[str, Any] | None = None) -> Any:
    """The TaskManager that indexes names (and task_data's), each checked to be there: a name it lacks is a
    ConfigError naming a broken YAML of that name, or the closest known names. No task is built; metadata goes to
    each task built later (lm-eval's --metadata)."""
    manager = task_manager_for(list(names) + list(task_data), extra_dirs, metadata)
    for name in list(names) + list(task_data):
        if name not in manager.task_index:
            broken = broken_yaml(name, [str(TASKS_DIR), *extra_dirs])
            if broken:
                raise ConfigError(broken)
            known = known_names(manager)
            raise ConfigError(f"unknown task {name!r}{closest(name, known)}; {len(known)} tasks are known "
                              f"(lm-eval's and {TASKS_DIR.name}/)")
    return manager


def load_tasks(names: list[str], *, task_data: dict[str, Any], extra_dirs: list[str],
               confirm_run_unsafe_code: bool = False, metadata: dict[str, Any] | None = None) -> tuple[Any, list[Any]]:
    """The TaskManager and the task objects (or group names) for simple_evaluate, data loaded.

    ConfigError if a name is unknown, its data cannot be read, or it runs the model's code (unsafe_code in its
    YAML) without confirm_run_unsafe_code, as lm-eval's simple_evaluate refuses it, but before the engine starts."""
    manager = indexed(names, task_data=task_data, extra_dirs=extra_dirs, metadata=metadata)
    loaded: list[Any] = []
    for name in names:
        entry = manager.task_index[name]
        if entry.kind.name not in ("TASK", "PY_TASK"):
            if name in task_data:
                raise ConfigError(f"task_data.{name}: {name} is a group; point task_data at its tasks instead")
            loaded.append(name)  # groups and tags: lm-eval expands them
            continue
        if not confirm_run_unsafe_code and entry.yaml_path and runs_model_code(Path(entry.yaml_path)):
            raise ConfigError(f"task {name} runs the code the model writes on this machine: pass "
                              "confirm_run_unsafe_code=true to run it (as lm-eval's --confirm_run_unsafe_code), "
                              "best inside a sandbox")
        overrides = _overrides(entry, full_config(manager, entry), task_data.get(name))
        try:
            loaded.append(build_task(manager, entry, overrides or None))
        except Exception as error:  # datasets raises many kinds; the user needs the task and the fix
            logging.getLogger(__name__).debug("loading %s failed", name, exc_info=True)
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if isinstance(error, (jinja2.exceptions.UndefinedError, KeyError)):
                raise ConfigError(f"task {name}: its template uses a field its data lacks ({first}) in "
                                  f"{entry.yaml_path or name}; fix the template or the data") from error
            raise ConfigError(f"task {name}: its data could not be loaded ({first}); "
                              f"point task_data.{name} at local files") from error
    return manager, loaded


def scoring_tasks(tasks: list[Any]) -> list[str]:
    """The names of the loaded tasks that need log-likelihoods (every output type but generate_until); a group
    named but not yet expanded is not counted."""
    return sorted(t.config.task for t in tasks
                  if not isinstance(t, str) and getattr(t.config, "output_type", None) != "generate_until")
