"""Smoke tests: the scripts of benchmarks/ run end to end at tiny shapes on CPU and write complete results."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from domino_spec.drafting import DraftingOptions
from domino_spec.generation import fused_head_step as head_step_triton

from conftest import load_benchmark, tiny_draft, tiny_target, tiny_tokenizer

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARK = BENCHMARKS / "draft_cost.py"
TIMINGS = (
    "target_decode",
    "target_verify",
    "draft_context_update",
    "draft_backbone",
    "draft_head_loop",
    "draft_argmax",
    "draft_round",
)
RATIOS = (
    "verify_over_decode",
    "draft_round_over_verify",
    "head_loop_share_of_draft_round",
    "head_loop_over_argmax",
    "head_overhead_share_of_draft_round",
)


def test_draft_cost_benchmark_writes_results(tmp_path):
    output = tmp_path / "results" / "draft_cost.json"
    command = [
        sys.executable,
        str(BENCHMARK),
        "--target",
        "tiny",
        "--draft-layers",
        "2",
        "--block-size",
        "4",
        "--context",
        "32",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--output",
        str(output),
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| draft_round |" in result.stdout  # the printed table

    results = json.loads(output.read_text())
    assert {"machine", "python", "torch", "transformers", "triton"} <= set(results["environment"])
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
    # The cost curve: a verify pass over the anchor and k drafts for k = 0..4, the last the whole block.
    verify_k = timings["target_verify_k"]
    assert len(verify_k) == results["model"]["num_draft_tokens"] + 1 == 5 and all(ms > 0 for ms in verify_k)
    assert timings["target_verify"] == verify_k[-1]
    # On CPU both models go through optimize_for_cpu by default: a layout per tuned row count for each weight shape.
    assert results["settings"]["cpu_optimization"] is True
    plans = results["cpu_optimization"]["plans"]
    assert "1024x64 float32" in plans and set(plans["1024x64 float32"].values()) <= {"linear", "transposed", "onednn"}
    report = output.with_suffix(".md").read_text()
    assert "| tau | speedup |" in report and "| drafts k | verify ms | / decode |" in report
    assert "| 4 |" in report and "`optimize_for_cpu`" in report


def test_draft_cost_records_eager_linears_and_the_head_pool(tmp_path):
    output = tmp_path / "draft_cost.json"
    results = load_benchmark("draft_cost").main(
        [
            "--target",
            "tiny",
            "--draft-layers",
            "1",
            "--block-size",
            "2",
            "--context",
            "8",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--head-pool",
            "8",
            "--no-cpu-optimization",
            "--output",
            str(output),
        ]
    )
    assert json.loads(output.read_text()) == json.loads(json.dumps(results))
    assert results["settings"]["cpu_optimization"] is False and results["cpu_optimization"] is None
    assert results["settings"]["head_pool"] == 8
    assert len(results["timings_ms"]["target_verify_k"]) == 3  # k = 0, 1, 2
    assert "eager `nn.Linear` (`--no-cpu-optimization`)" in output.with_suffix(".md").read_text()


def test_gpu_check_runs_on_cpu_at_tiny_shapes(tmp_path, capsys):
    """The GPU check's CPU mode (no compilation, to stay fast): every variant timed, judged and written."""
    output = tmp_path / "results" / "gpu_check.json"
    results = load_benchmark("gpu_check").main(
        [
            "--target",
            "tiny",
            "--device",
            "cpu",
            "--no-compile",
            "--draft-layers",
            "2",
            "--block-size",
            "4",
            "--context",
            "32",
            "--head-pools",
            "0",
            "8",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--output",
            str(output),
            "--gate-table-mib",
            "0",
            "--profile-head",
        ]
    )
    assert json.loads(output.read_text()) == json.loads(json.dumps(results))
    assert {"machine", "accelerator", "python", "torch", "transformers", "triton"} <= set(results["environment"])
    timings = results["timings_ms"]
    assert all(timings[name] > 0 for name in TIMINGS)
    assert len(timings["target_verify_k"]) == 5 and timings["target_verify"] == timings["target_verify_k"][-1]
    assert timings["draft_head_loop_pool8"] > 0 and timings["draft_round_pool8"] > 0
    # No compiled variants without compilation; on CPU the fused head step runs in Triton's interpreter (conftest).
    fused = ["pool8_fused"] if head_step_triton.kernel_runs_on(torch.device("cpu")) else []
    assert set(results["variants"]) == {"eager", "pool8", *fused}
    for variant in results["variants"].values():
        assert set(variant["checks"]) == {"head_loop_share_of_draft_round", "draft_round_over_verify"}
        assert all(check["pass"] == (check["value"] <= check["target"]) for check in variant["checks"].values())
        speedup = variant["speedup_bound"]
        assert set(speedup) == {"4", "6", "8", "10"}
        assert speedup["6"] is None and speedup["10"] is None  # a block of 4 commits at most 5 tokens
    eager = results["variants"]["eager"]
    expected = 4 * timings["target_decode"] / (timings["draft_round"] + timings["target_verify"])
    assert abs(eager["speedup_bound"]["4"] - expected) < 1e-9 * expected
    assert eager["checks"]["draft_round_over_verify"]["value"] == timings["draft_round"] / timings["target_verify"]
    drafted = results["drafted_tokens"]
    assert {name: len(tokens[0]) for name, tokens in drafted.items()} == dict.fromkeys(["eager", "pool8", *fused], 4)
    assert results["same_tokens_as_eager"] == dict.fromkeys(fused, True)
    assert results["model"]["gru_input_table"] is False  # 0 MiB allowed: every variant projects its tokens' gates
    assert set(results["head_kernels"]) == set(results["variants"])  # --profile-head: on CPU, operators
    for kernels in results["head_kernels"].values():
        assert 0 < len(kernels) <= 8 and all(kernel["launches"] > 0 and kernel["us"] > 0 for kernel in kernels)
        assert [kernel["us"] for kernel in kernels] == sorted((kernel["us"] for kernel in kernels), reverse=True)
    report = output.with_suffix(".md").read_text()
    assert "| pool8 |" in report and ("PASS" in report or "FAIL" in report) and "table not used" in report
    assert "Head loop of pool8, costliest kernels per call:" in report
    assert "| eager |" in capsys.readouterr().out


def test_gpu_check_records_a_failing_variant_and_measures_the_others(tmp_path):
    """A negative pool (invalid `DraftingOptions`) fails its variants; the run measures all the others."""
    output = tmp_path / "gpu_check.json"
    results = load_benchmark("gpu_check").main(
        [
            "--target",
            "tiny",
            "--device",
            "cpu",
            "--no-compile",
            "--draft-layers",
            "2",
            "--block-size",
            "4",
            "--context",
            "16",
            "--head-pools",
            "0",
            "-1",
            "8",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--output",
            str(output),
        ]
    )
    fused = head_step_triton.kernel_runs_on(torch.device("cpu"))
    assert set(results["errors"]) == {"pool-1", *(["pool-1_fused"] if fused else [])}
    assert "candidate_pool=-1 is invalid" in results["errors"]["pool-1"]
    assert set(results["variants"]) == {"eager", "pool8", *(["pool8_fused"] if fused else [])}
    assert "**pool-1 failed:**" in output.with_suffix(".md").read_text()


def test_gpu_check_survives_a_failing_first_variant(tmp_path):
    """The first variant also times the pieces every variant shares (the argmax every ratio needs): when it fails,
    the next one times them, rather than the run crashing on the next report."""
    results = load_benchmark("gpu_check").main(
        [
            "--target",
            "tiny",
            "--device",
            "cpu",
            "--no-compile",
            "--no-fused",
            "--draft-layers",
            "2",
            "--block-size",
            "4",
            "--context",
            "16",
            "--head-pools",
            "-1",
            "8",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--output",
            str(tmp_path / "gpu_check.json"),
        ]
    )
    assert set(results["errors"]) == {"pool-1"} and set(results["variants"]) == {"pool8"}
    assert results["timings_ms"]["draft_argmax"] > 0 and results["timings_ms"]["draft_context_update"] > 0


def test_gpu_check_compiles_every_variant_past_dynamos_recompile_limit(tmp_path, monkeypatch):
    """Each compiled variant compiles the head again: with 9 of them, the last would pass dynamo's limit of 8 and be
    timed eager under a compiled name. (The eager backend stands in for Inductor, to stay fast.)"""
    compile_ = torch.compile
    eager_compile = lambda fn, mode=None, dynamic=None: compile_(fn, backend="eager", dynamic=dynamic)  # noqa: E731
    monkeypatch.setattr(torch, "compile", eager_compile)
    limit_hits = []
    handler = logging.Handler()
    handler.emit = lambda record: limit_hits.append(record) if "recompile_limit" in record.getMessage() else None
    logger = logging.getLogger("torch._dynamo.convert_frame")
    torch._dynamo.reset()  # no cache entries of other tests' compiled heads
    logger.addHandler(handler)
    try:
        results = load_benchmark("gpu_check").main(
            [
                "--target",
                "tiny",
                "--device",
                "cpu",
                "--no-fused",
                "--draft-layers",
                "1",
                "--block-size",
                "2",
                "--context",
                "8",
                "--head-pools",
                *map(str, range(9)),
                "--repeats",
                "1",
                "--warmup",
                "1",
                "--output",
                str(tmp_path / "gpu_check.json"),
            ]
        )
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()
    assert not results["errors"] and not limit_hits
    assert len([name for name in results["variants"] if name.endswith("compiled")]) == 9


def test_gpu_check_compares_each_compiled_or_fused_variant_with_its_eager_unfused_one():
    gpu_check = load_benchmark("gpu_check")
    block, other = torch.tensor([[5, 6, 7]]), torch.tensor([[5, 9, 7]])
    drafted = {"": block, "_pool8": block, "_compiled": block.clone(), "_pool8_compiled": other}
    drafted |= {"_pool8_fused": block.clone(), "_pool8_fused_compiled": other}
    expected = {"compiled": True, "pool8_compiled": False, "pool8_fused": True, "pool8_fused_compiled": False}
    assert gpu_check.same_tokens_as_eager(drafted) == expected
    del drafted["_pool8"]  # its eager, unfused loop failed: nothing to compare its other variants with
    assert gpu_check.same_tokens_as_eager(drafted) == {"compiled": True}


def test_train_throughput_benchmark_writes_results(tmp_path):
    output = tmp_path / "train_throughput.json"
    command = [
        sys.executable,
        str(BENCHMARKS / "train_throughput.py"),
        "--target",
        "tiny",
        "--steps",
        "2",
        "--length",
        "64",
        "--block-size",
        "4",
        "--num-anchors",
        "4",
        "--threads",
        "1",
        "--output",
        str(output),
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(output.read_text())["results"]
    assert set(rows) == {"online features", "feature store", "feature store build (per sequence)"}
    assert all(row["seconds_per_step"] > 0 and row["tokens_per_s"] > 0 for row in rows.values())
    assert "| online features |" in output.with_suffix(".md").read_text()


def test_head_pool_benchmark_measures_every_pool_with_the_same_outputs():
    head_pool = load_benchmark("head_pool")
    target = tiny_target()
    draft = tiny_draft(target)
    generator = torch.Generator().manual_seed(0)
    prompts = {"a": [torch.randint(0, 128, (1, n), generator=generator) for n in (5, 9)], "b": [torch.tensor([[7, 8]])]}
    rows = head_pool.pool_acceptance(target, draft, prompts, [4, 0], max_new_tokens=12)
    assert [(row["eval_set"], row["pool"]) for row in rows] == [("a", 0), ("a", 4), ("b", 0), ("b", 4)]
    assert all(row["identical_to_pool_0"] and row["mean_acceptance_length"] >= 1 for row in rows)
    assert draft.drafting_options == DraftingOptions()  # pools are passed per call, never left on the draft
    results = {"target": "tiny", "draft": "random", "limit": 2, "max_new_tokens": 12, "environment": {}, "rows": rows}
    assert "| a | " in head_pool.markdown(results) and "pool 4" in head_pool.markdown(results)


def test_learning_curve_refuses_to_add_to_the_curves_of_other_data_or_flags(tmp_path):
    """Scores are kept by variant and checkpoint: a rerun on other data or with a variant's flags changed would
    otherwise show the old scores as its own. Another scoring interval only scores other checkpoints."""
    learning_curve = load_benchmark("learning_curve")
    output = tmp_path / "curves.json"
    flags = ["--config", "c.yaml", "--eval-data", "h.jsonl", "--steps", "10", "--output", str(output)]
    args = learning_curve.parse_args([*flags, "--eval-every", "5", "--data", "a.jsonl", "--variant", "domino="])
    points = {"checkpoint-5": {"step": 5}}
    output.write_text(
        json.dumps({"curves": {"domino": points}, "variants": args.variant, "recipe": learning_curve.recipe(args)})
    )
    more = ["--eval-every", "2", "--data", "a.jsonl", "--variant", "domino=", "--variant", "b=--x 1"]
    assert learning_curve.load_results(learning_curve.parse_args([*flags, *more]))["curves"]["domino"] == points
    for argv, problem in (
        (["--data", "b.jsonl", "--variant", "domino="], "another recipe .*'data': 'a.jsonl'"),
        (["--data", "a.jsonl", "--variant", "domino=--block_size 16"], "variants domino with other flags"),
    ):
        with pytest.raises(SystemExit, match=f"holds the curves of {problem}.*pass another --output, or delete it"):
            learning_curve.load_results(learning_curve.parse_args([*flags, "--eval-every", "5", *argv]))


def test_learning_curve_counts_a_variants_labelling_into_its_cpu_hours(tmp_path, capsys):
    """Cheap labels and regenerated data compare at equal CPU-hours only with each one's labelling cost counted."""
    learning_curve = load_benchmark("learning_curve")
    flags = ["--config", "c.yaml", "--eval-data", "h.jsonl", "--steps", "10", "--eval-every", "5", "--data", "a.jsonl"]
    flags += ["--output", str(tmp_path / "curves.json"), "--variant", "regenerated=", "--variant", "kept=--x 1"]
    args = learning_curve.parse_args([*flags, "--label-cpu-hours", "regenerated=1.16", "--label-cpu-hours", "kept=.05"])
    assert args.label_cpu_hours == {"regenerated": 1.16, "kept": 0.05}
    assert learning_curve.parse_args(flags).label_cpu_hours == {}
    for extra, problem in ((["--label-cpu-hours", "kept"], "NAME=HOURS"), (["--label-cpu-hours", "other=1"], "other")):
        with pytest.raises(SystemExit):
            learning_curve.parse_args([*flags, *extra])
        assert problem in capsys.readouterr().err
    point = {"step": 5, "examples": 10, "epoch": 0.1, "cpu_hours": 1.2, "loss": 5.0, "acceptance_base": 1.1}
    point |= {"acceptance_final": 1.2, "tau": 1.3}
    results = {"curves": {"regenerated": {"checkpoint-5": point}}, "variants": args.variant, "settings": "s"}
    assert "labelling" not in learning_curve.markdown(results)
    results["label_cpu_hours"] = args.label_cpu_hours
    assert "labelling each variant's data: regenerated 1.16, kept 0.05" in learning_curve.markdown(results)


def test_learning_curve_leaves_the_time_between_an_interrupted_training_and_its_resumption_out_of_its_cpu_hours(
    tmp_path,
):
    """A training a session's end stopped resumes in the next session from its last checkpoint: the hours between
    them trained nothing, and the checkpoints saved before the resumption keep their hours."""
    learning_curve = load_benchmark("learning_curve")
    args = learning_curve.parse_args(
        ["--config", "c.yaml", "--eval-data", "h.jsonl", "--steps", "10", "--eval-every", "5", "--data", "a.jsonl"]
        + ["--output", str(tmp_path / "curves.json"), "--runs", str(tmp_path), "--variant", "domino="]
    )
    folder = tmp_path / "domino"
    folder.mkdir()
    learning_curve.note_start(folder, threads=2)
    started = json.loads((folder / learning_curve.STARTED).read_text())
    began = started["time"] - 10 * 3600  # as a training begun ten hours ago
    (folder / learning_curve.STARTED).write_text(json.dumps(started | {"time": began}))

    def save(step: int, hours_after_start: float) -> Path:
        checkpoint = folder / f"checkpoint-{step}"
        checkpoint.mkdir()
        (checkpoint / "trainer_state.json").write_text("{}")
        os.utime(checkpoint / "trainer_state.json", (began + 3600 * hours_after_start,) * 2)
        return checkpoint

    first = save(5, hours_after_start=0.5)
    (folder / "checkpoint-7").mkdir()  # a save a kill cut short: no trainer state, not resumed from
    assert learning_curve.saved_checkpoints(folder) == [first]
    learning_curve.note_start(folder, threads=2)  # resumed now
    resumed = json.loads((folder / learning_curve.STARTED).read_text())["resumes"][0]["time"]
    last = save(10, hours_after_start=(resumed - began) / 3600 + 0.25)  # 0.25 hours after resuming
    assert learning_curve.cpu_hours(args, "domino", first) == pytest.approx(2 * 0.5)
    assert learning_curve.cpu_hours(args, "domino", last) == pytest.approx(2 * (0.5 + 0.25))


def test_regeneration_throughput_benchmark_times_both_ways_on_the_same_answers(tmp_path):
    target = tiny_target("llama")
    target.generation_config.eos_token_id = 1
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    prompts = [{"id": f"p{i}", "prompt": f"why {i}? " * (i % 4 + 1)} for i in range(7)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(prompt) + "\n" for prompt in prompts))
    output = tmp_path / "regeneration.json"
    command = [
        sys.executable,
        str(BENCHMARKS / "regeneration_throughput.py"),
        "--target",
        str(tmp_path / "target"),
        "--prompts-file",
        str(tmp_path / "prompts.jsonl"),
        "--prompts",
        "5",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "--output",
        str(output),
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())
    assert set(results["results"]) == {"transformers generate", "native engine"}
    assert all(row["seconds"] > 0 and row["tokens_per_s"] > 0 for row in results["results"].values())
    assert results["identical"] == 5 and results["response_tokens"] > 0
    assert "| native engine |" in output.with_suffix(".md").read_text()
