"""Mistakes on the `domino-spec` command line end in one line naming the file or flag and the fix, status 2, before
any model loads and without leaving an output file behind."""

import json
import os
import subprocess
import sys

import pytest

from domino_spec import cli, targets


def run_cli(monkeypatch, capsys, *argv: str) -> str:
    """`domino-spec argv...` through the console script's `run`: its one error line (status 2 checked)."""
    monkeypatch.setattr(sys, "argv", ["domino-spec", *argv])
    monkeypatch.setattr(targets, "load_target", lambda *args, **kwargs: pytest.fail("loaded a model before refusing"))
    monkeypatch.delenv("DOMINO_SPEC_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as stopped:
        cli.run()
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("learning_rate: [0.1\nmax_steps: 3\n", "is not valid YAML"),
        ("- learning_rate: 0.1\n- max_steps: 3\n", "holds a list, not a mapping of flag names to values"),
        ("just some words\n", "holds a str, not a mapping of flag names to values"),
        (b"learning_rate: 0.1 # caf\xe9\n", "is not UTF-8 text"),
    ],
)
def test_train_config_that_is_no_mapping_of_flags_is_named_with_the_fix(tmp_path, monkeypatch, capsys, text, problem):
    config = tmp_path / "recipe.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    line = run_cli(monkeypatch, capsys, "train", "--target", "t", "--data", "d.jsonl", "--config", str(config))
    assert line.startswith(f"domino-spec train: error: --config {config} {problem}")
    assert "`learning_rate: 0.0006`" in line or "save it as UTF-8" in line


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_prompts_file_that_is_not_utf8_is_named_with_its_line_and_the_fix(tmp_path, monkeypatch, capsys, suffix):
    records = [{"id": "a", "prompt": "fine"}, {"id": "b", "prompt": "café"}]
    if suffix == ".jsonl":
        text = "\n".join(json.dumps(record, ensure_ascii=False) for record in records)
    else:
        text = json.dumps(
            [{"id": r["id"], "conversations": [{"from": "human", "value": r["prompt"]}]} for r in records],
            ensure_ascii=False,
            indent=1,
        )
    prompts, output = tmp_path / f"prompts{suffix}", tmp_path / "data.jsonl"
    prompts.write_bytes(text.encode("latin-1"))
    line = run_cli(
        monkeypatch, capsys, "generate-data", "--target", "t", "--prompts", str(prompts), "--output", str(output)
    )
    expected_line = text.splitlines().index(next(row for row in text.splitlines() if "caf" in row)) + 1
    assert f"error: {prompts}, line {expected_line}: not UTF-8 text (byte 0xe9); save the file as UTF-8" in line
    assert "iconv" in line and not output.exists()


@pytest.mark.parametrize(("flag", "value"), [("--batch-size", "0"), ("--max-new-tokens", "0"), ("--batch-size", "-2")])
def test_generate_data_checks_its_counts_before_loading_and_writes_nothing(tmp_path, monkeypatch, capsys, flag, value):
    prompts, output = tmp_path / "prompts.jsonl", tmp_path / "data.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    line = run_cli(
        monkeypatch,
        capsys,
        "generate-data",
        "--target",
        "t",
        "--prompts",
        str(prompts),
        "--output",
        str(output),
        flag,
        value,
    )
    assert line.startswith(f"domino-spec generate-data: error: {flag} {value}: must be at least 1")
    assert not output.exists()


def test_importing_the_command_line_leaves_openmp_alone_until_a_command_runs():
    """The wait policy is set where a command starts, before torch starts its threads, not on import."""
    code = "import os, sys, domino_spec.cli; print('torch' in sys.modules, 'OMP_WAIT_POLICY' in os.environ)"
    environment = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environment)
    assert result.stdout.split() == ["False", "False"]
