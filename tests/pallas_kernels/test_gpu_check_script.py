"""scripts/gpu_kernel_check.py --smoke runs on CPU (interpret mode) and prints one JSON object."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_kernel_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_kernel_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_run_prints_json(capsys):
    mod = _load()
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
    assert "mosaic" in result["skipped"] and result["mosaic"]["correct"] == []  # head_dim 16 < 64
    # the timing section's bookkeeping on the smallest workload
    result2 = dict(timing=[], skipped={}, errors=[])
    mod.run_timing(result2, "smoke", True, deadline=float("inf"))
    assert not result2["errors"]
    assert {e["backend"] for e in result2["timing"]} == {"xla", "pallas_mixed", "pallas_decode"} | (
        {"triton"} if has_triton else set())
    assert all(e["hbm_gb_s"] > 0 for e in result2["timing"])
    # mosaic's comparison first, the jnp reference last: a budget cut drops the reference's timing
    order = [e["backend"] for e in result2["timing"] if e["workload"] == "decode_heavy"]
    assert order[-1] == "xla" and order.index("pallas_decode") < order.index("pallas_mixed")
    assert "triton" not in order or order.index("triton") == 0


def test_mosaic_summary_compares_it_with_each_backend():
    timing = [dict(workload="prefill_heavy", backend="mosaic", ms_median=2.0, hbm_fraction_of_peak=0.1),
              dict(workload="prefill_heavy", backend="triton", ms_median=3.0, hbm_fraction_of_peak=0.07),
              dict(workload="prefill_heavy", backend="cudnn_dense", ms_median=1.0, hbm_fraction_of_peak=0.2),
              dict(workload="decode_batch1_long", backend="mosaic", ms_median=0.05, hbm_fraction_of_peak=0.8),
              dict(workload="decode_batch1_long", backend="pallas_decode", ms_median=0.1, hbm_fraction_of_peak=0.4),
              dict(workload="decode_batch1_long", backend="triton", error="boom")]
    result = dict(timing=timing, correctness=[dict(backend="mosaic", ok=True), dict(backend="xla", ok=False)],
                  skipped={})
    summary = _load().mosaic_summary(result)
    assert summary["correct"] == [True] and summary["skipped"] is None
    assert summary["workloads"]["prefill_heavy"]["mosaic_speedup_over"] == {"triton": 1.5, "cudnn_dense": 0.5}
    decode = summary["workloads"]["decode_batch1_long"]
    assert decode["mosaic_hbm_fraction_of_peak"] == 0.8 and "triton" not in decode
    assert "mosaic_hbm_fraction_of_peak" not in summary["workloads"]["prefill_heavy"]


def test_gpu_check_sh_parses_and_has_a_dry_run():
    import subprocess

    script = SCRIPT.parent / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "--dry-run" in text and "mosaic_summary" in text
