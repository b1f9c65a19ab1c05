"""`python -m evalkit` on bad input: one line on stderr, exit 2, nothing written. No engine starts.

Run: pytest tests/test_cli.py
"""

import subprocess
import sys

import pytest


def evalkit(tmp_path, *args):
    cmd = [sys.executable, "-m", "evalkit", f"output_dir={tmp_path / 'result'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["model=qwen2-7b", "vllm_path=/nonexistent"], "vllm_path=/nonexistent does not exist"),
    (["model=qwen9"], "unknown model preset 'qwen9'"),
    (["max_tokenz=5"], "unknown config key 'max_tokenz' (did you mean max_tokens"),
    (["tensor_parallel_size=4096"], "tensor_parallel_size=4096 but this machine has"),
    (["max_model_len=100000"], "max_model_len=100000 exceeds what smollm2-135m-instruct supports (8192"),
    (["tasks=[evalkit_arith,gsm8kk]"], "unknown task 'gsm8kk' (did you mean gsm8k"),
    (["model=qwen2-7b", "vllm_path=''"], "vllm_path is not set"),
])
def test_bad_input_fails_before_the_engine_with_one_line(tmp_path, args, message):
    done = evalkit(tmp_path, *args)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("evalkit: error: ")]
    assert errors == [lines[-1]] and message in errors[0]  # one line, the last
    # the only other line allowed: the embedded model being prepared on first use
    assert all(line.startswith("evalkit: preparing the embedded model") for line in lines[:-1]), lines
    assert not (tmp_path / "result").exists() or not any((tmp_path / "result").rglob("*"))
