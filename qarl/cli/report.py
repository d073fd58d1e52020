"""`qarl report FOLDER`: the comparison report of a `qarl compare` folder (report.md,
compare.json, PNG plots), re-read from its runs' metrics files."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder",
        help="a comparison folder holding ARM/seedK run folders, e.g. runs/compare "
        "(qarl/report/README.md says what the report holds and how each number is computed)",
    )


def run(args: argparse.Namespace) -> int:
    from qarl.report.compare_files import write_report

    paths = write_report(args.folder)  # UserError: exit 2
    print(paths[0].read_text())
    print("report: " + ", ".join(str(path) for path in paths))
    return 0
