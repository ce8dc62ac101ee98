"""The support matrix (``jaxserve/support_matrix.py``): its combination engines, each checked against
its reference in a process with eight fake devices (``tests/matrix/run_matrix.py``), the refusals
of the pairs that cannot work, and the page ``docs/support-matrix.md``, which must be what this
run renders (``make support-matrix`` rewrites it).

A failing combination fails here by name; the run's results also land where ``jaxserve
support-matrix`` reads them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jaxserve import support_matrix as sm
from jaxserve_server.cli import main as cli_main
from tests.matrix.run_matrix import compare, run_in_subprocess, workload

PAGE = Path(__file__).resolve().parents[2] / "docs" / "support-matrix.md"
ENGINES = sm.covering_engines()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("matrix") / "results.json"
    results = run_in_subprocess(out)
    sm.last_run_path().parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out, sm.last_run_path())
    return results


def test_the_engines_hold_every_allowed_pair_and_user_triple():
    held = set().union(*(sm.pairs(e) for e in ENGINES))
    assert sm.allowed_pairs() <= held
    for engine in ENGINES:
        assert all(sm.compatible(a, b) for a, b in map(sorted, sm.pairs(engine)))
    for triple in sm.USER_TRIPLES:
        engine_side = {f for f in triple if not sm.FEATURES_BY_NAME[f].in_workload}
        assert any(engine_side <= set(e) for e in ENGINES), triple


@pytest.mark.parametrize("index", range(len(ENGINES)), ids=["+".join(e) for e in ENGINES])
def test_combination_engine_matches_its_reference(results, index):
    engine = next(e for e in results["engines"] if e["index"] == index)
    assert engine["features"] == list(ENGINES[index])
    assert engine["passed"], engine["failures"]


def test_refused_pairs_are_refused_at_configuration_naming_both(results):
    assert set(results["refusals"]) == {"+".join(sorted(p)) for p in sm.REFUSED_PAIRS}
    refused_wrongly = [pair for pair, ok in results["refusals"].items() if not ok]
    assert not refused_wrongly, f"not refused at configuration, or not naming both settings: {refused_wrongly}"


def test_the_page_is_what_this_run_renders(results):
    assert PAGE.read_text(encoding="utf-8") == sm.render_markdown(results), (
        "docs/support-matrix.md is stale: `make support-matrix` rewrites it from a run")
    assert not sm.any_failing(results)


def test_cli_prints_the_matrix_and_fails_on_a_failing_pair(results, tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(results))
    assert cli_main(["support-matrix", "--results", str(path)]) == 0
    printed = capsys.readouterr().out
    assert all(f.label in printed for f in sm.FEATURES) and sm.PASS in printed and sm.FAIL not in printed
    broken = {**results, "engines": [{**results["engines"][0], "passed": False, "failures": ["x"]},
                                     *results["engines"][1:]]}
    path.write_text(json.dumps(broken))
    assert cli_main(["support-matrix", "--results", str(path), "--markdown"]) == 1
    assert sm.FAIL in capsys.readouterr().out
    assert cli_main(["support-matrix", "--results", str(tmp_path / "none.json")]) == 2


def test_a_failing_engine_marks_every_pair_it_holds():
    engine = ("chunked_prefill", "int8", "tp2")
    statuses = sm.pair_statuses({"engines": [{"features": list(engine), "passed": False}]})
    assert {statuses[p] for p in sm.pairs([*engine, "n_gt_1"])} == {sm.FAIL}
    passing = sm.pair_statuses({"engines": [{"features": list(engine), "passed": True},
                                            {"features": ["int8", "tp2"], "passed": False}]})
    assert passing[frozenset(("chunked_prefill", "int8"))] == sm.PASS
    assert passing[frozenset(("int8", "tp2"))] == sm.FAIL  # any engine failing on a pair marks it


def _fake_run(tokens: list[list[list[int]]]) -> dict:
    regex_text = "ab123"
    return {"tokens": tokens, "texts": [[regex_text]] * len(tokens), "finish": [["stop"]] * len(tokens),
            "leaks": [], "compiles_on_requests": 0, "preemptions": 1, "prefix_hits": 1, "chunked_prefills": 1,
            "replicas_used": 2, "devices_per_replica": [2], "backend": ["cpu"]}


def test_compare_names_each_difference():
    """The checks behind every ✅ can fail: each kind of difference is reported."""
    first, second = workload()
    count = len(first) + len(second) + 4  # each wave: its greedy prompts, one n=2, one regex request
    ref = _fake_run([[[1, 2]]] * count)
    assert compare(("tp2",), _fake_run([[[1, 2]]] * count), ref) == []
    greedy_changed = _fake_run([[[1, 3]]] + [[[1, 2]]] * (count - 1))
    assert compare((), greedy_changed, ref) == ["greedy tokens differ from the reference"]
    sampled_changed = _fake_run([[[1, 2]]] * len(first) + [[[9]]] + [[[1, 2]]] * (count - len(first) - 1))
    assert compare((), sampled_changed, ref) == ["seeded n=2 samples differ from the reference"]
    leaky = {**ref, "leaks": ["replica 0: 3 blocks held"], "compiles_on_requests": 2, "preemptions": 0}
    assert compare(("preemption",), leaky, ref) == [
        "left behind: replica 0: 3 blocks held", "2 compiles after warm-up", "preemption claimed but not seen"]
