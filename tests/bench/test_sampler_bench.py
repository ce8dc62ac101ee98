"""``jaxserve bench sampler``: the sampler timed against its alternatives, JSON on stdout."""

from __future__ import annotations

import json

from jaxserve.bench.sampler_bench import RELEVANT, SCENARIOS
from jaxserve_server.cli import main


def test_bench_sampler_times_the_cells_that_answer_a_question(capsys):
    assert main(["bench", "sampler", "--rows", "4", "--vocab", "64", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    (shape,) = result["shapes"]
    assert (shape["rows"], shape["vocab"], result["repeats"]) == (4, 64, 1)
    assert list(shape["ms"]) == SCENARIOS
    for scenario, cells in shape["ms"].items():
        timed = {name for name, ms in cells.items() if ms is not None}
        assert timed == RELEVANT[scenario]
        assert all(cells[name] > 0 for name in timed)
