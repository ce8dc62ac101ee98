"""scripts/gpu_kernel_check.py --smoke runs on CPU (interpret mode) and prints one JSON object."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_kernel_check.py"


def test_smoke_run_prints_json(capsys):
    spec = importlib.util.spec_from_file_location("gpu_kernel_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--smoke", "--skip-timing"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    result = json.loads(out[0])
    assert rc == 0, result["errors"]
    assert result["all_correct"] and not result["errors"]
    backends = {e["backend"] for e in result["correctness"]}
    has_triton = importlib.util.find_spec("triton") is not None  # then it runs in its interpreter
    assert {"pallas_mixed", "pallas_decode"} | ({"triton"} if has_triton else set()) <= backends
    assert {e["batch"] for e in result["correctness"]} == {"decode", "prefill", "mixed"}
    assert ("triton" in result["skipped"]) != has_triton
    # the timing section's bookkeeping on the smallest workload
    result2 = dict(timing=[], skipped={}, errors=[])
    mod.run_timing(result2, "smoke", True, deadline=float("inf"))
    assert not result2["errors"]
    assert {e["backend"] for e in result2["timing"]} == {"xla", "pallas_mixed", "pallas_decode"} | (
        {"triton"} if has_triton else set())
    assert all(e["hbm_gb_s"] > 0 for e in result2["timing"])
