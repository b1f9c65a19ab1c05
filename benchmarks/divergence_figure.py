"""The figure at the top of docs/divergence.md, drawn from what `benchmarks.divergence_verdict` wrote: how far
each candidate moved the output (Mean KLD, section 1 of its output) and how many documents the divergence verdict
and the accuracy compare each need to tell it from the reference (power >= 0.8, section 3). No engine starts:
the figure only redraws a table the benchmark already measured, and its caption names that run.

Run: .venv/bin/python -m benchmarks.divergence_figure [--source benchmarks/divergence_verdict.md]
[--out docs/divergence-verdict.png] (a second; needs matplotlib).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCURACY_CAP = 200  # the benchmark's largest document count: "more than 200" is drawn at it, hatched


def table(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first Markdown table under the '## heading...' line, each as its cells."""
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    lines = text[start:end if end >= 0 else len(text)].splitlines()
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]
    return rows[2:]  # past the header and its --- line


def candidates(text: str) -> tuple[list[tuple[str, float, str]], int]:
    """(name, Mean KLD, accuracy compare) of each candidate whose record differs from the reference's, and the
    count of those recorded bit-identical to it and within noise (the noise run itself, the floor, left out)."""
    moved, identical = [], 0
    for name, same, _, _, mean_kld, _, _, verdict, accuracy in table(text, "1. "):
        if same == "yes":
            identical += verdict.startswith("within noise")
        else:
            moved.append((name, float(mean_kld), accuracy))
    return moved, identical


def documents_needed(text: str) -> dict[str, tuple[int, int | None]]:
    """name -> (documents the divergence verdict needs, documents the accuracy compare needs or None: more than
    the benchmark had)."""
    needed = {}
    for name, verdict, accuracy, _ in table(text, "3. "):
        needed[name] = (int(verdict), None if accuracy.startswith("more than") else int(accuracy))
    return needed


def draw(text: str, out: Path) -> None:
    """Two panels side by side, one bar pair per candidate, saved as a PNG at out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moved, identical = candidates(text)
    needed = documents_needed(text)
    names = [name.replace("layer 15 ", "layer 15\n") for name, _, _ in moved]
    caught = ["worse" in accuracy for _, _, accuracy in moved]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")

    left.bar(names, [kld for _, kld, _ in moved], color=["#c0392b" if c else "#7f8c8d" for c in caught])
    left.set_yscale("log")
    left.set_ylim(top=max(kld for _, kld, _ in moved) * 20)
    left.set_ylabel("Mean KLD against float32 (nats)")
    left.set_title(f"Every candidate beyond noise; the {identical} runs recorded\n"
                   "bit-identical to the reference (Mean KLD 0) within noise", fontsize=9)
    left.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="#7f8c8d"), plt.Rectangle((0, 0), 1, 1, color="#c0392b")],
                labels=["accuracy compare: inconclusive", "accuracy compare: a row worse"], fontsize=8,
                loc="upper left")

    positions = range(len(moved))
    verdict = [needed[name][0] for name, _, _ in moved]
    accuracy = [needed[name][1] for name, _, _ in moved]
    right.bar([p - 0.2 for p in positions], verdict, width=0.4, color="#2980b9")
    bars = right.bar([p + 0.2 for p in positions], [a or ACCURACY_CAP for a in accuracy], width=0.4,
                     color="#bdc3c7")
    for bar, count in zip(bars, accuracy):
        if count is None:
            bar.set_hatch("//")
            right.annotate(f">{ACCURACY_CAP}", (bar.get_x() + bar.get_width() / 2, ACCURACY_CAP), ha="center",
                           va="bottom", fontsize=8)
    for p, count in zip(positions, verdict):
        right.annotate(str(count), (p - 0.2, count), ha="center", va="bottom", fontsize=8)
    right.set_xticks(list(positions), names)
    right.set_ylim(0, ACCURACY_CAP * 1.4)
    right.set_ylabel("documents for power ≥ 0.8")
    right.set_title("Documents each test needs to see the change", fontsize=9)
    right.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="#2980b9"), plt.Rectangle((0, 0), 1, 1, color="#bdc3c7")],
                 labels=["divergence verdict (α 0.01)", f"accuracy compare (α 0.05; hatched: over {ACCURACY_CAP})"],
                 fontsize=8, loc="upper right")
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=8)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT / "benchmarks" / "divergence_verdict.md",
                        help="the output of python -m benchmarks.divergence_verdict")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "divergence-verdict.png")
    args = parser.parse_args()
    text = args.source.read_text()
    if not re.search(r"\n## 1\. .*\n[\s\S]*\n## 3\. ", text):
        raise SystemExit(f"benchmarks.divergence_figure: {args.source} holds no sections 1 and 3 of "
                         "benchmarks.divergence_verdict's output")
    draw(text, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
