"""Config composition with Hydra's compose API (evalkit/config.py, conf/). Run: pytest tests/test_config.py"""

import pytest
from evalkit.config import ConfigError, EvalConfig, compose_config, model_presets, validate
from evalkit.overrides import check_overrides

# The product spec's names are the base releases; each chat release has its own preset, named after it.
BASE_PRESETS = {"qwen2.5-7b": "Qwen2.5-7B", "qwen2-7b": "Qwen2-7B", "qwen1.5-7b": "Qwen1.5-7B",
                "llama3.2-3b": "Llama-3.2-3B", "llama3.1-8b": "Llama-3.1-8B", "llama3-8b": "Meta-Llama-3-8B",
                "llama2-7b": "Llama-2-7b-hf", "yi-6b": "Yi-6B"}
CHAT_PRESETS = {"qwen2.5-7b-instruct": "Qwen2.5-7B-Instruct", "qwen2-7b-instruct": "Qwen2-7B-Instruct",
                "qwen1.5-7b-chat": "Qwen1.5-7B-Chat", "llama3.2-3b-instruct": "Llama-3.2-3B-Instruct",
                "llama3.1-8b-instruct": "Llama-3.1-8B-Instruct", "llama3-8b-instruct": "Meta-Llama-3-8B-Instruct",
                "llama2-7b-chat": "Llama-2-7b-chat-hf", "yi-6b-chat": "Yi-6B-Chat"}
SPEC_PRESETS = set(BASE_PRESETS) | set(CHAT_PRESETS) | {"smollm2-135m-instruct"}


def load(*overrides: str) -> EvalConfig:
    return compose_config(list(overrides))


def test_default_is_the_embedded_model_on_the_embedded_tasks():
    cfg = load()
    assert isinstance(cfg, EvalConfig)
    assert cfg.vllm_path == "embedded://smollm2-135m-instruct" and cfg.dtype == "float32"
    assert (cfg.max_tokens, cfg.temperature, cfg.tensor_parallel_size) == (16384, None, 1)
    assert cfg.tasks == ["evalkit_arith", "evalkit_facts"]
    validate(cfg)


def test_product_spec_overrides_work_as_written(monkeypatch):
    monkeypatch.setenv("EVALKIT_MODELS_DIR", "/data/models")
    cfg = load("model=qwen2-7b", "tensor_parallel_size=4", "max_tokens=2048", "batch_size=64", "limit=100",
               "tasks=[arc_easy,my_task]", "max_model_len=8192")
    assert cfg.model_name == "qwen2-7b" and cfg.vllm_path == "/data/models/Qwen2-7B"
    assert (cfg.tensor_parallel_size, cfg.max_tokens, cfg.batch_size, cfg.limit) == (4, 2048, 64, 100)
    assert cfg.tasks == ["arc_easy", "my_task"] and cfg.max_model_len == 8192
    assert cfg.dtype == "bfloat16" and cfg.apply_chat_template is False


def test_weights_without_a_preset_get_their_own_name_and_the_schemas_settings():
    from evalkit.overrides import prepared

    cfg = load(*prepared(["vllm_path=/models/Mistral-7B-v0.1/"]))
    assert (cfg.model_name, cfg.vllm_path) == ("Mistral-7B-v0.1", "/models/Mistral-7B-v0.1/")
    schema = EvalConfig(model_name="x", vllm_path="y")
    assert (cfg.dtype, cfg.gpu_memory_utilization, cfg.max_model_len, cfg.apply_chat_template) == (
        schema.dtype, schema.gpu_memory_utilization, schema.max_model_len, schema.apply_chat_template)
    validate(cfg)
    assert load(*prepared(["vllm_path=Qwen/Qwen2-7B", "model_name=mine"])).model_name == "mine"
    assert load(*prepared(["model=qwen2-7b", "vllm_path=/x/q"])).model_name == "qwen2-7b"  # a preset keeps its name


def test_each_point_of_a_sweep_over_weights_gets_its_own_name():
    from evalkit.__main__ import points
    from evalkit.overrides import prepared

    every = points(prepared(["vllm_path=/m/A,/m/B", "limit=2"]))
    assert [load(*point).model_name for point in every] == ["A", "B"]


def test_command_line_beats_the_preset():
    cfg = load("model=llama2-7b", "vllm_path=/x/llama", "dtype=float32")
    assert (cfg.vllm_path, cfg.dtype) == ("/x/llama", "float32")


def test_the_presets_are_the_spec_names_and_their_chat_releases():
    assert set(model_presets()) == SPEC_PRESETS


@pytest.mark.parametrize("preset", sorted(SPEC_PRESETS))
def test_every_preset_composes_validates_and_files_its_runs_under_its_name(preset):
    cfg = load(f"model={preset}")
    assert cfg.model_name == preset and cfg.vllm_path and cfg.dtype
    validate(cfg)


@pytest.mark.parametrize("preset, folder", sorted({**BASE_PRESETS, **CHAT_PRESETS}.items()))
def test_a_preset_is_its_release_base_without_the_chat_template_chat_with_it(preset, folder, monkeypatch):
    monkeypatch.setenv("EVALKIT_MODELS_DIR", "/data/models")
    cfg = load(f"model={preset}")
    assert cfg.vllm_path == f"/data/models/{folder}"
    assert cfg.apply_chat_template is (preset in CHAT_PRESETS)


def test_any_engine_argument_passes_through():
    cfg = load("+engine_kwargs.enforce_eager=true", "+engine_kwargs.max_num_batched_tokens=8192",
               "+sampling_kwargs.top_p=0.9")
    assert cfg.engine_kwargs == {"enforce_eager": True, "max_num_batched_tokens": 8192}
    assert cfg.sampling_kwargs == {"top_p": 0.9}


def test_unknown_key_is_one_line_with_the_closest_name():
    with pytest.raises(ConfigError, match=r"unknown config key 'max_token' \(did you mean max_tokens"):
        check_overrides(["max_token=5"])


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match=r"unknown model preset 'qwen2-7' \(did you mean qwen2-7b.*presets: "):
        check_overrides(["model=qwen2-7"])


def test_known_overrides_pass_the_check():
    check_overrides(["model=yi-6b", "tensor_parallel_size=2", "+engine_kwargs.enforce_eager=true",
                     "+engine_kwargs.x=1", "hydra.verbose=true"])


@pytest.mark.parametrize("override, message", [
    ("vllm_path=", "vllm_path is not set"),
    ("dtype=fp8", "dtype='fp8' is not one of"),
    ("overflow=drop", "overflow='drop'"),
    ("max_model_len=0", "max_model_len=0 must be at least 1"),
    ("gpu_memory_utilization=1.5", "gpu_memory_utilization=1.5"),
    ("limit=2.5", "limit=2.5"),
    ("tasks=[]", "tasks is empty"),
    ("model_name=../x", "model_name='../x'"),
    ("num_fewshot=-1", "num_fewshot=-1 must be 0 or more"),
])
def test_bad_values_fail_with_one_line(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")) as info:
        validate(load(override))
    assert "\n" not in str(info.value)


def test_sweeps_are_checked_value_by_value():
    check_overrides(["model=qwen2-7b,llama3-8b", "max_model_len=2048,4096"])
    with pytest.raises(ConfigError, match="unknown model preset 'llama9'"):
        check_overrides(["model=qwen2-7b,llama9"])


def schema_paths(node=EvalConfig, prefix=""):
    """Every key of the schema, nested ones dotted; a free mapping (engine_kwargs) as its own name."""
    import dataclasses
    import typing

    for name, kind in typing.get_type_hints(node).items():
        if dataclasses.is_dataclass(kind):
            yield from schema_paths(kind, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def documented_keys(page):
    """The keys named in the first column of the tables under "## Keys": `a.{b,c}` is a.b and a.c, `x.<arg>` is x."""
    import re

    section = page.split("\n## Keys\n", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            for item in re.findall(r"`([^`]+)`", line.split("|")[1]):
                head, _, rest = item.partition("{")
                names |= {head + part for part in rest.rstrip("}").split(",")} if rest else {item}
    return {re.sub(r"\.<[a-z]+>$", "", name) for name in names}


def test_every_key_of_the_schema_is_in_the_key_table():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    documented = documented_keys(page)
    assert not set(schema_paths()) - documented, "keys missing from docs/configuration.md's table"
    assert not documented - set(schema_paths()) - {"model"}, "keys in the table the schema lacks"


def test_a_sweep_hydra_expands_itself_is_left_to_hydra():
    from evalkit.__main__ import points

    assert points(["limit=interval(0.1,0.5)"]) is None and points(["tasks=[a"]) is None
    assert points(["limit=range(1,3)", "+engine_kwargs.x=1"]) == [["limit=1", "+engine_kwargs.x=1"],
                                                                  ["limit=2", "+engine_kwargs.x=1"]]
