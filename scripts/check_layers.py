"""Check that imports point down the layers and that no module imports itself through others.

    python scripts/check_layers.py        # prints the problems, exit 1 if there are any

Reads the source (no import is executed): every ``import`` and ``from ... import`` in
``jaxserve/``, ``server/`` (imported as ``jaxserve_server``) and ``pallas_kernels/``, at module
level, inside functions and under ``if TYPE_CHECKING:`` alike (a type-only import still ties
the two modules together). Two checks:

1. cycles: strongly connected groups of modules in the import graph;
2. layers: each package may import only the packages listed for it in ``ALLOWED``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"jaxserve": ROOT / "jaxserve", "jaxserve_server": ROOT / "server",
            "pallas_kernels": ROOT / "pallas_kernels"}

# Leaf modules every layer may import.
_LEAVES = ("jaxserve", "jaxserve.envs", "jaxserve.exceptions")

# Longest matching prefix of a module -> the module prefixes it may import (besides itself and
# the leaves). Arrows point down: server -> engine -> runner/sample/distributed -> models/layers -> core/kernels.
ALLOWED: dict[str, tuple[str, ...]] = {
    "pallas_kernels": (),
    "jaxserve": (),
    "jaxserve.envs": (),
    "jaxserve.exceptions": (),
    "jaxserve.core": (),
    "jaxserve.layers": ("pallas_kernels",),
    "jaxserve.models": ("jaxserve.layers", "pallas_kernels"),
    "jaxserve.sample": ("jaxserve.core.sampling_params",),
    "jaxserve.config": ("jaxserve.models.config", "jaxserve.models.pooling_config", "jaxserve.core.scheduler"),
    # Speculative decoding's host side (numpy proposers, the JSON config): the core only.
    "jaxserve.spec_decode": ("jaxserve.core",),
    # Structured outputs' grammar engine (llguidance, numpy): the core's parameters and hooks only.
    "jaxserve.structured": ("jaxserve.core.structured_outputs", "jaxserve.core.locked_lru"),
    # Multi-host plumbing (jax.distributed, the control channel): the configuration and the core's data.
    "jaxserve.distributed": ("jaxserve.config", "jaxserve.core"),
    # Lockstep stepping replays the runner's calls; a headless node (rank > 0) runs an engine core.
    "jaxserve.distributed.lockstep": ("jaxserve.config", "jaxserve.core", "jaxserve.distributed", "jaxserve.runner"),
    "jaxserve.distributed.headless": ("jaxserve.config", "jaxserve.core", "jaxserve.distributed", "jaxserve.engine"),
    "jaxserve.runner": ("jaxserve.config", "jaxserve.core", "jaxserve.models", "jaxserve.layers",
                        "jaxserve.sample", "jaxserve.spec_decode", "pallas_kernels"),
    "jaxserve.engine": ("jaxserve.config", "jaxserve.core", "jaxserve.models", "jaxserve.runner",
                        "jaxserve.sample", "jaxserve.structured", "jaxserve.distributed", "jaxserve.spec_decode"),
    "jaxserve.bench": ("jaxserve.config", "jaxserve.core", "jaxserve.models", "jaxserve.runner",
                       "jaxserve.sample", "jaxserve.structured", "jaxserve.engine", "pallas_kernels"),
    # The server sees jaxserve's public API only (the package itself, envs, exceptions); its
    # command line also runs the benchmarks.
    "jaxserve_server": ("jaxserve.engine.protocol",),
    "jaxserve_server.cli": ("jaxserve_server", "jaxserve.bench"),
    # The support matrix's page, rendered from a results file (no engine).
    "jaxserve_server.support_matrix_cli": ("jaxserve.support_matrix",),
}


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([package, *parts])] = path
    return files


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``module`` imports (a ``from pkg import name`` of a submodule counts as
    that submodule, of anything else as ``pkg`` itself)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return {name for name in found if name in known and name != module}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        rule = max((p for p in ALLOWED if _within(module, p)), key=len, default=None)
        if rule is None:
            problems.append(f"{module}: no layer rule covers it (add one to ALLOWED)")
            continue
        allowed = (rule, *_LEAVES, *ALLOWED[rule])
        for target in sorted(targets):
            if not any(_within(target, p) if p not in _LEAVES else target == p for p in allowed):
                problems.append(f"{module} imports {target}: not allowed for {rule}")
    return problems


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {module: imports_of(module, path, known) for module, path in files.items()}


def main() -> int:
    graph = import_graph()
    problems = [f"import cycle: {' -> '.join(group)}" for group in find_cycles(graph)]
    problems += layer_violations(graph)
    for line in problems:
        print(line)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
