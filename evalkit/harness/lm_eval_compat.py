"""lm-eval internals evalkit needs where lm-eval has no public API, all in this one module (docs/architecture.md,
"Layout").

Checked against lm-eval ``CHECKED`` (pyproject.toml allows the same range); tests/test_lm_eval_compat.py
fails the day one of them moves or changes. Everything else evalkit uses of lm-eval is public.

* ``TaskManager._factory`` and its ``_load_full_config``/``build``: building one task with overrides
  (``task_data``) through lm-eval's own loader, so includes and ``!function`` resolve as usual. The public
  ``TaskManager.load`` takes no per-task overrides.
* ``TemplateLM._encode_pair`` and the empty-context rule of ``TemplateLM.loglikelihood``: how a (context,
  continuation) pair becomes token ids, which :func:`encode_pairs` repeats so the harness keeps each request
  beside its ids (``TemplateLM`` hands ``_loglikelihood_tokens`` the ids without the requests).
* ``lm_eval.evaluator.add_env_info``, the name ``simple_evaluate`` calls when it has scored: its facts (torch's
  ``collect_env``: a dozen subprocesses, 0.3 s on 2 cores) gathered once per process in a thread while the
  requests run (:func:`env_info_ahead`), the same dict. lm-eval takes no precomputed environment.
* torch's ``collect_env.get_env_info``, whose fields :func:`pretty_env_info` gathers itself through the same
  module's functions but one: ``get_cuda_module_loading_config`` calls ``torch.cuda.init()``, which on a GPU
  machine puts a CUDA context (0.5-1 GiB) on GPU 0 beside an engine sized to most of it, and in a process whose
  engine vLLM forks makes the forked processes fail. The text is ``get_pretty_env_info()``'s, checked equal on
  this machine (tests/test_lm_eval_compat.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator

CHECKED = ">=0.4.13,<0.5"  # the lm-eval versions these internals were checked against


def full_config(manager: Any, entry: Any) -> dict[str, Any]:
    """A task entry's whole YAML config (includes resolved), as lm-eval's loader reads it."""
    return manager._factory._load_full_config(entry)


def build_task(manager: Any, entry: Any, overrides: dict[str, Any] | None) -> Any:
    """The task of entry built by lm-eval's own loader, with config overrides."""
    return manager._factory.build(entry, overrides=overrides, registry=manager.task_index)


def encode_pairs(lm: Any, requests: list[Any]) -> list[tuple[tuple[str, str], list[int], list[int]]]:
    """((context, continuation), context ids, continuation ids) of each loglikelihood request, exactly as
    ``TemplateLM.loglikelihood`` encodes them: an empty context is the prefix token (BOS or EOS), unless the
    continuation starts with it; otherwise ``TemplateLM._encode_pair``."""
    pairs = []
    for context, continuation in (request.args for request in requests):
        if context == "":
            continuation_enc = lm.tok_encode(continuation, add_special_tokens=False)
            context_enc, continuation_enc = (
                ([lm.prefix_token_id], continuation_enc) if lm.prefix_token_id != continuation_enc[0]
                else (continuation_enc[:1], continuation_enc[1:]))
        else:
            context_enc, continuation_enc = lm._encode_pair(context, continuation)
        pairs.append(((context, continuation), context_enc, continuation_enc))
    return pairs


def add_env_facts(storage: dict[str, Any]) -> None:
    """lm-eval's ``add_env_info(storage)``: the same four fields, gathered as it gathers them, except that
    pretty_env_info comes from :func:`pretty_env_info`, which never initialises CUDA."""
    from lm_eval.loggers.utils import get_commit_from_path
    from lm_eval.utils import is_torch_available, is_transformers_available

    pretty = "N/A (torch not installed)"
    if is_torch_available():
        try:
            pretty = pretty_env_info()
        except Exception as error:  # as lm-eval: the facts never end a run
            pretty = str(error)
    try:
        lm_eval_version = version("lm_eval")
    except Exception as error:
        lm_eval_version = str(error)
    transformers_version = "N/A"
    if is_transformers_available():
        from transformers import __version__ as transformers_version
    storage.update(pretty_env_info=pretty, transformers_version=transformers_version, lm_eval_version=lm_eval_version,
                   upper_git_hash=get_commit_from_path(Path(os.getcwd(), "..")))


def pretty_env_info() -> str:
    """torch's ``collect_env.get_pretty_env_info()`` without a CUDA call: its ``get_env_info`` field by field
    through the module's own functions, except CUDA_MODULE_LOADING, read as that function reads it
    (``os.environ``, which torch's own setenv at CUDA's start does not change) without ``torch.cuda.init()``
    first. ``torch.cuda.is_available()`` counts through NVML in a try (environment.use_nvml_for_cuda_checks).
    On ROCm or an Intel GPU, torch's own function (their fields read the device)."""
    import torch
    from torch.utils import collect_env as torch_env

    if getattr(torch.version, "hip", None) is not None or torch.xpu.is_available():
        return torch_env.get_pretty_env_info()
    run = torch_env.run
    pip_version, pip_packages = torch_env.get_pip_packages(run)
    cuda = torch.cuda.is_available()
    facts = torch_env.SystemEnv(
        torch_version=torch.__version__, is_debug_build=str(torch.version.debug),
        python_version=f"{sys.version.replace(chr(10), ' ')} ({sys.maxsize.bit_length() + 1}-bit runtime)",
        python_platform=torch_env.get_python_platform(), is_cuda_available=str(cuda),
        cuda_compiled_version=torch.version.cuda, cuda_runtime_version=torch_env.get_running_cuda_version(run),
        cuda_module_loading=os.environ.get("CUDA_MODULE_LOADING", "") if cuda else "N/A",
        nvidia_gpu_models=torch_env.get_gpu_info(run), nvidia_driver_version=torch_env.get_nvidia_driver_version(run),
        cudnn_version=torch_env.get_cudnn_version(run), is_xpu_available="False", hip_compiled_version="N/A",
        hip_runtime_version="N/A", miopen_runtime_version="N/A", pip_version=pip_version, pip_packages=pip_packages,
        conda_packages=torch_env.get_conda_packages(run), os=torch_env.get_os(run),
        libc_version=torch_env.get_libc_version(), gcc_version=torch_env.get_gcc_version(run),
        clang_version=torch_env.get_clang_version(run), cmake_version=torch_env.get_cmake_version(run),
        caching_allocator_config=torch_env.get_cachingallocator_config(),
        is_xnnpack_available=torch_env.is_xnnpack_available(), cpu_info=torch_env.get_cpu_info(run))
    return torch_env.pretty_str(facts)


class _Gathered:
    """lm-eval's add_env_info facts, gathered in a daemon thread (a Ctrl-C leaves it behind) at the lowest CPU
    priority, its subprocesses too: on a machine whose cores the engine or a local server keeps busy, they take
    what the evaluation leaves idle."""

    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._gather, daemon=True, name="evalkit-env-info")
        self._thread.start()

    def _gather(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # Linux: a thread's own nice value, which children inherit
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        add_env_facts(self.facts)

    def into(self, storage: dict[str, Any]) -> None:
        if os.getpid() != self._pid:  # a forked child: the thread and its facts are its parent's
            add_env_facts(storage)
            return
        self._thread.join()
        if not self.facts:  # the thread failed: gathered again here, which raises what it raised
            add_env_facts(self.facts)
        storage.update(self.facts)


_GATHERED: dict[str, _Gathered] = {}  # by working directory: upper_git_hash is the folder above it
_GATHERING = threading.Lock()
_AHEAD: contextvars.ContextVar[_Gathered | None] = contextvars.ContextVar("evalkit_env_info", default=None)


def _forget_in_child() -> None:
    """A forked child (vLLM's EngineCore on GPUs) has none of its parent's threads: the facts a gathering thread
    had not finished stay unfinished, and _GATHERING, held by another thread at the fork, would stay held. The
    child gathers its own when asked (:meth:`_Gathered.into` checks the process too)."""
    global _GATHERING
    _GATHERED.clear()
    _GATHERING = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def gather_env_info() -> _Gathered:
    """This process's environment facts for lm-eval's results (torch's collect_env, the versions, the git hash
    above the working directory), gathered once per working directory: they do not change while the process
    runs, and a sweep's later points or a second run on a lent engine reuse them."""
    folder = os.getcwd()
    with _GATHERING:
        if folder not in _GATHERED:
            _GATHERED[folder] = _Gathered()
        return _GATHERED[folder]


def _add_env_info(storage: dict[str, Any]) -> None:
    """lm_eval.evaluator.add_env_info from evalkit's first run in the process on (:func:`env_info_ahead` puts it
    there): the facts gathered ahead where this context has them, else lm-eval's own function now (lm-eval's
    simple_evaluate called by anyone else in the process is left as it was)."""
    from lm_eval.loggers.utils import add_env_info

    ahead = _AHEAD.get()
    if ahead is None:
        add_env_info(storage)
    else:
        ahead.into(storage)


@contextlib.contextmanager
def env_info_ahead() -> Iterator[None]:
    """Within: simple_evaluate's environment facts are this process's (:func:`gather_env_info`), gathered beside
    its requests where no run gathered them before; it waits for them only when it adds them to its results."""
    import lm_eval.evaluator

    lm_eval.evaluator.add_env_info = _add_env_info  # type: ignore[attr-defined]
    token = _AHEAD.set(gather_env_info())
    try:
        yield
    finally:
        _AHEAD.reset(token)
