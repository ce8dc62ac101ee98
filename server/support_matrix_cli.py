"""``jaxserve support-matrix``: the matrix of feature pairs as the last run of tests/matrix found it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxserve import support_matrix


def add_support_matrix_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default=None,
                        help=f"a run's results (default: this machine's last run, {support_matrix.last_run_path()})")
    parser.add_argument("--markdown", action="store_true", help="print the page (docs/support-matrix.md) instead")
    parser.add_argument("--write", metavar="PATH", default=None, help="write the page to PATH")


def run_support_matrix_cli(args: argparse.Namespace) -> int:
    """Print (or write) the matrix; exit 1 when a pair fails, 2 when there is no run to read."""
    try:
        results = support_matrix.load_results(args.results)
    except FileNotFoundError as exc:
        print(f"jaxserve: error: no support-matrix results at {exc.filename}: run `make support-matrix` "
              "(or pytest tests/matrix) first", file=sys.stderr)
        return 2
    page = support_matrix.render_markdown(results)
    if args.write:
        Path(args.write).write_text(page, encoding="utf-8")
    print(page if args.markdown else support_matrix.render_text(results))
    return 1 if support_matrix.any_failing(results) else 0
