"""What a fresh clone installs: ``make serve`` the runtime only, ``make test`` the test extras, and a
wheel that carries the cpu kernel's source without setuptools warnings."""

from __future__ import annotations

import json
import shutil
import subprocess
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


def test_wheel_carries_the_kernel_source_without_setuptools_warnings(installed_wheel):
    output = installed_wheel.build_output
    assert "pallas_kernels.csrc" not in output and "jaxserve.bench.targets" not in output
    names = zipfile.ZipFile(installed_wheel.wheel).namelist()
    assert "pallas_kernels/csrc/paged_attention_cpu.cc" in names
    assert "jaxserve/bench/targets/h200_target_config.txtpb" in names
    assert {"jaxserve/models/hub.py", "jaxserve_server/cli.py", "jaxserve_server/tool_parsers/hermes.py",
            "jaxserve_server/reasoning/think_tags.py", "jaxserve_server/dashboard.html"} <= set(names)


def source_packages() -> list[str]:
    """Every package of the checkout, by its installed name: found on disk, never listed by hand."""
    found = []
    tops = (("jaxserve", "jaxserve"), ("pallas_kernels", "pallas_kernels"), ("server", "jaxserve_server"))
    for top, installed in tops:
        for init in sorted((REPO / top).rglob("__init__.py")):
            parts = init.parent.relative_to(REPO / top).parts
            found.append(".".join((installed, *parts)))
    return found


def test_the_installed_wheel_imports_every_subpackage(installed_wheel):
    """A non-editable install holds every package (jaxserve.distributed included), imported from
    the wheel's files, not the checkout."""
    packages = source_packages()
    assert "jaxserve.distributed" in packages and "jaxserve_server.tool_parsers" in packages
    script = ("import importlib, json, sys\n"
              "print(json.dumps({p: importlib.import_module(p).__file__ for p in sys.argv[1:]}))\n")
    proc = subprocess.run([str(installed_wheel.python), "-c", script, *packages], cwd=installed_wheel.cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(Path(f).is_relative_to(installed_wheel.site) for f in files.values()), files
