"""`--help` speaks to users: evalkit's own page (conf/hydra/help/evalkit.yaml), not Hydra's, and compare's page
says what it answers, with examples and its exit codes. No engine starts.

Run: pytest tests/test_help.py
"""

import re
import subprocess
import sys

from evalkit.config import EvalConfig, model_presets


def help_of(*args):
    done = subprocess.run([sys.executable, "-m", *args, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def key_values(page):
    """key -> value of the "Main keys" lines: two-space indent, the key, its value."""
    return dict(re.findall(r"^  ([a-z_]+) {2,}(\S.*)$", page, re.MULTILINE))


def test_evalkit_help_is_evalkits_own_page():
    page = help_of("evalkit")
    assert "powered by hydra" not in page.lower()
    assert page.startswith("evalkit: measures the accuracy of an LLM served by vLLM")
    assert page.count("python -m evalkit") >= 3  # the usage and three examples
    assert "python -m evalkit -m " in page  # a sweep among them
    assert "result/smollm2-135m-instruct/<YYYYmmdd-HHMMSS>/" in page and "results.json" in page
    assert "Exit codes:" in page
    assert all(preset in page for preset in model_presets())


def test_evalkit_help_shows_the_defaults_of_the_schema_and_the_embedded_preset():
    keys = key_values(help_of("evalkit"))
    defaults = EvalConfig(model_name="x", vllm_path="x")
    for name in ("max_model_len", "max_tokens", "tensor_parallel_size", "data_parallel_size", "engine",
                 "output_dir"):
        assert keys[name] == str(getattr(defaults, name)), name
    assert keys["model"] == "smollm2-135m-instruct"
    assert keys["vllm_path"] == "embedded://smollm2-135m-instruct"
    assert keys["dtype"] == "float32" and keys["limit"] == "None"


def test_evalkit_help_shows_the_values_of_the_overrides_given():
    keys = key_values(help_of("evalkit", "model=qwen2-7b", "max_model_len=8192"))
    assert keys["model"] == "qwen2-7b" and keys["max_model_len"] == "8192"


def test_compare_help_says_what_it_answers_with_examples_and_exit_codes():
    page = help_of("evalkit.compare")
    assert "Stage 5" not in page
    assert "Are two runs' scores the same within a tolerance, and if not, why did they change?" in page
    assert "examples:\n  python -m evalkit.compare " in page
    assert "--locate" in page.split("examples:")[1]
    codes = page.split("exit codes:")[1]
    assert re.search(r"^  0  no row .* is worse or changed", codes, re.MULTILINE)
    assert re.search(r"^  1  a row is worse .* or changed", codes, re.MULTILINE)
    assert re.search(r"^  2  unusable input", codes, re.MULTILINE)


def test_help_of_weights_without_a_preset_shows_them_without_one():
    page = help_of("evalkit", "vllm_path=/models/Mistral-7B")
    values = key_values(page)
    assert values["model"] == "None" and values["vllm_path"] == "/models/Mistral-7B", values
    assert "evalkit validate [-m] [key=value ...]" in page
