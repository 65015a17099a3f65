"""`optimize_for_cpu`: every linear runs each row count with the fastest layout it timed, giving eager's outputs."""

import json
import os
import platform
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from domino_spec import DraftingOptions
from domino_spec.generation import optimize_for_cpu, speculative_generate
from domino_spec.generation.cpu import (
    DRAFT_EAGER_CALLS,
    GROUPED_SDPA,
    TUNED_ROW_COUNTS,
    faster_thread_count,
    other_runnable_tasks,
    plan_cache_path,
    threads_fitted_to_load,
)
from domino_spec.generation.trees import tree_attention_mask, tree_depths
from domino_spec.transformers_compat import cache_keyword, new_dynamic_cache

from conftest import tiny_draft, tiny_target


@pytest.fixture
def target():
    return tiny_target("llama")


def _planned(model: nn.Module) -> list[nn.Linear]:
    return [module for module in model.modules() if type(module) is nn.Linear and "forward" in module.__dict__]


@torch.no_grad()
def test_optimized_models_give_eager_logits_and_decode_losslessly(target):
    draft = tiny_draft(target)
    input_ids = torch.randint(0, 100, (1, 600), generator=torch.Generator().manual_seed(0))
    eager = [target(input_ids[:, :rows]).logits for rows in (1, 3, 9, 17, 33, 100, 600)]
    expected = target.generate(input_ids[:, :7], max_new_tokens=24, do_sample=False, pad_token_id=0)
    with optimize_for_cpu(target, draft) as optimization:
        assert len(_planned(target)) == sum(type(m) is nn.Linear for m in target.modules())  # the LM head too
        assert len(_planned(draft)) == sum(type(m) is nn.Linear for m in draft.modules())
        for rows, logits in zip((1, 3, 9, 17, 33, 100, 600), eager):  # 33, 100: between tuned counts; 600: the last
            torch.testing.assert_close(target(input_ids[:, :rows]).logits, logits, rtol=1e-4, atol=1e-4)
        output = speculative_generate(target, draft, input_ids[:, :7], max_new_tokens=24, eos_token_id=[])
        assert torch.equal(output.sequences, expected)
        for plan in optimization.plans.values():
            assert set(plan) == set(TUNED_ROW_COUNTS) and set(plan.values()) <= {"linear", "transposed", "onednn"}
        with optimization.suspended():  # eager for a while, as the bench times eager generate
            assert not _planned(target) and not _planned(draft)
        assert len(_planned(target)) == sum(type(m) is nn.Linear for m in target.modules())
    assert not _planned(target) and not _planned(draft)  # restored on leaving the block


@torch.no_grad()
def test_a_drafts_layouts_are_built_after_its_first_calls_and_the_targets_at_once(target):
    """The cost-aware draft length times the target's passes from the first step, so its layouts are ready before;
    a draft's linears run eagerly until they have been called `DRAFT_EAGER_CALLS` times, so a short first call
    builds none, and then run their plans."""
    draft = tiny_draft(target)
    optimization = optimize_for_cpu(target, draft)
    assert all(module.forward.built for module in _planned(target))
    assert not any(module.forward.built for module in _planned(draft))
    before = optimization.extra_bytes
    input_ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    expected = target.generate(input_ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    output = speculative_generate(
        target, draft, input_ids, max_new_tokens=12, eos_token_id=[], options=DraftingOptions(draft_length="full")
    )
    assert torch.equal(output.sequences, expected)
    assert not any(module.forward.built for module in _planned(draft)) and optimization.extra_bytes == before
    linear = next(module for module in _planned(draft) if module.forward.eager_calls < DRAFT_EAGER_CALLS)
    rows = torch.randn(3, linear.in_features)
    eager = nn.functional.linear(rows, linear.weight, linear.bias)
    for _ in range(linear.forward.eager_calls):
        torch.testing.assert_close(linear(rows), eager, rtol=1e-5, atol=1e-5)
    assert not linear.forward.built
    torch.testing.assert_close(linear(rows), eager, rtol=1e-5, atol=1e-5)  # builds, then runs the plan
    needs_layouts = set(linear.forward.plan.values()) != {"linear"}
    assert linear.forward.built and (optimization.extra_bytes > before) == needs_layouts
    optimization.restore()


@torch.no_grad()
def test_a_draft_vocabularys_rows_of_the_lm_head_are_planned_when_built(target):
    """A draft with a vocabulary of its own multiplies its rows of the target's LM head by a linear it derives as it
    drafts; the kernels are planned with the models' and its layouts built with it."""
    vocab = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:50]
    draft = tiny_draft(target, draft_vocab=vocab)
    lm_head = target.get_output_embeddings()
    hidden = torch.randn(6, target.config.hidden_size)
    eager = lm_head(hidden)[..., vocab]
    draft.base_logits(hidden, lm_head)  # built before: built again when prepared
    with optimize_for_cpu(target, draft) as optimization:
        assert (50, target.config.hidden_size, torch.float32, False) in optimization.plans
        torch.testing.assert_close(draft.base_logits(hidden, lm_head), eager, rtol=1e-5, atol=1e-5)
        rows = draft.derived.get("draft_lm_head", (lm_head.weight, draft.draft_vocab), None)
        assert rows in optimization.planned and rows.forward.built
    assert "forward" not in rows.__dict__ and "prepare" not in draft.derived.__dict__  # restored
    torch.testing.assert_close(draft.base_logits(hidden, lm_head), eager, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_grouped_head_targets_masked_passes_read_the_heads_grouped_with_sdpas_logits(target, monkeypatch):
    """A left-padded batch's prefill and a verify pass (a chain's 2D mask, a tree's 4D one) have a mask and several
    query tokens: transformers' sdpa copies each key/value head for the query heads it serves there, the prepared
    target's attention reads them as they are grouped, with the same logits; sdpa again once restored."""
    config = target.config
    assert config._attn_implementation == "sdpa" and config.num_attention_heads > config.num_key_value_heads
    key_heads = []  # per attention call with a mask and several query tokens: the key heads it was given
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        if attn_mask is not None and query.shape[2] > 1:
            key_heads.append(key.shape[1])
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    input_ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(input_ids)
    padded[0, :3] = 0
    parents = torch.tensor([[0, 1, 1], [0, 0, 2]])  # a tree's nodes over the anchor, per row

    def passes() -> list[torch.Tensor]:
        cache = {cache_keyword(target): new_dynamic_cache(config)}
        prefill = target(input_ids[:, :9], attention_mask=padded[:, :9], use_cache=True, **cache)
        positions = padded[:, :9].sum(-1, keepdim=True) + torch.arange(3)  # [B, 3], the anchor's and 2 more
        chain = target(input_ids[:, 9:], attention_mask=padded, position_ids=positions, **cache)
        cache[cache_keyword(target)].crop(-3)
        tree = target(
            torch.cat([input_ids[:, 9:10], input_ids[:, 9:]], dim=-1),  # [B, 4]: the anchor and 3 nodes
            attention_mask=tree_attention_mask(parents, padded[:, :9], target.dtype),
            position_ids=positions[:, :1] + tree_depths(parents),
            **cache,
        )
        return [prefill.logits, chain.logits, tree.logits]

    expected = passes()
    assert key_heads and set(key_heads) == {config.num_attention_heads}  # sdpa's copies
    key_heads.clear()
    with optimize_for_cpu(target, plan_cache=None) as optimization:
        assert config._attn_implementation == GROUPED_SDPA
        for logits, wanted in zip(passes(), expected):
            torch.testing.assert_close(logits, wanted, rtol=1e-5, atol=1e-5)
        assert key_heads and set(key_heads) == {config.num_key_value_heads}  # grouped, as cached
        with optimization.suspended():
            assert config._attn_implementation == "sdpa"
        assert config._attn_implementation == GROUPED_SDPA
    assert config._attn_implementation == "sdpa"


def test_gradients_take_the_eager_path(target):
    """Training sees the original weights, whatever the plan: the extra layouts hold no gradient."""
    optimization = optimize_for_cpu(target)
    head = target.get_output_embeddings()
    hidden = torch.randn(3, head.in_features, requires_grad=True)
    head(hidden).sum().backward()
    assert hidden.grad is not None
    optimization.restore()


def test_a_model_off_the_cpu_is_refused(target):
    with torch.device("meta"):
        on_meta = tiny_target("llama")
    with pytest.raises(
        ValueError, match="optimize_for_cpu prepares models on the CPU, but LlamaForCausalLM has parameters on meta"
    ):
        optimize_for_cpu(target, on_meta)
    assert not _planned(target)  # nothing changed before the refusal


def test_plans_timed_once_are_read_back_by_the_next_process_on_this_machine(target, tmp_path):
    first = optimize_for_cpu(target, plan_cache=str(tmp_path / "plans.json"))
    first.restore()
    stored = json.loads((tmp_path / "plans.json").read_text())
    assert len(stored) == len(first.plans) and all("threads" in key for key in stored)
    # What a later process reads is what it runs: every row count of every shape on the eager kernel here.
    for plan in stored.values():
        plan.update(dict.fromkeys(plan, "linear"))
    (tmp_path / "plans.json").write_text(json.dumps(stored))
    second = optimize_for_cpu(target, plan_cache=str(tmp_path / "plans.json"))
    assert all(set(plan.values()) == {"linear"} for plan in second.plans.values())
    second.restore()
    (tmp_path / "plans.json").write_text("not json")  # unreadable: timed again and written anew
    optimize_for_cpu(target, plan_cache=str(tmp_path / "plans.json")).restore()
    assert len(json.loads((tmp_path / "plans.json").read_text())) == len(first.plans)
    assert plan_cache_path() == os.environ["DOMINO_CPU_PLANS"]  # the tests' own file, not the home folder's


@pytest.mark.skipif(not os.path.exists("/proc/loadavg") or (os.cpu_count() or 1) < 2, reason="needs Linux, 2 cores")
def test_beside_busy_processes_the_call_runs_on_the_faster_thread_count_and_decoding_stays_exact(monkeypatch):
    monkeypatch.setenv("DOMINO_FIT_THREADS", "1")
    target = tiny_target("qwen3")
    draft = tiny_draft(target)
    prompt = torch.randint(3, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        assert other_runnable_tasks() >= 1
        with threads_fitted_to_load(target) as fitted:
            assert fitted in (1, 2) and torch.get_num_threads() == fitted
        assert torch.get_num_threads() == 2  # restored
        assert faster_thread_count(target, (2, 1)) in (1, 2)
        assert torch.get_num_threads() == 2  # the timing restores it too
        output = speculative_generate(target, draft, prompt, max_new_tokens=12)
        assert torch.equal(output.sequences, expected)
    finally:
        for spinner in spinners:
            spinner.kill()
        torch.set_num_threads(threads)
    monkeypatch.setenv("DOMINO_FIT_THREADS", "0")
    with threads_fitted_to_load(target) as kept:
        assert kept == torch.get_num_threads()


FAULTS_OF_A_SECOND_ALLOCATION = """
import ctypes, resource, sys, torch
from domino_spec.generation.cpu import M_MMAP_THRESHOLD, keep_freed_memory_for_reuse
if sys.argv[1] == "keep":
    assert keep_freed_memory_for_reuse()
else:  # glibc's starting thresholds, held (it raises them with what a process happened to free)
    assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)
faults = []
for _ in range(6):  # a pass's activations: allocated and written layer after layer, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    activations = [torch.ones(5 << 20) for _ in range(8)]  # 8 x 20 MB
    del activations
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[1:]))  # the fewest of the passes after the first
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc malloc setting")
def test_a_process_keeping_freed_memory_reuses_it_instead_of_faulting_it_in_again():
    def faults(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", FAULTS_OF_A_SECOND_ALLOCATION, mode], capture_output=True, text=True, check=True
        )
        return int(run.stdout.split()[-1])

    pages = (160 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults("default") > pages // 2  # each block mapped afresh and faulted in again
    assert faults("keep") < pages // 20
