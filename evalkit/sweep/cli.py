"""``python -m evalkit.report <sweep dir> [--reference N] [--tolerance 0.02]``: the report of a sweep.

The command behind ``evalkit report`` (evalkit/cli.py) and ``python -m evalkit.report``, its first name
(evalkit/report/__main__.py); the line above is the --help description of both. Writes report.csv, report.md, report.html, scores.png, throughput.png and the comparison reports into the
sweep folder (report.py) and prints report.md. The end of a sweep writes the same report by
itself (callback.py); this command writes it again, e.g. against another reference point.
Bad input (not a sweep folder, no points, an unknown reference, a tolerance outside (0, 1)): one line on stderr,
exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_CODES = """exit status:
  0  the report was written (whatever its verdicts; the sweep's own exit status says whether points failed)
  2  unusable input: not a sweep folder, no points, an unknown --reference, a --tolerance outside (0, 1)"""


def main(argv: list[str] | None = None, prog: str = "python -m evalkit.report") -> int:
    from evalkit.sweep.points import SweepError
    from evalkit.sweep.report import write_report
    from evalkit.untrusted import printable

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", help="a sweep folder: <output_dir>/.sweeps/<time>")
    parser.add_argument("--reference", type=int, default=None,
                        help="the point every other point is compared with (default: the first completed point)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="largest acceptable change, metric units")
    parser.add_argument("--runs-under", type=Path, default=None, metavar="DIR",
                        help="read the points' run folders under DIR only (default: the output folder that holds "
                             "the sweep's .sweeps, or the sweep folder itself): a sweep folder from elsewhere "
                             "names its runs by path, and no other run of this machine's is shown")
    args = parser.parse_args(argv)
    try:
        if not 0 < args.tolerance < 1:  # as compare's: a change of a 0-1 metric
            raise SweepError(f"--tolerance {args.tolerance:g}: the largest acceptable change of a 0-1 metric lies in "
                             "(0, 1), e.g. 0.02")
        if args.runs_under is not None and not args.runs_under.is_dir():
            raise SweepError(f"--runs-under {args.runs_under}: not a folder")
        written = write_report(Path(args.sweep_dir), reference=args.reference, tolerance=args.tolerance,
                               runs_under=args.runs_under)
    except SweepError as error:
        print(f"{prog.removeprefix('python -m ')}: error: {printable(error)}", file=sys.stderr)
        return 2
    report_md = next(p for p in written if p.name == "report.md")
    print(printable(report_md.read_text(), keep="\n"))  # names and outputs from run folders: no terminal control
    print(f"written: {', '.join(p.name for p in written)} in {report_md.parent}")
    return 0

