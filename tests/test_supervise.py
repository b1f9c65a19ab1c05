"""OOM back-off policy, failure classification and the run lock (evalkit/run/supervise.py), with fault injection;
where a try's output goes (the run's log, the terminal), with stand-in tries in child processes.

Run: pytest tests/test_supervise.py
"""

import dataclasses
import json
import sys

import pytest

from evalkit.config import ConfigError, EvalConfig, OomRetry
from evalkit.run.results import attach_log
from evalkit.engine.backoff import classify, next_settings, weights_failure
from evalkit.run.supervise import Outcome, RunFailed, RunStopped, root_cause, run_with_retries, supervise

VLLM_ERRORS = {
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": "pressure",
    "ValueError: Free memory on device (10.1/79.3 GiB) on startup is less than desired GPU memory utilization "
    "(0.9, 71.4 GiB).": "pressure",
    "ValueError: Available memory on node 0 (7.5/9.59 GiB) on startup is less than desired CPU memory "
    "utilization (0.9, 8.63 GiB).": "pressure",
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`": "kv_cache",
    "ValueError: To serve at least one request with the model's max seq len (32768), (4.0 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (1.2 GiB).": "kv_cache",
    "OSError: [Errno 12] Cannot allocate memory": "pressure",
    "ValueError: Unsupported architecture FooForCausalLM": None,
    "RuntimeError: Engine core initialization failed. See root cause above.": None,
    # vLLM 0.32, gpu_model_runner.py: logged before it raises CUDA's out-of-memory error
    "Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to free memory for "
    "weights, increasing --tensor-parallel-size, or using --quantization. See https://docs.vllm.ai/en/latest/"
    "configuration/conserving_memory/ for more tips. (original error: CUDA out of memory. Tried to allocate "
    "20.00 MiB.)": "weights",
}


@pytest.mark.parametrize("text, kind", VLLM_ERRORS.items())
def test_classify_memory_failures(text, kind):
    assert classify(text) == kind


def cfg(**kwargs):
    return EvalConfig(**{"model_name": "m", "vllm_path": "/x", **kwargs})


class Faults:
    """An attempt function that fails with the given outcomes in turn, then succeeds."""

    def __init__(self, *failures: Outcome):
        self.failures = list(failures)
        self.seen = []

    def __call__(self, settings, history):
        self.seen.append((settings, len(history)))
        return self.failures.pop(0) if self.failures else Outcome(status="ok", run_dir="/r")


OOM = Outcome(status="memory", message="CUDA out of memory", memory_kind="pressure")
KV = Outcome(status="memory", message="No available memory for the cache blocks", memory_kind="kv_cache")


def test_pressure_lowers_utilization_step_by_step_to_the_floor_then_sequences_then_eager():
    policy = OomRetry(utilization_step=0.1, utilization_floor=0.7, max_num_seqs=[64, 16], eager=True, max_attempts=20)
    faults = Faults(*[OOM] * 5)
    outcome, attempts = run_with_retries(cfg(gpu_memory_utilization=0.9, oom_retry=policy), faults)
    assert outcome.status == "ok"
    assert [a["settings"] for a in attempts] == [
        {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.8, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.7, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.7, "batch_size": 64, "enforce_eager": False},
        {"gpu_memory_utilization": 0.7, "batch_size": 16, "enforce_eager": False},
        {"gpu_memory_utilization": 0.7, "batch_size": 16, "enforce_eager": True},
    ]
    assert [a["status"] for a in attempts] == ["memory"] * 5 + ["ok"]
    assert attempts[0]["error"] == "CUDA out of memory"
    assert [n for _, n in faults.seen] == list(range(6))  # each try is told the earlier ones


def test_back_off_runs_out_and_stops_with_every_try_recorded():
    policy = OomRetry(utilization_step=0.2, utilization_floor=0.5, max_num_seqs=[8], eager=False)
    outcome, attempts = run_with_retries(cfg(gpu_memory_utilization=0.9, oom_retry=policy), Faults(*[OOM] * 10))
    assert outcome.status == "memory" and len(attempts) == 4  # nothing left to lower after these
    assert [a["settings"]["gpu_memory_utilization"] for a in attempts] == [0.9, 0.7, 0.5, 0.5]
    assert attempts[-1]["settings"]["batch_size"] == 8


def test_kv_cache_shortage_skips_lowering_utilization():
    policy = OomRetry(max_num_seqs=[32], eager=True)
    _, attempts = run_with_retries(cfg(gpu_memory_utilization=0.9, oom_retry=policy), Faults(KV, KV))
    assert [a["settings"] for a in attempts] == [
        {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.9, "batch_size": 32, "enforce_eager": False},
        {"gpu_memory_utilization": 0.9, "batch_size": 32, "enforce_eager": True},
    ]


def test_sequence_steps_only_go_down():
    policy = OomRetry(max_num_seqs=[64, 16, 4], eager=False)
    start = cfg(gpu_memory_utilization=0.5, batch_size=16, oom_retry=policy)
    assert next_settings(start, "pressure", policy).batch_size == 4
    assert next_settings(dataclasses.replace(start, batch_size=4), "pressure", policy) is None


def test_weights_that_do_not_fit_are_not_backed_off():
    assert next_settings(cfg(gpu_memory_utilization=0.9), "weights", OomRetry()) is None


def test_hf_backs_off_its_batch_only_and_never_above_its_default():
    """engine=hf has no utilization to lower and no CUDA graphs: only the batch helps, and a step that would
    raise it above HF's default (16) is no step."""
    from evalkit.engine.hf.engine import DEFAULT_BATCH_SIZE

    policy = OomRetry(max_num_seqs=[64, 16, 4], eager=True, max_attempts=20)
    faults = Faults(*[OOM] * 5)
    outcome, attempts = run_with_retries(cfg(engine="hf", gpu_memory_utilization=0.9, oom_retry=policy), faults)
    assert DEFAULT_BATCH_SIZE == 16
    assert [a["settings"] for a in attempts] == [
        {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.9, "batch_size": 4, "enforce_eager": False},
    ]
    assert outcome.status == "memory"  # nothing left that could help
    assert next_settings(cfg(engine="hf", batch_size=8), "pressure", policy).batch_size == 4


@pytest.mark.parametrize("failure", [Outcome(status="error", message="Unsupported architecture"),
                                     Outcome(status="config", message="unknown task 'x'")])
def test_other_failures_are_not_retried(failure):
    faults = Faults(failure, OOM)
    outcome, attempts = run_with_retries(cfg(), faults)
    assert outcome is failure and len(attempts) == 1 and len(faults.seen) == 1


def test_disabled_back_off_tries_once():
    outcome, attempts = run_with_retries(cfg(oom_retry=OomRetry(enabled=False)), Faults(OOM))
    assert outcome.status == "memory" and len(attempts) == 1


def test_max_attempts_caps_the_tries():
    outcome, attempts = run_with_retries(cfg(oom_retry=OomRetry(max_attempts=3)), Faults(*[OOM] * 10))
    assert len(attempts) == 3


def test_root_cause_is_read_off_the_engine_log():
    log = "\n".join([
        "(EngineCore pid=1) INFO starting",
        "(VllmWorker-0 pid=2) ERROR [multiproc_executor.py:953] ValueError: Available memory on node 0 (7.5/9.59 GiB)"
        " on startup is less than desired CPU memory utilization (0.9, 8.63 GiB).",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ])
    assert root_cause(log).startswith("ValueError: Available memory on node 0")
    assert root_cause("x\nKeyError: 'foo'\nRuntimeError: Engine core initialization failed.") == \
        "RuntimeError: Engine core initialization failed."
    assert root_cause("all fine") is None
    weights = "\n".join([  # vLLM 0.32's EngineCore output when the weights do not fit, as it prints it
        "(EngineCore_DP0 pid=7) ERROR 12-01 18:30:39 [gpu_model_runner.py:5145] Failed to load model - not enough "
        "GPU memory. Try lowering --gpu-memory-utilization to free memory for weights, increasing "
        "--tensor-parallel-size, or using --quantization. (original error: CUDA out of memory.)",
        "(EngineCore_DP0 pid=7) ERROR 12-01 18:30:39 [core.py:1510] EngineCore failed to start.",
        "(EngineCore_DP0 pid=7) ERROR 12-01 18:30:39 [core.py:1510] torch.OutOfMemoryError: CUDA out of memory.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert root_cause(weights).startswith("Failed to load model - not enough GPU memory. Try lowering")


def traceback(process: str, frames: list[tuple[str, str]], error: str) -> list[str]:
    """A traceback as vLLM 0.32 logs it from one of its engine's processes: each line with the process's prefix."""
    lines = ["Traceback (most recent call last):"]
    for path, function in frames:
        lines += [f'  File "/venv/lib/python3.11/site-packages/vllm/{path}", line 1, in {function}', "    call()"]
    return [f"({process}) ERROR 12-03 07:46:22 [core.py:1510] {line}" for line in lines + [error]]


V2_LOAD = [("v1/engine/core.py", "__init__"), ("v1/worker/gpu_worker.py", "load_model"),
           ("v1/worker/gpu/model_runner.py", "load_model"), ("model_executor/model_loader/base_loader.py", "load_model"),
           ("model_executor/model_loader/default_loader.py", "load_weights")]
CUDA_OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.12 GiB. GPU 0 has a total capacity of " \
           "79.19 GiB of which 612.00 MiB is free."


def test_an_out_of_memory_error_raised_while_vllm_loads_the_weights_is_weights_whichever_runner_raised_it():
    """Model Runner V2's load_model lets a plain torch.OutOfMemoryError through: read off its traceback, it
    fails at once in one line naming tensor_parallel_size; the same error elsewhere (a forward pass) is pressure,
    and another process's traceback in between does not mix with it."""
    engine_core = traceback("EngineCore pid=7", V2_LOAD, CUDA_OOM)
    other = traceback("Worker_TP1 pid=9", [("v1/worker/gpu_worker.py", "execute_model")], "KeyError: 'x'")
    log = "\n".join(engine_core[:4] + other + engine_core[4:]
                    + ["RuntimeError: Engine core initialization failed. See root cause above."])
    cause = root_cause(log)
    assert classify(cause) == "weights"
    assert weights_failure(cause) == ("the model's weights do not fit in one engine's GPU memory: raise "
                                      "tensor_parallel_size (or use a smaller dtype) (vLLM, loading them: "
                                      f"OutOfMemoryError: {CUDA_OOM.split(': ', 1)[1]})")
    forward = [("v1/engine/core.py", "step"), ("v1/worker/gpu/model_runner.py", "execute_model")]
    assert classify(root_cause("\n".join(traceback("EngineCore pid=7", forward, CUDA_OOM)))) == "pressure"


# --- the try's output: every line to the run's log, evalkit's own lines to the terminal ---
# The supervisor starts `sys.executable -m evalkit.run.attempt SPEC OUTCOME FD`; here sys.executable is a stand-in
# that runs FAKE_TRY instead: vLLM-like lines, evalkit's progress lines, then each try's planned ending.
FAKE_TRY = r'''
import json, os, sys
spec_file, outcome_file = sys.argv[-3:-1]
spec = json.loads(open(spec_file).read())
cfg, plan = spec["config"], PLAN[len(spec["attempts"])]
say = lambda line, stream=sys.stdout: print(line, file=stream, flush=True)
say("INFO 05-01 12:00:00 [llm.py:340] Supported tasks: ['generate']")
say("(EngineCore pid=77) INFO 05-01 12:00:01 [core.py:90] Initializing a V1 LLM engine")
for done in range(1, 5):
    say(f"evalkit: progress loglikelihood {done}/4 requests, 100 tok/s, ETA 0:0{4 - done}", sys.stderr)
say("evalkit: done loglikelihood 4/4 requests in 0.1 s, 100 tok/s", sys.stderr)
ends = {
    "oom": ["(EngineCore pid=77) ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            "RuntimeError: Engine core initialization failed. See root cause above."],
    "error": ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
              "ValueError: Unsupported architecture FooForCausalLM"],
    "weights": ["(EngineCore_DP0 pid=77) ERROR 05-01 12:00:02 [gpu_model_runner.py:5145] Failed to load model - "
                "not enough GPU memory. Try lowering --gpu-memory-utilization to free memory for weights, "
                "increasing --tensor-parallel-size, or using --quantization. (original error: CUDA out of memory.)",
                "(EngineCore_DP0 pid=77) ERROR 05-01 12:00:02 [core.py:1510] torch.OutOfMemoryError: CUDA out of memory.",
                "RuntimeError: Engine core initialization failed. See root cause above. "
                "Failed core proc(s): {'EngineCore_DP0': 1}"],
}
for line in ends.get(plan, []):
    say(line)
outcome = ({"status": "error", "message": ends[plan][-1]} if plan in ends
           else {"status": plan, "message": "unknown task 'x'"})
if plan == "ok":
    outcome["run_dir"] = os.path.join(cfg["output_dir"], cfg["model_name"], "run1")
    os.makedirs(outcome["run_dir"])
open(outcome_file, "w").write(json.dumps(outcome))
'''


@pytest.fixture
def fake_tries(tmp_path, monkeypatch):
    """fake_tries("oom", "ok") makes the next supervise() see those tries; returns the config to run."""
    from evalkit.run import supervise as module

    monkeypatch.setattr(module.preflight, "check_devices", lambda *args: None)
    monkeypatch.setattr(module.preflight, "check_model", lambda cfg, *args: cfg.gpu_memory_utilization)
    monkeypatch.setattr(module.preflight, "resolve_model_path", lambda path: path)

    def plan(*tries):
        script = tmp_path / "fake_try.py"
        script.write_text(f"PLAN = {list(tries)!r}\n{FAKE_TRY}")
        python = tmp_path / "python"
        python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
        python.chmod(0o755)
        monkeypatch.setattr(sys, "executable", str(python))
        return cfg(output_dir=str(tmp_path / "result"))

    return plan


def test_terminal_shows_evalkit_lines_and_the_run_folder_gets_every_try_in_engine_log(fake_tries, capsys, tmp_path):
    run_dir = supervise(fake_tries("oom", "ok"))
    assert run_dir == tmp_path / "result" / "m" / "run1"
    shown = capsys.readouterr().err.splitlines()
    assert all(line.startswith("evalkit: ") for line in shown), shown
    assert [line for line in shown if "progress" in line] == [  # not a TTY: one per label per 30 s
        "evalkit: progress loglikelihood 1/4 requests, 100 tok/s, ETA 0:03"]
    assert shown.count("evalkit: done loglikelihood 4/4 requests in 0.1 s, 100 tok/s") == 2
    assert shown[2].startswith("evalkit: try 1 ran out of memory: OutOfMemoryError: CUDA out of memory. Tried")
    assert shown[3].startswith("evalkit: try 2 with {'gpu_memory_utilization': 0.8")
    assert shown[-1].startswith("evalkit: succeeded on try 2")
    log = (run_dir / "engine.log").read_text().splitlines()
    assert [line.split(" at ")[0] for line in log if line.startswith("=== try")] == ["=== try 1", "=== try 2"]
    assert len(log) == 2 + 7 + 2 + 7 and "Initializing a V1 LLM engine" in log[2]
    assert "CUDA out of memory" in log[8] and log[-1] == "evalkit: done loglikelihood 4/4 requests in 0.1 s, 100 tok/s"
    assert not (tmp_path / "result" / "m" / ".logs").exists()


def test_a_failed_run_shows_its_failing_lines_and_keeps_its_log(fake_tries, capsys, tmp_path):
    with pytest.raises(RunFailed, match="Unsupported architecture FooForCausalLM"):
        supervise(fake_tries("error"))
    shown = capsys.readouterr().err.splitlines()
    start = shown.index("evalkit: engine error: ValueError: Unsupported architecture FooForCausalLM")
    assert shown[start + 1] == "evalkit: last 10 lines of the log:"  # all of this try's lines, indented
    assert shown[start + 2].startswith("    INFO 05-01 12:00:00") and shown[start + 3].startswith("    (EngineCore")
    assert shown[-2] == "    ValueError: Unsupported architecture FooForCausalLM"
    (log,) = (tmp_path / "result" / "m" / ".logs").iterdir()
    assert shown[-1] == f"evalkit: full log: {log}"
    text = log.read_text()
    assert text.startswith("=== try 1 at ") and "Initializing a V1 LLM engine" in text and "Traceback" in text


def test_weights_that_do_not_fit_fail_at_once_saying_what_to_do(fake_tries, capsys):
    with pytest.raises(RunFailed) as failed:
        supervise(fake_tries("weights", "ok"))
    assert str(failed.value).startswith("the model's weights do not fit in one engine's GPU memory: raise "
                                        "tensor_parallel_size (or use a smaller dtype) (vLLM: Failed to load model")
    assert str(failed.value).count(": error") == 1  # one try, no back-off
    assert "ran out of memory" not in capsys.readouterr().err


@pytest.mark.parametrize("ending, error", [("config", ConfigError), ("stopped", RunStopped)])
def test_bad_input_or_a_stop_leaves_no_log(fake_tries, capsys, tmp_path, ending, error):
    with pytest.raises(error):
        supervise(fake_tries(ending))
    assert "full log" not in capsys.readouterr().err
    assert not (tmp_path / "result").exists()  # nothing written, the folders made for the lock removed


# --- the next try starts once the last try's GPU memory is back (GPUs faked at NVML, tests/fake_gpus.py) ---
# Try 1's engine holds 70 GiB of the GPU's 79 free and fails for lack of memory; one of its engine processes is
# outside the try's group and its output pipe (as a data-parallel actor's EngineCore is) and gives the memory back
# GIVE_BACK_AFTER seconds after the try ended ("never": it keeps it). Each try says how much it found free as it started.
GPU_TRY = r'''
import json, os, subprocess, sys
spec_file, outcome_file = sys.argv[-3:-1]
spec, gpus_file = json.loads(open(spec_file).read()), os.environ["FAKE_NVML"][1:]
gpus = json.loads(open(gpus_file).read())
print(f"evalkit: try {len(spec['attempts']) + 1} found {gpus[0]['free'] >> 30} GiB free", file=sys.stderr, flush=True)
WRITE = ("import os, sys, time; time.sleep(float(sys.argv[3])); open(sys.argv[1] + '.new', 'w').write(sys.argv[2]); "
         "os.replace(sys.argv[1] + '.new', sys.argv[1])")
if spec["attempts"]:
    run_dir = os.path.join(spec["config"]["output_dir"], spec["config"]["model_name"], "run1")
    os.makedirs(run_dir)
    outcome = {"status": "ok", "run_dir": run_dir}
else:
    held = [dict(gpus[0], free=9 << 30)]
    subprocess.run([sys.executable, "-c", WRITE, gpus_file, json.dumps(held), "0"], check=True)
    if os.environ["GIVE_BACK_AFTER"] != "never":
        subprocess.Popen([sys.executable, "-c", WRITE, gpus_file, json.dumps(gpus), os.environ["GIVE_BACK_AFTER"]],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outcome = {"status": "error", "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
open(outcome_file, "w").write(json.dumps(outcome))
'''


@pytest.fixture
def gpu_tries(tmp_path, monkeypatch):
    """A supervisor on one faked H100 with 79 GiB free, whose tries are GPU_TRY; returns the config to run."""
    from evalkit.run import supervise as module
    from tests.fake_gpus import on_fake_gpus

    on_fake_gpus(monkeypatch, tmp_path / "machine", [])
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps([{"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0a0b", "total": 80 << 30,
                                 "free": 79 << 30}]))
    monkeypatch.setenv("FAKE_NVML", f"@{nvml}")
    (tmp_path / "machine" / "dev" / "nvidia0").touch()
    monkeypatch.setattr(module.preflight, "check_devices", lambda *args: None)
    monkeypatch.setattr(module.preflight, "check_model", lambda cfg, *args: cfg.gpu_memory_utilization)
    monkeypatch.setattr(module.preflight, "resolve_model_path", lambda path: path)
    script, python = tmp_path / "gpu_try.py", tmp_path / "python"
    script.write_text(GPU_TRY)
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    return cfg(output_dir=str(tmp_path / "result"))


def test_the_next_try_starts_once_the_last_tries_gpu_memory_is_back(gpu_tries, capsys, monkeypatch):
    monkeypatch.setenv("GIVE_BACK_AFTER", "1.5")
    supervise(gpu_tries)
    shown = capsys.readouterr().err
    assert "evalkit: try 1 found 79 GiB free" in shown
    assert "evalkit: try 2 found 79 GiB free" in shown, shown
    assert "after the try ended" not in shown


def test_gpu_memory_that_does_not_come_back_is_waited_for_a_bounded_time_and_said(gpu_tries, capsys, monkeypatch):
    from evalkit.run import supervise as module

    monkeypatch.setenv("GIVE_BACK_AFTER", "never")
    monkeypatch.setattr(module, "GPU_MEMORY_WAIT", 1.0)
    supervise(gpu_tries)
    shown = capsys.readouterr().err
    assert ("evalkit: GPU 0 (NVIDIA H100 80GB HBM3) has 9.0 GiB free 1 s after the try ended, 79.0 GiB before the "
            "run: another process holds the rest, or one of the engine's still ends; what follows fits itself to "
            "what is free") in shown, shown
    assert "evalkit: try 2 found 9 GiB free" in shown


def test_attach_log_moves_the_log_and_never_replaces_a_file(tmp_path):
    log, run_dir = tmp_path / "x.log", tmp_path / "run"
    run_dir.mkdir()
    log.write_text("a\n")
    assert attach_log(run_dir, log) == run_dir / "engine.log" and not log.exists()
    log.write_text("b\n")
    with pytest.raises(FileExistsError):
        attach_log(run_dir, log)
    assert (run_dir / "engine.log").read_text() == "a\n" and log.exists()


# --- a stop from outside, to the supervisor: a try that ignores SIGTERM is killed, nothing is left ---
HANGING_TRY = r'''
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("evalkit: the try runs", file=sys.stderr, flush=True)
time.sleep(600)
'''
SUPERVISOR = r'''
import sys
from evalkit.config import EvalConfig
from evalkit.run import supervise as module

module.preflight.check_devices = lambda *args: None
module.preflight.check_model = lambda cfg, *args: cfg.gpu_memory_utilization
module.preflight.resolve_model_path = lambda path: path
sys.executable = sys.argv[1]  # the stand-in try
try:
    module.supervise(EvalConfig(model_name="m", vllm_path="/x", output_dir=sys.argv[2]))
except module.RunStopped as error:
    print(f"evalkit: error: stopped: {error}", file=sys.stderr, flush=True)
    sys.exit(error.exit_code)
'''


@pytest.mark.parametrize("signals", [1, 2])
def test_a_try_that_ignores_the_stop_is_killed_and_leaves_nothing(tmp_path, signals):
    """Ctrl-C once: SIGTERM to the try's group, SIGKILL 10 s later (the try ignores SIGTERM); twice: SIGKILL at
    once. Either way the run ends with its one line, no process of the try's group and no temporary folder."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    from evalkit.engine.machine.process_group import live_members

    (tmp_path / "try.py").write_text(HANGING_TRY)
    (tmp_path / "supervisor.py").write_text(SUPERVISOR)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'try.py'} \"$@\"\n")
    python.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    run = subprocess.Popen([sys.executable, str(tmp_path / "supervisor.py"), str(python), str(tmp_path / "result")],
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert run.stderr.readline() == "evalkit: the try runs\n"
    (try_pid,) = [c.pid for c in psutil.Process(run.pid).children()]
    signalled = time.monotonic()
    for _ in range(signals):
        run.send_signal(signal.SIGINT)
        time.sleep(0.2)
    assert run.wait(timeout=60) == 130
    print(f"\n{signals} SIGINT to a supervisor whose try ignores SIGTERM: exited {time.monotonic() - signalled:.1f} s later")
    assert run.stderr.read().strip() == "evalkit: error: stopped: by SIGINT; finished answers are kept for a rerun"
    assert live_members(try_pid) == []
    assert list((tmp_path / "tmp").iterdir()) == [] and not (tmp_path / "result").exists()


# --- the kernel's out-of-memory killer: the machine's memory, not the GPUs' (its counter faked in a file) ---
# The try counts one more kill in the kernel's counter (VMSTAT, /proc/vmstat's oom_kill) where KILLED_BY_OOM is
# set, as the kernel does when its out-of-memory killer ends a process; then it dies by SIGKILL ("try") or reports
# its engine dead ("engine", an EngineCore killed under it).
OOM_TRY = r'''
import json, os, re, signal, sys
vmstat = os.environ["FAKE_VMSTAT"]
if os.environ.get("KILLED_BY_OOM"):
    count = int(re.search(r"oom_kill (\d+)", open(vmstat).read()).group(1))
    open(vmstat, "w").write(f"pgfault 10\noom_kill {count + 1}\n")
if os.environ["KILLED"] == "engine":
    print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): "
          "{'EngineCore_DP0': -9}", flush=True)
    open(sys.argv[-2], "w").write(json.dumps({"status": "error", "message": "RuntimeError: Engine core "
                                              "initialization failed. See root cause above."}))
else:
    os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.fixture
def oom_try(tmp_path, monkeypatch):
    """oom_try(killed, by_oom, on_gpus): the Outcome of one try of OOM_TRY."""
    from evalkit.run import supervise as module

    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 10\noom_kill 3\n")
    monkeypatch.setattr(module, "VMSTAT", str(vmstat))
    monkeypatch.setenv("FAKE_VMSTAT", str(vmstat))
    (tmp_path / "try.py").write_text(OOM_TRY)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'try.py'} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))

    def run(killed: str, by_oom: bool, on_gpus: bool) -> Outcome:
        monkeypatch.setenv("KILLED", killed)
        if by_oom:
            monkeypatch.setenv("KILLED_BY_OOM", "1")
        else:
            monkeypatch.delenv("KILLED_BY_OOM", raising=False)
        return module.Attempt(cfg(), [], on_line=lambda line: None, on_gpus=on_gpus).wait()

    return run


def test_the_kernels_oom_killer_on_a_gpu_run_fails_in_one_line_naming_the_machines_memory(oom_try):
    """Lowering gpu_memory_utilization (four full restarts of a TP=4 engine) cannot give the machine memory."""
    outcome = oom_try("try", by_oom=True, on_gpus=True)
    assert outcome.status == "error" and outcome.message == (
        "the kernel's out-of-memory killer ended the try (SIGKILL): the machine's memory ran out; that is the "
        "machine's memory, not the GPUs', which no smaller GPU setting frees: stop what else holds it, or run where "
        "more is free")
    engine = oom_try("engine", by_oom=True, on_gpus=True)
    assert engine.status == "error" and engine.message.startswith(
        "the kernel's out-of-memory killer ended a process of the try: the machine's memory ran out (not the GPUs') "
        "<- RuntimeError: Engine core initialization failed.")
    _, attempts = run_with_retries(cfg(), lambda settings, history: outcome)
    assert len(attempts) == 1


def test_oom_kills_on_a_cpu_engine_back_off_and_a_sigkill_from_outside_is_not_retried(oom_try):
    """On vLLM's CPU build the machine's memory is the engine's (gpu_memory_utilization sizes its KV cache there):
    the back-off applies. A SIGKILL the kernel's counter does not show is someone's, not a lack of memory."""
    cpu = oom_try("try", by_oom=True, on_gpus=False)
    assert (cpu.status, cpu.memory_kind) == ("memory", "pressure")
    assert cpu.message == "the kernel's out-of-memory killer ended the try (SIGKILL): the machine's memory ran out"
    engine = oom_try("engine", by_oom=True, on_gpus=False)
    assert (engine.status, engine.memory_kind) == ("memory", "pressure")
    for on_gpus in (True, False):
        outside = oom_try("try", by_oom=False, on_gpus=on_gpus)
        assert outside.status == "error" and outside.message == (
            "the try was killed by SIGKILL from outside (not by evalkit, nor by the kernel's out-of-memory killer)")
    assert oom_try("engine", by_oom=False, on_gpus=True).status == "error"


# --- on a shared node, the wait after a try is for the engine's own GPUs (GPUs faked at NVML) ---
# Eight H100s; the run's engine takes the first four (tensor_parallel_size=4). While try 1 runs, another job grows
# on GPU 7 and keeps it; try 1's own GPUs have their memory back at once.
NEIGHBOUR_TRY = r'''
import json, os, sys
spec_file, outcome_file = sys.argv[-3:-1]
spec, gpus_file = json.loads(open(spec_file).read()), os.environ["FAKE_NVML"][1:]
if spec["attempts"]:
    run_dir = os.path.join(spec["config"]["output_dir"], spec["config"]["model_name"], "run1")
    os.makedirs(run_dir)
    outcome = {"status": "ok", "run_dir": run_dir}
else:
    gpus = json.loads(open(gpus_file).read())
    gpus[7]["free"] = 20 << 30
    open(gpus_file, "w").write(json.dumps(gpus))
    outcome = {"status": "error", "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
open(outcome_file, "w").write(json.dumps(outcome))
'''


def test_after_a_try_the_supervisor_waits_for_its_engines_gpus_not_a_neighbours(tmp_path, monkeypatch, capsys):
    from evalkit.run import supervise as module
    from tests.fake_gpus import on_fake_gpus

    nodes = [{"name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i}", "total": 80 << 30, "free": 79 << 30}
             for i in range(8)]
    on_fake_gpus(monkeypatch, tmp_path / "machine", nodes)
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps(nodes))
    monkeypatch.setenv("FAKE_NVML", f"@{nvml}")
    monkeypatch.setattr(module.preflight, "check_devices", lambda *args: None)
    monkeypatch.setattr(module.preflight, "check_model", lambda cfg, *args: cfg.gpu_memory_utilization)
    monkeypatch.setattr(module.preflight, "resolve_model_path", lambda path: path)
    monkeypatch.setattr(module, "GPU_MEMORY_WAIT", 2.0)
    (tmp_path / "try.py").write_text(NEIGHBOUR_TRY)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'try.py'} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    supervise(cfg(output_dir=str(tmp_path / "result"), tensor_parallel_size=4))
    shown = capsys.readouterr().err
    assert "evalkit: succeeded on try 2" in shown and "GPU 7" not in shown and "GiB free" not in shown, shown

    from evalkit.run.supervise import engine_devices

    visible = module.environment.devices_now()
    assert [g.uuid for g in engine_devices(cfg(tensor_parallel_size=4), visible)] == [f"GPU-{i}" for i in range(4)]
    assert len(engine_devices(cfg(tensor_parallel_size=2, data_parallel_size=2), visible)) == 4  # a Ray started here
    from evalkit.config import Cluster, Endpoint

    assert len(engine_devices(cfg(data_parallel_size=2, cluster=Cluster(address="auto")), visible)) == 8  # Ray's choice
    assert len(engine_devices(cfg(engine="hf"), visible)) == 1
    assert engine_devices(cfg(engine="served", endpoint=Endpoint(url="http://127.0.0.1:1/v1")), visible) == []
