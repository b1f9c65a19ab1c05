"""Every mistake on the command line is one line naming the key and the closest valid key or value, exit 2
(evalkit/overrides.py): before Hydra composes, under ``--cfg job``, in a sweep, and for evalkit.compare.noise.
No engine starts.

Run: pytest tests/test_overrides.py
"""

import socket
import subprocess
import sys

import pytest

from evalkit.config import ConfigError
from evalkit.overrides import arguments_to_check, check_overrides, prepared


@pytest.mark.parametrize("override, message", [
    ("endpoint.ulr=x", "unknown config key 'endpoint.ulr' (did you mean endpoint.url?)"),
    ("cluster.adress=auto", "unknown config key 'cluster.adress' (did you mean cluster.address?)"),
    ("oom_retry.enable=false", "unknown config key 'oom_retry.enable' (did you mean oom_retry.enabled?)"),
    ("tensor_parallel_size=four", "tensor_parallel_size=four must be a whole number (did you mean "
                                  "tensor_parallel_size=4?)"),
    ("tasks=gsm8k", "tasks=gsm8k must be a list: pass tasks=[gsm8k]"),
    ("modle=qwen2-7b", "unknown config key 'modle' (did you mean model,"),
    ("Model=qwen2-7b", "unknown config key 'Model' (did you mean model?)"),
    ("dtype=bf16", "(did you mean dtype=bfloat16?)"),
    ("dtype=fp16", "(did you mean dtype=float16?)"),
    ("engine=serve", "(did you mean engine=served?)"),
    ("endpoint=x", "endpoint is a group of keys, not a value: pass endpoint.NAME=x"),
    ("max_model_len=null", "max_model_len=null must be a whole number"),
    ("gpu_memory_utilization=most", "gpu_memory_utilization=most must be a number"),
    ("dtype=float32,bf16", "(did you mean dtype=bfloat16?)"),  # every value of a sweep
    ("oom_retry.max_attempts=3,lots", "oom_retry.max_attempts=lots must be a whole number"),
    ("tasks=gsm8k,arc_easy", "pass tasks=[gsm8k,arc_easy] (no spaces; a sweep over them, one at a time, is -m "
                             "tasks=[gsm8k],[arc_easy])"),  # every task kept
    ("engine_kwargs.enforce_eager=false", "pass +engine_kwargs.enforce_eager=false"),
    ("sampling_kwargs.top_p=0.9", "pass +sampling_kwargs.top_p=0.9"),
    ("model=qwen2-7b-chat", "(did you mean qwen2-7b-instruct,"),
    ("model=llama3-8b-chat", "(did you mean llama3-8b-instruct,"),
    ("model=vllm", "model=vllm is lm-eval's backend; here model= picks a preset, and vLLM is engine=vllm"),
    ("tasks=[list]", "tasks=[list] would run a task named so; to list the tasks: evalkit tasks"),
    ("tasks=list", "to list the tasks: evalkit tasks"),
])
def test_each_mistake_is_one_line_naming_the_closest_key_or_value(override, message):
    with pytest.raises(ConfigError) as info:
        check_overrides([override])
    assert message in str(info.value) and "\n" not in str(info.value)
    if "adds a key to" not in str(info.value):  # a free mapping's (engine_kwargs) new key is the one "+key="
        assert "+" not in str(info.value).split("(")[0]  # never Hydra's "+key=" form for a key of the schema


def test_good_overrides_pass():
    check_overrides(["model=yi-6b", "tensor_parallel_size=2", "endpoint.url=http://h:1/v1", "cluster.address=auto",
                     "oom_retry.enabled=false", "oom_retry.max_attempts=3", "tasks=[gsm8k]", "limit=0.5",
                     "dtype=bfloat16,float16", "+engine_kwargs.enforce_eager=true", "+engine_kwargs.x=1",
                     "divergence_reference=null", "temperature=0", "output_dir=${oc.env:HOME}", "hydra.verbose=true"])


@pytest.mark.parametrize("flag, answer", [
    ("pretrained=/m", "the weights are vllm_path=/path/or/hub-id"),
    ("include_path=/t", "more task folders are tasks_dirs=[DIR]"),
    ("device=cuda:0", "choose them with CUDA_VISIBLE_DEVICES"),
    ("max_gen_toks=256", "the ceiling on new tokens is max_tokens=N"),
    ("model_args=pretrained=x", "each of lm-eval's model_args is its own key here"),
    ("gen_kwargs=top_p=0.9", "+sampling_kwargs.NAME=VALUE"),
    ("output_path=out", "output_dir=DIR"),
    ("bootstrap_iters=100000", "1000 resamples"),
])
def test_lm_evals_flags_are_answered_with_the_evalkit_key(flag, answer):
    with pytest.raises(ConfigError) as info:
        check_overrides([flag])
    said = str(info.value)
    assert said.startswith(f"{flag.split('=')[0]} is lm-eval's; ") and answer in said and "\n" not in said


def test_a_list_the_shell_split_at_a_space_is_one_override_again():
    from evalkit.config import compose_config

    words = prepared(["-m", "tasks=[gsm8k,", "arc_easy]", "limit=2"])
    assert words == ["-m", "tasks=[gsm8k, arc_easy]", "limit=2"]
    assert compose_config(arguments_to_check(words)).tasks == ["gsm8k", "arc_easy"]
    assert prepared(["tasks=[a,", "--cfg", "job"]) == ["tasks=[a,", "--cfg", "job"]  # an option ends it
    assert prepared(["tasks=[a,", "limit=2"]) == ["tasks=[a,", "limit=2"]  # so does another override
    assert prepared(["system_instruction=Answer [briefly", "limit=2"]) == ["system_instruction=Answer [briefly",
                                                                           "limit=2"]  # a text, not a list


def test_options_and_their_values_are_not_overrides():
    assert arguments_to_check(["--cfg", "job", "-m", "dtype=float32", "--config-name=x", "-p", "tasks", "-sc",
                               "install=bash"]) == ["dtype=float32"]


def run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120)


def assert_one_line(done, prefix, message):
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and message in lines[0], lines


@pytest.mark.parametrize("args, message", [
    (["endpoint.ulr=x", "--cfg", "job"], "did you mean endpoint.url?"),  # what --help recommends
    (["--cfg", "job", "dtype=bf16"], "did you mean dtype=bfloat16?"),
    (["tensor_parallel_size=four"], "did you mean tensor_parallel_size=4?"),
    (["-m", "tasks=gsm8k"], "pass tasks=[gsm8k]"),
    (["tasks=gsm8k,arc_easy"], "pass tasks=[gsm8k,arc_easy]"),
    (["-m", "tasks=[evalkit_arith]", "--cfg", "job"], "--cfg shows one run's config, not a sweep's"),
    (["engine_kwargs.enforce_eager=false"], "pass +engine_kwargs.enforce_eager=false"),
])
def test_evalkit_says_it_in_one_line_with_exit_2(args, message):
    assert_one_line(run("evalkit", *args), "evalkit: error: ", message)


def test_noise_has_help_and_refuses_a_bad_key_in_one_line():
    done = run("evalkit.compare.noise", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: ") and "Traceback" not in done.stderr
    assert_one_line(run("evalkit.compare.noise", "cluster.adress=auto"), "evalkit.compare.noise: error: ",
                    "did you mean cluster.address?")
    assert_one_line(run("evalkit.compare.noise", "--cfg", "job"), "evalkit.compare.noise: error: ",
                    "takes key=value overrides only")


def test_a_server_that_is_not_there_is_said_before_its_missing_deployment(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run("evalkit", "engine=served", f"endpoint.url=http://127.0.0.1:{port}/v1",
               f"output_dir={tmp_path / 'result'}")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "refused connections" in last and "endpoint.deployment" not in last, last
