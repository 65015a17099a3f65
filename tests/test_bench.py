"""The benchmark harness on tiny models: every method runs, outputs are checked, results and figure are written."""

import json

import pytest
import torch

from domino_spec import DraftingOptions
from domino_spec.draft_building import from_target
from domino_spec.generation import pooled_position_rates, speculative_generate
from domino_spec.generation.bench import METHODS, NATIVE_METHODS, MethodRun, run_bench, with_baselines
from domino_spec.generation.bench_report import write_results
from domino_spec.generation.quality import score_report
from domino_spec.targets import prompt_token_ids

from conftest import tiny_draft, tiny_target, tiny_tokenizer
from speculative_helpers import OracleDraft


def test_bench_runs_every_method_and_writes_results(tmp_path):
    target = tiny_target("llama")
    target.generation_config.eos_token_id = 1
    drafts = {"domino": tiny_draft(target), "dflash": tiny_draft(target, use_domino_head=False, seed=2)}
    for draft in drafts.values():  # a random draft's drafts never pay a longer verify pass: verify them all
        draft.drafting_options = DraftingOptions(draft_length="full")
    prompts = {
        "set-a": [{"id": "a0", "messages": [{"role": "user", "content": "hello there"}], "reference": None}],
        "set-b": [
            {"id": f"b{i}", "messages": [{"role": "user", "content": f"what is {i} + {i}?"}], "reference": str(2 * i)}
            for i in range(2)
        ],
    }
    report = run_bench(target, tiny_tokenizer(), drafts, prompts, METHODS, max_new_tokens=12)
    rows = {(row["eval_set"], row["method"]): row for row in report["results"]}
    assert set(rows) == {(name, method) for name in prompts for method in METHODS}
    for (name, method), row in rows.items():
        assert row["identical"] == row["prompts"] == len(prompts[name]), (name, method)  # lossless, all methods
        assert row["new_tokens"] > 0 and row["seconds"] > 0
        assert row["mean_acceptance_length"] >= 1.0
    for plain in ("plain", "plain-native"):
        assert rows[("set-b", plain)]["mean_acceptance_length"] == 1.0 and rows[("set-b", plain)]["speedup"] == 1.0
    for method in METHODS:  # each engine against its own plain decoding
        row, baseline = (
            rows[("set-b", method)],
            rows[("set-b", "plain-native" if method in NATIVE_METHODS else "plain")],
        )
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / baseline["tokens_per_s"], abs=1e-3), method
    for row in rows.values():  # the raw counts tau is computed from
        assert row["mean_acceptance_length"] == round(row["verified_tokens"] / row["verify_passes"], 3)
    assert {"target", "drafts", "dtype"} <= set(report["config"]) and report["config"]["dtype"] == "float32"
    native = rows[("set-b", "domino")]
    assert sum(native["acceptance_histogram"].values()) > 0
    assert all(0.0 <= rate <= 1.0 for rate in native["position_acceptance"])

    paths = write_results(report, str(tmp_path))
    assert json.loads(open(paths["results.json"]).read())["results"] == report["results"]
    markdown = open(paths["results.md"]).read()
    assert "| set-a | domino |" in markdown and "| metric | score |" not in markdown  # no --quality, no scores
    assert open(paths["acceptance.png"], "rb").read(4) == b"\x89PNG"


def test_bench_results_show_the_quality_scores_of_bench_quality(tmp_path):
    """`bench --quality` adds `score_report(report)` to the report; the markdown (also what bench prints) shows it."""
    target = tiny_target("llama")
    target.generation_config.eos_token_id = 1
    prompts = {
        "gsm-symbolic": [
            {"id": f"g{i}", "messages": [{"role": "user", "content": f"what is {i} + {i}?"}], "reference": str(2 * i)}
            for i in range(2)
        ],
        "mt-bench": [{"id": "m0", "messages": [{"role": "user", "content": "hello there"}], "reference": None}],
    }
    report = run_bench(
        target, tiny_tokenizer(), {"domino": tiny_draft(target)}, prompts, ["plain", "plain-native", "domino"], 6
    )
    report["quality"] = score_report(report)
    markdown = open(write_results(report, str(tmp_path))["results.md"]).read()
    assert "| eval set | method | metric | score | outputs |" in markdown
    for method in ("plain", "domino"):
        score = report["quality"]["gsm-symbolic"][method]["score"]
        assert f"| gsm-symbolic | {method} | exact_match | {score:.3f} | 2 |" in markdown
        assert f"| mt-bench | {method} | - | - | 1 |" in markdown  # open-ended: no metric


def test_bench_compares_with_plain_in_any_method_order_and_pools_the_engines_position_counts():
    """With an oracle draft every round accepts all its drafts; a round cut by the length budget still accepted each
    draft it verified, which a rate rebuilt from tokens committed per round would count as rejections."""
    target = tiny_target("qwen3", dtype=torch.float64)
    target.generation_config.eos_token_id = 1
    tokenizer = tiny_tokenizer()
    messages = [[{"role": "user", "content": text}] for text in ("hello there", "what is 3 + 4?")]
    prompts = {"set": [{"id": str(i), "messages": m, "reference": None} for i, m in enumerate(messages)]}
    oracle = from_target(
        target, draft_class=OracleDraft, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 3]
    ).double()
    prompt_ids = [torch.tensor([prompt_token_ids(tokenizer, m, None)]) for m in messages]
    oracle.set_sequences([target.generate(ids, max_new_tokens=40, do_sample=False)[0].tolist() for ids in prompt_ids])
    oracle.drafting_options = DraftingOptions(draft_length="full")  # every round drafts, whatever the machine's costs

    report = run_bench(
        target, tokenizer, {"domino": oracle.eval()}, prompts, ["domino", "plain", "plain-native"], max_new_tokens=9
    )
    domino = next(row for row in report["results"] if row["method"] == "domino")
    assert domino["identical"] == domino["prompts"] == 2  # plain is the reference though listed last

    accepted = verified = 0
    for ids in prompt_ids:
        output = speculative_generate(target, oracle, ids, max_new_tokens=9, eos_token_id=[1])
        accepted, verified = output.position_accepted + accepted, output.position_verified + verified
    assert domino["position_acceptance"] == [round(a / v, 4) for a, v in zip(accepted.tolist(), verified.tolist())]
    assert min(domino["position_acceptance"]) > 0.5  # the oracle proposes padding only past EOS


def test_a_draft_position_never_verified_has_no_acceptance_rate():
    """Short runs (a budget cut inside the first block) verify no k-th draft: no rate, not a rate of 0."""
    assert pooled_position_rates([3, 0, 0], [4, 2, 0]) == [0.75, 0.0, None]


def test_bench_speedup_is_throughput_over_plains():
    """A method whose outputs differ from plain's decodes other token counts: its speedup compares tokens/s, not time
    (here 12.5 against 10 tokens/s, in less than half plain's time)."""
    plain, other = MethodRun(seconds=10.0, new_tokens=100), MethodRun(seconds=4.0, new_tokens=50)
    eager = MethodRun(seconds=12.5, new_tokens=100)  # 8 tokens/s: eager generate, before optimize_for_cpu
    summary = other.summary(plain, eager)
    assert summary["speedup"] == 1.25 and summary["speedup_over_eager"] == round(12.5 / 8, 3)
    assert plain.summary(plain, eager)["speedup"] == 1.0


def test_bench_adds_the_baselines_a_method_needs_and_refuses_a_method_without_its_draft():
    target = tiny_target("llama")
    prompts = {"set": [{"id": "0", "messages": [{"role": "user", "content": "hello"}], "reference": None}]}
    report = run_bench(target, tiny_tokenizer(), {"domino": tiny_draft(target)}, prompts, ["domino"], 4)
    assert [row["method"] for row in report["results"]] == ["plain", "plain-native", "domino"]
    assert report["config"]["methods"] == ["plain", "plain-native", "domino"]
    assert with_baselines(["prompt-lookup"]) == ["plain", "prompt-lookup"]
    assert with_baselines(["plain-native", "dflash", "plain"]) == ["plain-native", "dflash", "plain"]
    with pytest.raises(ValueError, match=r"\['dflash'\] need a draft"):
        run_bench(
            target, tiny_tokenizer(), {"domino": tiny_draft(target)}, prompts, ["plain", "plain-native", "dflash"], 4
        )
