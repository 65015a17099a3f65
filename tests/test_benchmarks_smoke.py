"""Smoke test: the draft cost benchmark runs end to end at tiny shapes and writes complete results."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "draft_cost.py"
TIMINGS = ("target_decode", "target_verify", "draft_context_update", "draft_backbone", "draft_head_loop", "draft_round")
RATIOS = ("verify_over_decode", "draft_round_over_verify", "head_loop_share_of_draft_round")


def test_draft_cost_benchmark_writes_results(tmp_path):
    output = tmp_path / "results" / "draft_cost.json"
    command = [
        sys.executable, str(BENCHMARK), "--target", "tiny", "--draft-layers", "2", "--block-size", "4",
        "--context", "32", "--repeats", "2", "--warmup", "1", "--threads", "1", "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| draft_round |" in result.stdout  # the printed table

    results = json.loads(output.read_text())
    assert {"machine", "torch", "transformers"} <= set(results["environment"])
    assert results["settings"]["block_size"] == 4 and results["settings"]["context"] == 32
    assert all(results["timings_ms"][name] > 0 for name in TIMINGS)
    assert all(results["ratios"][name] > 0 for name in RATIOS)
    assert results["model"]["max_tau"] == 5  # 4 drafts (shift_label) + the target's own token
    speedup = results["speedup_bound"]
    assert set(speedup) == {"2", "3", "4", "6", "8"}
    assert speedup["6"] is None and speedup["8"] is None  # beyond what a block of 4 can commit
    timings = results["timings_ms"]
    expected = 4 * timings["target_decode"] / (timings["draft_round"] + timings["target_verify"])
    assert abs(speedup["4"] - expected) < 1e-9 * expected
    assert "| tau | speedup |" in output.with_suffix(".md").read_text()
