"""Execute the research notebooks end to end, and keep the committed copies output-free.

Each notebook runs in a fresh ipykernel started from this interpreter, with ``notebooks/`` as the
working directory and ``JAXSERVE_CACHE_DIR`` pointing at the same cache as the rest of the suite
(the environment's if set, else the engine's default folder), so the demo model and the compiled
step buckets are built once and then come from the persistent cache. A failing cell fails the
test with the cell's traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
MAX_COMMITTED_BYTES = 64 * 1024
EXPECTED = ("01_engine_tour.ipynb", "02_compile_vs_eager.ipynb", "03_prefix_caching.ipynb",
            "04_inside_the_step.ipynb", "05_attention_backends_and_kernels.ipynb",
            "06_bring_your_own_model.ipynb", "07_scheduler_under_load.ipynb")


def test_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} == set(EXPECTED)


def test_readme_lists_every_notebook():
    """README's notebook section has one line per notebook, in order."""
    section = (REPO / "README.md").read_text().split("## Notebooks", 1)[1].split("\n## ", 1)[0]
    listed = [line for line in section.splitlines() if line.startswith("- ")]
    assert [n for line in listed for n in EXPECTED if f"notebooks/{n})" in line] == list(EXPECTED)
    assert len(listed) == len(EXPECTED)


@pytest.fixture(scope="session")
def notebook_cache_dir() -> str:
    from jaxserve import envs

    return str(envs.cache_dir())


@pytest.fixture(scope="session")
def kernel_spec_manager(tmp_path_factory):
    """A ``python3`` kernelspec that runs ``sys.executable``, whatever else is installed.

    The ``python3`` spec found on the Jupyter path may belong to another interpreter (a system
    Jupyter, another venv); the notebooks must run against this one's packages.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    root = tmp_path_factory.mktemp("kernels")
    spec_dir = root / "python3"
    spec_dir.mkdir()
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 ({sys.executable})",
        "language": "python",
    }))
    return KernelSpecManager(kernel_dirs=[str(root)], ensure_native_kernel=False)


def _kernel_env(cache_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env["JAXSERVE_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    # Notebook 02 starts engines in child processes; on a GPU host none may grab all memory.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, notebook_cache_dir, kernel_spec_manager):
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(str(path), as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=kernel_spec_manager)
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    try:
        client.execute(env=_kernel_env(notebook_cache_dir))
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"{path.name}: a cell failed\n{err}", pytrace=False)
    finally:
        # nbclient leaves a kernel it was handed running; its engines hold memory.
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    print(f"{path.name}: executed in {time.perf_counter() - start:.1f} s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_is_clean(path: Path):
    """Committed notebooks carry no outputs or execution counts, and stay small."""
    assert path.stat().st_size < MAX_COMMITTED_BYTES, f"{path.name} is {path.stat().st_size} bytes"
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    for i, cell in enumerate(code):
        assert cell.outputs == [], f"{path.name}: code cell {i} has outputs"
        assert cell.execution_count is None, f"{path.name}: code cell {i} has an execution count"
    assert any(c.cell_type == "markdown" for c in nb.cells)
