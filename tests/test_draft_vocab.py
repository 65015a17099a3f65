"""The draft vocabulary: a draft that proposes only the most frequent tokens, chosen from the training data."""

import json

import pytest
import torch
from safetensors import safe_open

from domino_spec import DominoDraftModel, DraftingOptions
from domino_spec.draft_building import with_draft_vocab
from domino_spec.generation import speculative_generate
from domino_spec.published_format import load_draft
from domino_spec.training import export
from domino_spec.training.data import draft_vocabulary

from conftest import tiny_draft, tiny_target
from speculative_helpers import draft_from_scratch


def test_the_draft_vocabulary_is_the_most_frequent_response_tokens():
    dataset = {"input_ids": [[9, 5, 5, 7, 3], [9, 7, 5, 2]], "loss_mask": [[0, 1, 1, 1, 1], [1, 1, 1, 0]]}
    # In responses: 5 three times, 7 twice, then 3 and 9 once each (ties by id); token 2 is in no response.
    assert draft_vocabulary(dataset, 4, vocab_size=10) == [5, 7, 3, 9]
    assert draft_vocabulary(dataset, 6, vocab_size=10) == [5, 7, 3, 9, 0, 1]  # then the lowest unseen ids
    with pytest.raises(ValueError, match="a draft vocabulary of 11 tokens is invalid: expected 1 to 10"):
        draft_vocabulary(dataset, 11, vocab_size=10)


@pytest.fixture
def target():
    return tiny_target("qwen3")


def _strong_draft(target, **fields):
    draft = tiny_draft(target, block_size=6, **fields)
    with torch.no_grad():
        draft.head.embed_proj[2].weight.mul_(50.0)
    return draft


def test_base_logits_over_a_draft_vocabulary_are_the_lm_heads_own_columns(target):
    vocab = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:50]  # unsorted, as a trained one is
    draft = tiny_draft(target, draft_vocab=vocab)
    lm_head = target.get_output_embeddings()
    hidden = torch.randn(2, 5, target.config.hidden_size, requires_grad=True)
    with torch.no_grad():
        torch.testing.assert_close(draft.base_logits(hidden, lm_head), lm_head(hidden)[..., vocab])
    draft.base_logits(hidden, lm_head).sum().backward()  # training: differentiable in the hidden states
    torch.testing.assert_close(hidden.grad, lm_head.weight[vocab].sum(0).expand_as(hidden))


def test_a_restricted_draft_drafts_what_the_full_one_does_where_its_pick_is_kept(target):
    full = _strong_draft(target)
    input_ids = torch.randint(0, 100, (3, 14), generator=torch.Generator().manual_seed(0))
    expected = draft_from_scratch(full, target, input_ids)
    kept = expected.tokens.unique()
    others = torch.tensor([t for t in range(128) if t not in kept.tolist()])[:20]
    restricted = with_draft_vocab(full, torch.cat([others, kept]))
    assert restricted.config.draft_vocab_size == kept.numel() + 20
    drafted = draft_from_scratch(restricted, target, input_ids)
    assert torch.equal(drafted.tokens, expected.tokens)
    outside = torch.ones(128, dtype=torch.bool)
    outside[restricted.draft_vocab] = False
    assert torch.isneginf(drafted.logits[..., outside]).all()  # q is zero outside the draft vocabulary
    restricted.drafting_options = DraftingOptions(candidate_pool=4)  # a pool of the best base tokens it keeps
    assert not outside[draft_from_scratch(restricted, target, input_ids).tokens].any()
    with pytest.raises(ValueError, match=r"token ids in \[0, 127\] \(the target's vocabulary\), got shape \(2,\), ids"):
        with_draft_vocab(restricted, torch.tensor([int(kept[0]), 128]))


def test_a_grown_draft_vocabulary_keeps_the_residual_rows_and_scores_new_tokens_by_base_logits_alone(target):
    draft = _strong_draft(target, draft_vocab=torch.arange(40, 90))
    new_tokens = torch.tensor([7, 3, 120])
    grown = with_draft_vocab(draft, torch.cat([draft.draft_vocab, new_tokens]))
    assert grown.config.draft_vocab_size == 53 and torch.equal(grown.draft_vocab[50:], new_tokens)
    residual_rows = grown.head.embed_proj[2].weight
    torch.testing.assert_close(residual_rows[:50], draft.head.embed_proj[2].weight, rtol=0, atol=0)
    assert not residual_rows[50:].any()
    input_ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    before, after = draft_from_scratch(draft, target, input_ids), draft_from_scratch(grown, target, input_ids)
    assert torch.equal(after.tokens, before.tokens)  # the strong residuals keep their picks: the same chain, so the
    torch.testing.assert_close(after.logits[..., 40:90], before.logits[..., 40:90])  # kept tokens score the same
    assert torch.isfinite(after.logits[..., new_tokens]).all()
    shrunk_back = with_draft_vocab(grown, draft.draft_vocab)
    torch.testing.assert_close(shrunk_back.head.embed_proj[2].weight, draft.head.embed_proj[2].weight)


def test_greedy_decoding_with_a_draft_vocabulary_is_lossless_on_both_paths(target):
    draft = _strong_draft(target, draft_vocab=torch.arange(40, 90))
    assert set(draft_from_scratch(draft, target, torch.randint(0, 100, (2, 9))).tokens.flatten().tolist()) <= set(
        range(40, 90)
    )
    for seed in range(4):
        input_ids = torch.randint(0, 100, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(input_ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
        native = speculative_generate(target, draft, input_ids, max_new_tokens=16, eos_token_id=[])
        assert torch.equal(native.sequences, expected)
        hf = target.generate(input_ids, max_new_tokens=16, do_sample=False, pad_token_id=0, assistant_model=draft)
        assert torch.equal(hf, expected)


def test_a_draft_vocabulary_is_saved_and_exported_as_the_whole_vocabulary(target, tmp_path):
    draft = _strong_draft(target, draft_vocab=torch.arange(100, 20, -1))
    draft.save_pretrained(tmp_path / "ours")
    loaded = DominoDraftModel.from_pretrained(tmp_path / "ours")
    assert torch.equal(loaded.draft_vocab, draft.draft_vocab) and loaded.config.draft_vocab_size == 80
    with pytest.warns(UserWarning, match="80 tokens, which the published format cannot hold"):
        export.export_sglang(str(tmp_path / "ours"), str(tmp_path / "sglang"))
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert "draft_vocab_size" not in config and config["vocab_size"] == 128
    with safe_open(tmp_path / "sglang" / "model.safetensors", "pt") as file:
        assert "draft_vocab" not in file.keys()
        up = file.get_tensor("embed_proj.2.weight").float()  # [V, R]: rows of zeros outside the draft vocabulary
    torch.testing.assert_close(up[draft.draft_vocab], draft.head.embed_proj[2].weight.bfloat16().float())
    assert not up[:21].any() and not up[101:].any()
    exported = load_draft(tmp_path / "sglang")
    assert exported.draft_vocab is None and exported.head.embed_proj[2].weight.shape[0] == 128
