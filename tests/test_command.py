"""The one command (evalkit/cli.py): `evalkit --help` lists run, validate, tasks, compare, noise and report one line each; each
subcommand reaches its entry point with the same arguments; the old forms keep working, and say once, to a
person at a terminal, which command replaces them. No engine starts.

Run: pytest tests/test_command.py
"""

import os
import pty
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def evalkit(*args, env=None):
    """The console script `evalkit ARGS`, as pyproject.toml installs it."""
    return subprocess.run([sys.executable, "-m", "evalkit.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_console_script_is_the_command():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"evalkit": "evalkit.cli:main"}


def test_help_lists_each_command_on_one_line():
    done = evalkit("--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: evalkit COMMAND")
    listed = [line.split()[0] for line in done.stdout.split("commands:\n")[1].split("\n\n")[0].splitlines()]
    assert listed == ["run", "validate", "tasks", "compare", "noise", "report"]
    assert evalkit().returncode == 2  # no command: the list, as a usage error


def test_an_unknown_command_names_the_closest():
    done = evalkit("comapre", "a", "b")
    assert done.returncode == 2 and done.stderr.strip() == ("evalkit: error: unknown command 'comapre' (did you "
                                                            "mean compare?); commands: run, validate, tasks, compare, "
                                                            "noise, report "
                                                            "(evalkit --help)")


def test_run_is_python_m_evalkit():
    done = evalkit("run", "endpoint.ulr=x")
    assert done.returncode == 2 and done.stderr.startswith("evalkit: error: unknown config key 'endpoint.ulr'")
    job = evalkit("run", "limit=3", "--cfg", "job")
    assert job.returncode == 0 and "limit: 3" in job.stdout
    old = subprocess.run([sys.executable, "-m", "evalkit", "limit=3", "--cfg", "job"], capture_output=True,
                         text=True, timeout=120)
    assert old.returncode == 0 and old.stdout == job.stdout and not old.stderr
    assert "evalkit: error:" not in evalkit("run", "--help").stderr


def test_the_first_console_form_runs_and_says_the_new_one():
    done = evalkit("limit=3", "--cfg", "job")
    assert done.returncode == 0 and "limit: 3" in done.stdout
    assert done.stderr == "evalkit: note: `evalkit key=value ...` is `evalkit run key=value ...`\n"


@pytest.mark.parametrize("command, usage", [
    ("compare", "usage: evalkit compare "), ("noise", "usage: evalkit noise "), ("report", "usage: evalkit report "),
])
def test_each_command_has_its_help_under_its_name(command, usage):
    done = evalkit(command, "--help")
    assert done.returncode == 0 and done.stdout.startswith(usage), done.stdout[:300] + done.stderr[-2000:]


def test_compare_and_report_refuse_bad_input_as_their_modules_do(tmp_path):
    compared = evalkit("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert compared.returncode == 2 and compared.stderr.startswith("evalkit compare: error: ")  # the name typed
    reported = evalkit("report", str(tmp_path))
    assert reported.returncode == 2 and reported.stderr.startswith("evalkit report: error: ")
    noise = evalkit("noise", "cluster.adress=auto")
    assert noise.returncode == 2 and "did you mean cluster.address?" in noise.stderr


def at_a_terminal(*args):
    """python ARGS with stderr on a terminal: (exit code, what reached the terminal)."""
    leader, follower = pty.openpty()
    done = subprocess.run([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=follower, timeout=120)
    os.close(follower)
    text = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        text += chunk
    os.close(leader)
    return done.returncode, text.decode()


@pytest.mark.parametrize("module, command", [
    ("evalkit.compare", "evalkit compare"), ("evalkit.compare.noise", "evalkit noise"),
    ("evalkit.report", "evalkit report"),
])
def test_an_old_module_path_works_and_says_once_what_replaces_it(tmp_path, module, command):
    code, said = at_a_terminal("-m", module, "--help")
    assert code == 0 and said.count(f"is `{command}`") == 1, said
    piped = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and not piped.stderr  # a script reading stderr sees what it always saw


def test_completion_of_runs_keys_reads_the_line_without_the_command():
    env = {**os.environ, "COMP_LINE": "evalkit run max_model_", "COMP_POINT": "22"}
    done = evalkit("-sc", "query=bash", env=env)
    assert done.returncode == 0 and "max_model_len=" in done.stdout, done.stderr[-2000:]
    install = evalkit("run", "-sc", "install=bash")
    assert install.returncode == 0 and "complete -o nospace" in install.stdout


def test_validate_runs_a_runs_checks_and_starts_no_engine(tmp_path):
    done = evalkit("validate", f"output_dir={tmp_path / 'result'}", "limit=2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "evalkit: smollm2-135m-instruct on evalkit_arith, evalkit_facts: every check before the " \
                          "engine passed (no engine was started)\n"
    assert not (tmp_path / "result").exists()


@pytest.mark.parametrize("args, message", [
    (["tasks=[gsm8kk]", "vllm_path=/nope", "tensor_parallel_size=8"], "tensor_parallel_size=8 needs 8 devices"),
    (["tasks=[gsm8kk]", "vllm_path=/nope"], "vllm_path=/nope does not exist"),
    (["tasks=[evalkit_arith,gsm8kk]"], "unknown task 'gsm8kk' (did you mean gsm8k"),  # the tasks are loaded
    (["tensor_parallel_size=4096"], "tensor_parallel_size=4096 needs 4096 devices"),
    (["max_model_len=16", "tasks=[evalkit_facts]"], "max_model_len=16 is too short for task evalkit_facts: its "
                                                     "longest prompt is"),  # every request is built and encoded
    (["-m", "limit=1,2", "tasks=[evalkit_arith],[humaneval]"],
     "limit=1 tasks=[humaneval]: task humaneval runs the code the model writes"),  # each point of a sweep
    (["--cfg", "job"], "--cfg: evalkit validate takes key=value overrides (and -m for a sweep) only"),
])
def test_validate_says_the_first_mistake_in_one_line(tmp_path, args, message):
    done = evalkit("validate", *args)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("evalkit: preparing")]
    assert len(lines) == 1 and lines[0].startswith("evalkit: error: ") and message in lines[0], lines
    assert not (tmp_path / "result").exists()


def test_tasks_lists_the_names_a_run_takes(tmp_path):
    done = evalkit("tasks", "evalkit_")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["evalkit_arith", "task", "evalkit_facts", "task"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my_task.yaml").write_text("task: evalkit_mine\ninclude: " + str(ROOT / "tasks" / "evalkit_arith" / "evalkit_arith.yaml"))
    done = evalkit("tasks", "evalkit_m", "--tasks-dir", str(mine))
    assert done.stdout.split() == ["evalkit_mine", "task"], done.stderr
    assert "gsm8k  " in evalkit("tasks", "gsm8k").stdout  # lm-eval's own


@pytest.mark.parametrize("tolerance", ["-1", "0", "1", "nan"])
def test_report_refuses_a_tolerance_compare_refuses_in_one_line(tmp_path, tolerance):
    done = evalkit("report", str(tmp_path), "--tolerance", tolerance)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"evalkit report: error: --tolerance {float(tolerance):g}: the largest acceptable change of a 0-1 metric "
        "lies in (0, 1), e.g. 0.02"], done.stderr[-2000:]
    assert "exit status:" in evalkit("report", "--help").stdout
