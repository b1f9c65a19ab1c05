"""The chat template prompts are built with, resolved as lm-eval's vllm backend resolves it (vLLM's order).

    .venv/bin/python -m pytest tests/engine/test_tokenizer.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.engine.tokenizer import TokenizerSide, load_tokenizer, resolve_chat_template

PROCESSOR_TEMPLATE = "PROCESSOR {% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def model_folder(embedded_model_dir: str, folder: Path, *, tokenizer_template: bool = True,
                 processor_template: bool = False, model_type: str | None = None) -> str:
    """The embedded model's files (linked), its tokenizer's template in tokenizer_config.json or none, and
    optionally a Llava processor with a template of its own (chat_template.json), as multimodal checkpoints have."""
    src = Path(embedded_model_dir)
    folder.mkdir()
    for name in ("generation_config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).symlink_to(src / name)
    config = json.loads((src / "config.json").read_text())
    if model_type:
        config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((src / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    if tokenizer_template:
        tokenizer_config["chat_template"] = (src / "chat_template.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if processor_template:
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": PROCESSOR_TEMPLATE}))
        (folder / "processor_config.json").write_text(json.dumps(
            {"processor_class": "LlavaProcessor", "patch_size": 14, "image_token": "<image>",
             "vision_feature_select_strategy": "default"}))
        (folder / "preprocessor_config.json").write_text(json.dumps(
            {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
             "crop_size": {"height": 336, "width": 336}, "size": {"shortest_edge": 336}}))
    return str(folder)


def vllms_own(path: str) -> str | None:
    """What vLLM 0.32 resolves, called as lm-eval 0.4.13's vllm backend calls it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.hf import resolve_chat_template as vllm_resolve

    tokenizer = load_tokenizer(path, trust_remote_code=False, add_bos_token=None)
    return vllm_resolve(tokenizer, None, None, model_config=EngineArgs(model=path).create_model_config())


class Side(TokenizerSide):
    def __init__(self, path: str) -> None:
        self.tokenizer = load_tokenizer(path, trust_remote_code=False, add_bos_token=None)


def test_a_processor_template_comes_first_as_in_vllm(embedded_model_dir, tmp_path):
    path = model_folder(embedded_model_dir, tmp_path / "mm", processor_template=True)
    tokenizer = load_tokenizer(path, trust_remote_code=False, add_bos_token=None)
    assert tokenizer.chat_template and tokenizer.chat_template != PROCESSOR_TEMPLATE
    assert resolve_chat_template(tokenizer, trust_remote_code=False) == vllms_own(path) == PROCESSOR_TEMPLATE
    side = Side(path)
    assert side.chat_template() == PROCESSOR_TEMPLATE
    assert side.chat_prompt(MESSAGES, add_generation_prompt=True) == "PROCESSOR user: What is 2 + 2?\n"


def test_the_tokenizers_template_otherwise_as_in_vllm(embedded_model_dir):
    tokenizer = load_tokenizer(embedded_model_dir, trust_remote_code=False, add_bos_token=None)
    assert resolve_chat_template(tokenizer, trust_remote_code=False) == vllms_own(embedded_model_dir)
    assert Side(embedded_model_dir).chat_prompt(MESSAGES, add_generation_prompt=True) == tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_vllms_fallback_for_a_model_type_without_a_template(embedded_model_dir, tmp_path):
    import vllm.transformers_utils.chat_templates as templates

    path = model_folder(embedded_model_dir, tmp_path / "pg", tokenizer_template=False, model_type="paligemma")
    tokenizer = load_tokenizer(path, trust_remote_code=False, add_bos_token=None)
    basic = (Path(templates.__file__).parent / "template_basic.jinja").read_text()
    assert resolve_chat_template(tokenizer, trust_remote_code=False) == basic


def test_no_template_is_none(embedded_model_dir, tmp_path):
    path = model_folder(embedded_model_dir, tmp_path / "base", tokenizer_template=False)
    assert Side(path).chat_template() is None


@pytest.mark.parametrize("engine", ["hf"])
def test_chat_template_on_a_model_without_one_is_one_line(embedded_model_dir, tmp_path, engine):
    """A base model asked for chat prompts: one line and exit 2, not transformers' ValueError."""
    path = model_folder(embedded_model_dir, tmp_path / "base", tokenizer_template=False)
    done = subprocess.run([sys.executable, "-m", "evalkit", f"engine={engine}", f"vllm_path={path}", "limit=2",
                           "apply_chat_template=true", "tasks=[evalkit_facts]", f"output_dir={tmp_path / 'out'}",
                           "dtype=float32"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "chat template" in line]
    assert lines and "apply_chat_template=false" in lines[-1], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
