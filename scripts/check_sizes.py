"""Fail when a tracked file is larger than a source file should be.

    python scripts/check_sizes.py [--max-kib 512]    # prints the offenders, exit 1 if any

Generated data (weights, caches, build outputs, run results) belongs outside the repository: a
script makes it again. A submission over the size limit lands nothing at all, so `make lint`
catches a stray data file before it is committed further.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-kib", type=int, default=512, help="largest allowed file, KiB (default: 512)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read (default: this one)")
    args = parser.parse_args()
    files = subprocess.run(["git", "ls-files", "-z"], cwd=args.root, capture_output=True,
                           check=True).stdout.split(b"\0")
    too_big = []
    for name in filter(None, files):
        path = args.root / name.decode()
        if path.is_file() and path.stat().st_size > args.max_kib * 1024:
            too_big.append((path.stat().st_size, name.decode()))
    for size, name in sorted(too_big, reverse=True):
        print(f"{name}: {size / 1024:.0f} KiB (over {args.max_kib} KiB: generated data stays out of the repository)")
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main())
