"""A built (non-editable) wheel of this checkout, installed into a fresh virtual environment whose
other packages are this one's, linked entry by entry (all but the editable install of jaxserve).
Processes started with its ``python`` from a folder outside the checkout import the wheel's
jaxserve, as a ``pip install jaxserve`` would: ``tests/test_packaging.py`` imports every
subpackage from it, and the two-host test serves from it."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EDITABLE = ("__editable__", "jaxserve-")  # the editable install's .pth, finder and dist-info


@dataclasses.dataclass(frozen=True)
class InstalledWheel:
    wheel: Path
    python: Path  # the venv's interpreter
    site: Path  # its site-packages, where the wheel's files are
    cwd: Path  # a folder outside the checkout, so that ``python -m`` does not find the sources
    build_output: str  # pip's output of the build


def build_wheel(out: Path) -> tuple[Path, str]:
    # built from a copy: a build writes build/ and *.egg-info next to the sources
    source = shutil.copytree(REPO, out / "src", ignore=shutil.ignore_patterns(
        ".venv*", ".git", "build", "*.egg-info", "__pycache__", "notebooks", "tests"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("jaxserve-*.whl")
    return wheel, proc.stdout + proc.stderr


def install_wheel(out: Path) -> InstalledWheel:
    wheel, output = build_wheel(out)
    base = getattr(sys, "_base_executable", sys.executable)
    venv = out / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(EDITABLE) and not (site / entry.name).exists():
            (site / entry.name).symlink_to(entry)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cwd = out / "run"
    cwd.mkdir()
    return InstalledWheel(wheel, python, site, cwd, output)
