"""Screenshots of the pages a person reads, for docs/: compare's HTML report for a candidate with flips (with
--locate) and the sweep report, both from real runs of the embedded model, in headless Chromium at 1,400 px wide
(the first screen, 1400 x 1000; with --whole the whole page too) and on a narrow screen (420 px).

The candidate computes something else for sure: the embedded model with one layer's MLP output projection
scaled x1.3 (as tests/test_locate_engine.py makes it), so answers flip on any processor. One Hydra sweep runs
both models (point 0 the model, point 1 the perturbed copy) on 20 documents of each default task: its sweep
report and its compare page; then ``python -m evalkit.compare POINT0 POINT1 --locate``.

Run: .venv/bin/python -m benchmarks.screenshots [--work DIR] [--out docs]
(about 6 minutes on 2 CPU cores; a --work folder that already holds the runs only remakes the pages and the
screenshots). Needs Chromium (Debian: apt-get install chromium); without it, the runs and pages are made and
the screenshots skipped with one line.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
SETTINGS = ["limit=20", "resume=false", "gpu_memory_utilization=0.25", "+engine_kwargs.enforce_eager=true"]
SHOTS = {"wide": (1400, 1000), "narrow": (420, 1000)}  # the first screen at 1,400 px and on a phone
WHOLE = (1400, 0)  # --whole: the page's own height
MIN_MEASURED = 500  # headless Chromium lays out --dump-dom in a window at least this wide


def perturbed_copy(model_dir: Path, target: Path, layer: int = 2, scale: float = 1.3) -> Path:
    """The embedded model with one layer's MLP output projection scaled: a model that computes something else."""
    from safetensors.torch import load_file, save_file

    if (target / "model.safetensors").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != "model.safetensors" and not (target / item.name).exists():
            (target / item.name).symlink_to(item)
    weights = load_file(model_dir / "model.safetensors")
    weights[f"model.layers.{layer}.mlp.down_proj.weight"] *= scale
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def sweep(work: Path) -> Path:
    """The sweep folder of point 0 (the model) and point 1 (its perturbed copy), made once."""
    found = sorted((work / "result" / ".sweeps").glob("*/report.md"))
    if found:
        return found[-1].parent
    from evalkit.engine.machine.preflight import resolve_model_path

    model = Path(resolve_model_path(f"embedded://{MODEL}"))
    copy = perturbed_copy(model, work / "perturbed")
    command = [sys.executable, "-m", "evalkit", "-m", f"vllm_path={model},{copy}", f"output_dir={work / 'result'}",
               *SETTINGS]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the sweep failed:\n{done.stderr[-3000:]}")
    return sorted((work / "result" / ".sweeps").glob("*/report.md"))[-1].parent


def pages(folder: Path) -> dict[str, Path]:
    """The sweep report remade, and compare's page for point 1 against point 0 with --locate (exit 1: worse)."""
    from evalkit.sweep.points import read_points

    subprocess.run([sys.executable, "-m", "evalkit.report", str(folder)], cwd=ROOT, check=True, capture_output=True)
    ref, cand = (Path(p.run_dir) for p in read_points(folder)[:2])
    done = subprocess.run([sys.executable, "-m", "evalkit.compare", str(ref), str(cand), "--locate"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"python -m evalkit.compare --locate failed:\n{done.stderr[-3000:]}")
    return {"compare": cand / f"compare-vs-{ref.parent.name}-{ref.name}.html", "sweep": folder / "report.html"}


def measure(browser: str, page: Path, width: int) -> tuple[int, int, bool]:
    """In a window width px wide: the page's own width and height, and whether its first table (the verdicts)
    overflows its box, from Chromium's DOM dump (a script writes them into the title)."""
    probe = page.with_name(f".probe-{page.name}")
    probe.write_text(page.read_text().replace("</body>", "<script>const e=document.documentElement,"
                                              "t=document.querySelector('.scroll');document.title=e.scrollWidth+'x'"
                                              "+e.scrollHeight+'x'+(t&&t.scrollWidth>t.clientWidth?1:0)</script></body>"))
    dump = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={width},1000",
                           "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    probe.unlink()
    found = re.search(r"<title>(\d+)x(\d+)x([01])</title>", dump)
    return (int(found[1]), int(found[2]), found[3] == "1") if found else (0, 6000, False)


def screenshot(browser: str, page: Path, target: Path, size: tuple[int, int]) -> str:
    """The PNG, and whether the page and its first table fit the window's width."""
    width, tall = size
    own_width, own_height, table_scrolls = measure(browser, page, width)
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={target}",
                    f"--window-size={width},{tall or own_height + 20}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    if width < MIN_MEASURED:
        return "looked at only (narrower than Chromium's headless window for --dump-dom)"
    if own_width > width or table_scrolls:
        return f"WIDER than {width} px: " + ("the page" if own_width > width else "its first table scrolls")
    return f"page and table fit {width} px"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/evalkit-screenshots"),
                        help="where the runs are made (kept: a second call only remakes pages and screenshots)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the PNGs go")
    parser.add_argument("--whole", action="store_true", help="also the whole of each page (page-*-whole.png)")
    args = parser.parse_args(argv)
    made = pages(sweep(args.work))
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("screenshots skipped: no chromium on PATH (Debian: apt-get install chromium)")
        return 0
    for name, page in made.items():
        for shot, size in {**SHOTS, **({"whole": WHOLE} if args.whole else {})}.items():
            target = args.out / f"page-{name}-{shot}.png"
            print(f"{target}: {screenshot(browser, page, target, size)} ({page})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
