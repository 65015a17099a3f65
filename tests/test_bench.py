"""The benchmark harness on tiny models: every method runs, outputs are checked, results and figure are written."""

import json

from conftest import tiny_draft, tiny_target, tiny_tokenizer

from domino_spec.generation.bench import METHODS, run_bench, write_results


def test_bench_runs_every_method_and_writes_results(tmp_path):
    target = tiny_target("llama")
    target.generation_config.eos_token_id = 1
    drafts = {"domino": tiny_draft(target), "dflash": tiny_draft(target, use_domino_head=False, seed=2)}
    prompts = {
        "set-a": [{"id": "a0", "messages": [{"role": "user", "content": "hello there"}], "reference": None}],
        "set-b": [{"id": f"b{i}", "messages": [{"role": "user", "content": f"what is {i} + {i}?"}], "reference": str(2 * i)} for i in range(2)],
    }
    report = run_bench(target, tiny_tokenizer(), drafts, prompts, METHODS, max_new_tokens=12)
    rows = {(row["eval_set"], row["method"]): row for row in report["results"]}
    assert set(rows) == {(name, method) for name in prompts for method in METHODS}
    for (name, method), row in rows.items():
        assert row["identical"] == row["prompts"] == len(prompts[name]), (name, method)  # lossless, all methods
        assert row["new_tokens"] > 0 and row["seconds"] > 0
        assert row["mean_acceptance_length"] >= 1.0
    assert rows[("set-b", "plain")]["mean_acceptance_length"] == 1.0
    assert rows[("set-b", "plain")]["speedup"] == 1.0
    native = rows[("set-b", "domino")]
    assert sum(native["acceptance_histogram"].values()) > 0
    assert all(0.0 <= rate <= 1.0 for rate in native["position_acceptance"])

    paths = write_results(report, str(tmp_path))
    assert json.loads(open(paths["results.json"]).read())["results"] == report["results"]
    assert "| set-a | domino |" in open(paths["results.md"]).read()
    assert open(paths["acceptance.png"], "rb").read(4) == b"\x89PNG"
