"""The pins of a constraints file that an image's own packages leave open: ``python3 constraints/over_image.py
constraints/cpu.txt OUT`` writes to OUT each ``name==version`` line whose package the running Python (the image's:
CANN, torch-npu, vLLM and vllm-ascend preinstalled) does not have, and prints what it kept and left.

install.sh ascend builds .venv over the image's packages (``--system-site-packages``) and installs evalkit with
these constraints, so that evalkit's tested versions come in for what the image lacks (lm-eval, hydra, ...)
and none of the image's builds (torch and torch-npu for its CANN, vLLM for vllm-ascend) is replaced.
Standard library only.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, version

PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)")


def split(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the pin lines to keep: their package is not installed, the names of those the image has)."""
    kept, image = [], []
    for line in lines:
        found = PIN.match(line.strip())
        if not found:
            continue
        try:
            version(found.group(1))
        except PackageNotFoundError:
            kept.append(line.strip())
        else:
            image.append(found.group(1))
    return kept, image


if __name__ == "__main__":
    source, out = sys.argv[1:3]
    with open(source, encoding="utf-8") as lines:
        kept, image = split(lines.read().splitlines())
    with open(out, "w", encoding="utf-8") as written:
        written.write("".join(f"{line}\n" for line in kept))
    print(f"install.sh: {len(kept)} of evalkit's pins added; {len(image)} packages kept as the image has them")
