"""What a fresh clone installs: ``make serve`` the runtime only, ``make test`` the test extras, and a
wheel that carries the cpu kernel's source without setuptools warnings."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.make_dry_run import make_dry_run as make_dry_run_process

REPO = Path(__file__).resolve().parents[1]


def make_dry_run(target: str, venv: Path) -> list[str]:
    out = make_dry_run_process(target, f"VENV={venv}")
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_serve_installs_the_runtime_and_make_test_the_test_extras(tmp_path):
    serve = make_dry_run("serve", tmp_path / "fresh")
    installs = [line for line in serve if "pip install" in line and "--upgrade pip" not in line]
    assert len(installs) == 1 and installs[0].endswith("pip install --quiet -e ."), serve
    assert serve[-1].startswith(f"{tmp_path / 'fresh'}/bin/jaxserve serve")
    test = make_dry_run("test", tmp_path / "fresh")
    assert any(line.endswith('pip install --quiet -e ".[test]"') for line in test), test
    # after `make test`, `make serve` reuses that environment instead of installing again
    (tmp_path / "tested").mkdir()
    (tmp_path / "tested" / ".installed-test").touch()
    assert not any("pip install" in line for line in make_dry_run("serve", tmp_path / "tested"))


def test_wheel_carries_the_kernel_source_without_setuptools_warnings(tmp_path):
    # built from a copy: a build writes build/ and *.egg-info next to the sources
    source = shutil.copytree(REPO, tmp_path / "src", ignore=shutil.ignore_patterns(
        ".venv*", ".git", "build", "*.egg-info", "__pycache__", "notebooks", "tests"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                          "--wheel-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pallas_kernels.csrc" not in out.stdout + out.stderr
    assert "jaxserve.bench.targets" not in out.stdout + out.stderr
    (wheel,) = tmp_path.glob("jaxserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pallas_kernels/csrc/paged_attention_cpu.cc" in names
    assert "jaxserve/bench/targets/h200_target_config.txtpb" in names
    assert {"jaxserve/models/hub.py", "jaxserve_server/cli.py", "jaxserve_server/tool_parsers/hermes.py",
            "jaxserve_server/reasoning/think_tags.py", "jaxserve_server/dashboard.html"} <= set(names)
