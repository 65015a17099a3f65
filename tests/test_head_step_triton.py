"""The fused head step (`config.fused_head_step`, one Triton kernel per slot) drafts what the unfused pooled loop
drafts. Without CUDA the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

import pytest
import torch
from conftest import tiny_draft, tiny_target
from test_head_loop import _draft_once

from domino_spec import DominoConfig
from domino_spec.generation import speculative_generate

pytest.importorskip("triton", reason="the fused head step is a Triton kernel")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def target_and_draft():
    target = tiny_target("qwen3").to(DEVICE)
    draft = tiny_draft(target, block_size=6).to(DEVICE)
    with torch.no_grad():  # a head that matters: residuals on the scale of the base logits
        draft.embed_proj[2].weight.mul_(50.0)
    return target, draft


def _fused_and_unfused(draft, target, input_ids):
    draft.config.fused_head_step = False
    unfused = _draft_once(draft, target, input_ids)
    draft.config.fused_head_step = True
    return _draft_once(draft, target, input_ids), unfused


@pytest.mark.parametrize("pool", [1, 5, 128])
@pytest.mark.parametrize("first_corrected", [0, 1, 6])
def test_fused_step_drafts_the_unfused_tokens_and_logits(target_and_draft, pool, first_corrected):
    target, draft = target_and_draft
    draft.config.head_candidate_pool, draft.config.pure_draft_prefix_len = pool, first_corrected
    fused, unfused = _fused_and_unfused(draft, target, torch.randint(0, 128, (3, 14), device=DEVICE))
    assert torch.equal(fused.tokens, unfused.tokens)
    torch.testing.assert_close(fused.logits, unfused.logits)


def test_fused_step_without_the_gate_table_projects_each_pool_token(target_and_draft):
    target, draft = target_and_draft
    draft.config.head_candidate_pool, draft.config.gru_input_table_max_bytes = 8, 0
    fused, unfused = _fused_and_unfused(draft, target, torch.randint(0, 128, (2, 11), device=DEVICE))
    assert "gru_input_table" not in draft.__dict__.get("_derived_tensors", {})
    assert torch.equal(fused.tokens, unfused.tokens)
    torch.testing.assert_close(fused.logits, unfused.logits)


def test_fused_step_is_lossless_in_greedy_decoding(target_and_draft):
    target, draft = target_and_draft
    draft.config.head_candidate_pool, draft.config.fused_head_step = 4, True
    for seed in range(3):
        input_ids = torch.randint(0, 100, (1, 5 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        input_ids = input_ids.to(DEVICE)
        expected = target.generate(input_ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
        output = speculative_generate(target, draft, input_ids, max_new_tokens=20, eos_token_id=[])
        assert torch.equal(output.sequences, expected)


def test_fused_step_needs_a_candidate_pool(target_and_draft):
    target, draft = target_and_draft
    with pytest.raises(ValueError, match="fused_head_step"):
        DominoConfig(head_candidate_pool=0, fused_head_step=True)
    draft.config.fused_head_step = True  # set after construction: checked when drafting
    with pytest.raises(ValueError, match="head_candidate_pool > 0"):
        _draft_once(draft, target, torch.randint(0, 128, (1, 8), device=DEVICE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_fused_step_on_cpu_without_the_interpreter_names_the_fix(target_and_draft, monkeypatch):
    target, draft = target_and_draft
    draft.config.head_candidate_pool, draft.config.fused_head_step = 4, True
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="fused_head_step = False"):
        _draft_once(draft, target, torch.randint(0, 128, (1, 8), device=DEVICE))
