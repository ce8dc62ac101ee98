"""Imports point down the layers and form no cycle (``scripts/check_layers.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_layers.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles_and_no_upward_imports():
    check = _checker()
    graph = check.import_graph()
    assert len(graph) > 50  # the whole tree was read
    assert check.find_cycles(graph) == []
    assert check.layer_violations(graph) == []


def test_the_checker_sees_a_cycle_and_an_upward_import():
    check = _checker()
    graph = {"jaxserve.core.a": {"jaxserve.core.b"}, "jaxserve.core.b": {"jaxserve.core.a"},
             "jaxserve.core.c": {"jaxserve.engine.llm"}, "jaxserve.engine.llm": set()}
    assert check.find_cycles(graph) == [["jaxserve.core.a", "jaxserve.core.b"]]
    assert check.layer_violations(graph) == [
        "jaxserve.core.c imports jaxserve.engine.llm: not allowed for jaxserve.core"]


def test_production_code_never_imports_the_test_helpers():
    check = _checker()
    for module, targets in check.import_graph().items():
        assert not [t for t in targets if t == "tests" or t.startswith("tests.")], module
