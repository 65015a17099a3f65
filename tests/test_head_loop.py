"""The fast head loop: precomputed GRU input table, fused state matmul, optional candidate pool, all lossless;
and compiled drafting (`compile_drafting`), which gives the eager tokens."""

import pytest
import torch

from domino_spec import DominoContextCache, DraftingOptions
from domino_spec.generation import speculative_generate
from domino_spec.generation.compiled_drafting import compile_drafting, is_drafting_compiled
from domino_spec.head_domino import block_inputs, greedy_head, slot_chooser, slot_loop

from conftest import tiny_draft, tiny_target
from speculative_helpers import draft_from_scratch


def _target_and_draft(device: str = "cpu", **draft_fields):
    """A tiny Qwen3 target and a block-6 draft for it whose head matters: residuals on the scale of the base logits."""
    target = tiny_target("qwen3").to(device)
    draft = tiny_draft(target, block_size=6, **draft_fields).to(device)
    with torch.no_grad():
        draft.head.embed_proj[2].weight.mul_(50.0)
    return target, draft


@pytest.fixture
def target_and_draft():
    return _target_and_draft()


def test_gate_table_matches_per_step_projection(target_and_draft):
    target, draft = target_and_draft
    input_ids = torch.randint(0, 100, (3, 14))
    draft.drafting_options = DraftingOptions(gate_table_max_bytes=0)
    direct = draft_from_scratch(draft, target, input_ids)
    assert "gate_table" not in draft.head.derived
    draft.drafting_options = DraftingOptions(gate_table_max_bytes=2**30)
    tabled = draft_from_scratch(draft, target, input_ids)
    assert "gate_table" in draft.head.derived
    assert torch.equal(direct.tokens, tabled.tokens)
    torch.testing.assert_close(tabled.logits, direct.logits)


def test_derived_weights_follow_weight_updates(target_and_draft):
    target, draft = target_and_draft
    input_ids = torch.randint(0, 100, (2, 12))
    before = draft_from_scratch(draft, target, input_ids)
    with torch.no_grad():
        draft.head.prefix_gru.weight_ih_l0.mul_(-1.0)  # in place: same storage, new version
        draft.head.embed_proj[2].weight.mul_(-1.0)
    after = draft_from_scratch(draft, target, input_ids)
    draft.clear_derived_tensors()
    rebuilt = draft_from_scratch(draft, target, input_ids)
    assert not torch.allclose(after.logits, before.logits)
    torch.testing.assert_close(after.logits, rebuilt.logits)


def test_clear_derived_tensors_after_writing_weights_through_data(target_and_draft):
    """A write through `.data` (peft's merge_adapter) changes no version: the cache cannot see it, the user must."""
    target, draft = target_and_draft
    input_ids = torch.randint(0, 100, (2, 12))
    draft_from_scratch(draft, target, input_ids)  # builds the derived tensors
    draft.head.prefix_gru.weight_hh_l0.data.mul_(-1.0)
    draft.head.embed_proj[2].weight.data.mul_(-1.0)
    draft.clear_derived_tensors()
    fresh = tiny_draft(target, block_size=6)
    fresh.load_state_dict(draft.state_dict())
    cleared, rebuilt = draft_from_scratch(draft, target, input_ids), draft_from_scratch(fresh, target, input_ids)
    torch.testing.assert_close(cleared.logits, rebuilt.logits)


@torch.no_grad()
def test_derived_tensors_are_rebuilt_for_a_new_source_where_a_freed_one_was(target_and_draft):
    """Say a target is freed and another loaded: its embedding often lands at the freed address, with version 0."""
    _, draft = target_and_draft

    def doubled(source: torch.Tensor) -> torch.Tensor:
        return draft.head.derived.get("doubled", (source,), lambda: source * 2)

    for attempt in range(20):  # the allocator reuses a freed block often, not always
        doubled(torch.ones(64, 64))  # its source is freed on return
        second = torch.full((64, 64), 3.0)
        assert torch.equal(doubled(second), second * 2), attempt


@pytest.mark.parametrize("table_bytes", [0, 2**30])
@torch.no_grad()
def test_drafted_tokens_are_embedded_as_in_training(table_bytes):
    """The GRU reads a drafted token through the target's embedding module, as training reads the ground truth.
    Gemma3's module scales its rows by sqrt(hidden): a row of its weight is not the token's embedding."""
    target = tiny_target("gemma3")
    draft = tiny_draft(target, block_size=6)
    draft.head.embed_proj[2].weight.mul_(50.0)
    options = DraftingOptions(gate_table_max_bytes=table_bytes)
    embed_tokens = target.get_input_embeddings()
    draft_hidden = torch.randn(3, draft.config.num_draft_tokens, draft.config.hidden_size)
    base_logits = target.get_output_embeddings()(draft_hidden)
    anchors = torch.randint(0, 100, (3, 1))
    tokens, logits, _ = draft.head.draft(
        base_logits, draft_hidden, embed_tokens(anchors[:, 0]), embed_tokens, None, options
    )
    ground_truth = torch.cat([anchors, tokens[:, :-1]], dim=1)  # as if the drafts were the training data
    teacher_forced = draft.head(base_logits, draft_hidden, embed_tokens(ground_truth))
    torch.testing.assert_close(logits, teacher_forced)


def test_candidate_pool_of_the_whole_vocabulary_changes_nothing(target_and_draft):
    target, draft = target_and_draft
    input_ids = torch.randint(0, 100, (3, 14))
    full = draft_from_scratch(draft, target, input_ids)
    draft.drafting_options = DraftingOptions(candidate_pool=draft.config.vocab_size)
    pooled = draft_from_scratch(draft, target, input_ids)
    assert torch.equal(full.tokens, pooled.tokens)
    torch.testing.assert_close(pooled.logits, full.logits)


def test_candidate_pool_restricts_greedy_drafts_to_the_best_base_tokens(target_and_draft):
    target, draft = target_and_draft
    input_ids = torch.randint(0, 100, (3, 14))
    draft.drafting_options = DraftingOptions(candidate_pool=3)
    pooled = draft_from_scratch(draft, target, input_ids)
    prefix = draft.config.first_corrected_slot
    finite = torch.isfinite(pooled.logits[:, prefix:])
    assert (finite.sum(-1) == 3).all()  # only the pool keeps a logit
    assert torch.equal(pooled.logits.argmax(-1), pooled.tokens)


@pytest.mark.parametrize("pool", [-1, 2.0, True])
def test_drafting_options_refuse_an_invalid_candidate_pool(pool):
    with pytest.raises(ValueError, match=rf"candidate_pool={pool} is invalid: expected 0 \(off\) or a pool size"):
        DraftingOptions(candidate_pool=pool)


def test_sampled_and_processed_drafting_ignore_the_candidate_pool(target_and_draft):
    """A logits processor may mask every token of a pool: processed or sampled drafts score the whole vocabulary."""
    target, draft = target_and_draft
    input_ids = torch.randint(0, 100, (3, 14))
    prefix = draft.config.first_corrected_slot

    def sampled(logits_processor=None):
        generator = torch.Generator().manual_seed(0)
        return draft_from_scratch(
            draft,
            target,
            input_ids,
            do_sample=True,
            generator=generator,
            prefix_ids=input_ids,
            logits_processor=logits_processor,
        )

    whole_vocabulary = sampled()
    draft.drafting_options = DraftingOptions(candidate_pool=3)
    pool_tokens = torch.isfinite(draft_from_scratch(draft, target, input_ids).logits[:, prefix:]).any(1)  # [M, V]
    assert torch.equal(sampled().tokens, whole_vocabulary.tokens)
    banned = sampled(lambda ids, scores: scores.masked_fill(pool_tokens, float("-inf")))
    assert not pool_tokens.gather(1, banned.tokens[:, prefix:]).any()


@torch.no_grad()
def test_slot_loop_refuses_a_pooled_block_for_a_chooser(target_and_draft):
    """A chooser (processor, sampler) sees whole-vocabulary logits: a pooled block has none to give it."""
    target, draft = target_and_draft
    embed_tokens = target.get_input_embeddings()
    draft_hidden = torch.randn(2, draft.config.num_draft_tokens, draft.config.hidden_size)
    base_logits = target.get_output_embeddings()(draft_hidden)
    weights = draft.head.weights(embed_tokens, None, base_logits.dtype, DraftingOptions(candidate_pool=4))
    block = block_inputs(base_logits, draft_hidden, embed_tokens(torch.tensor([5, 7])), weights, pool_size=4)
    with pytest.raises(ValueError, match="A candidate pool is for greedy drafting"):
        slot_loop(base_logits, block, weights, 0, slot_chooser(None, None, do_sample=False))


@pytest.mark.parametrize("pool", [0, 4])
def test_greedy_decoding_with_fast_head_is_lossless(target_and_draft, pool):
    target, draft = target_and_draft
    draft.drafting_options = DraftingOptions(candidate_pool=pool)
    for seed in range(6):
        input_ids = torch.randint(0, 100, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(input_ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
        output = speculative_generate(target, draft, input_ids, max_new_tokens=20, eos_token_id=[])
        assert torch.equal(output.sequences, expected)


def test_candidate_pool_without_pure_prefix(target_and_draft):
    """A pool from slot 0 on: greedy picks are the argmax of the spread, vocabulary-wide logits."""
    target, draft = target_and_draft
    draft.head.first_corrected_slot = 0
    draft.drafting_options = DraftingOptions(candidate_pool=3)
    pooled = draft_from_scratch(draft, target, torch.randint(0, 100, (2, 12)))
    assert pooled.logits.shape[-1] == draft.config.vocab_size
    assert (torch.isfinite(pooled.logits).sum(-1) == 3).all()
    assert torch.equal(pooled.logits.argmax(-1), pooled.tokens)


# ---------------------------------------------------------------------- compiled drafting


@pytest.mark.parametrize("pool", [0, 4])
def test_greedy_head_and_backbone_trace_as_whole_graphs(target_and_draft, pool):
    """No graph break (dynamo only, no code generation: fast): `compile_drafting` can capture each in one graph."""
    target, draft = target_and_draft
    embed_tokens = target.get_input_embeddings()
    input_ids = torch.randint(0, 100, (2, 10))
    with torch.no_grad():
        features = draft.fuse_target_hidden_states(target(input_ids, output_hidden_states=True).hidden_states)
        cache = DominoContextCache()
        draft.extend_context(cache, features, torch.arange(10).expand(2, -1))
        arguments = (
            embed_tokens(input_ids[:, :6]),
            10 + torch.arange(6).expand(2, -1),
            list(zip(cache.keys, cache.values)),
        )
        backbone = torch.compile(draft.backbone, backend="eager", fullgraph=True, dynamic=True)
        hidden = backbone(*arguments)
        torch.testing.assert_close(hidden, draft.backbone(*arguments))
        base_logits = target.get_output_embeddings()(hidden)
        weights = draft.head.weights(embed_tokens, None, base_logits.dtype, DraftingOptions(candidate_pool=pool))
        head = torch.compile(greedy_head, backend="eager", fullgraph=True)
        expected = greedy_head(base_logits, hidden, arguments[0][:, 0], weights, 1, pool)
        tokens, logits, confidence = head(base_logits, hidden, arguments[0][:, 0], weights, 1, pool)
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logits, expected[1])
    torch.testing.assert_close(confidence, expected[2])
    torch._dynamo.reset()


def test_compile_drafting_is_a_switch_not_state(target_and_draft):
    target, draft = target_and_draft
    keys = set(draft.state_dict())
    with pytest.raises(ValueError, match="mode must be one of"):
        compile_drafting(draft, "fast")
    assert compile_drafting(draft) is draft and is_drafting_compiled(draft)
    assert set(draft.state_dict()) == keys  # compiled functions are not modules: nothing saved or moved
    compile_drafting(draft, None)
    assert not is_drafting_compiled(draft)
    torch._dynamo.reset()


@pytest.mark.slow  # two inductor compilations per case: ~15-30 s each on one CPU thread
@pytest.mark.parametrize("pool", [0, 4])
def test_compiled_drafting_gives_eager_tokens(target_and_draft, pool):
    target, draft = target_and_draft
    draft.drafting_options = DraftingOptions(candidate_pool=pool)
    contexts = [torch.randint(0, 100, (2, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14, 20)]
    eager = [draft_from_scratch(draft, target, input_ids) for input_ids in contexts]
    compile_drafting(draft)
    try:
        for input_ids, expected in zip(contexts, eager):  # a growing context: the dynamic backbone, compiled once
            compiled = draft_from_scratch(draft, target, input_ids)
            assert torch.equal(compiled.tokens, expected.tokens)
            torch.testing.assert_close(compiled.logits, expected.logits, rtol=1e-4, atol=1e-4)
        input_ids = contexts[0][:1]
        reference = target.generate(input_ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
        output = speculative_generate(target, draft, input_ids, max_new_tokens=20, eos_token_id=[])
        assert torch.equal(output.sequences, reference)
    finally:
        compile_drafting(draft, None)
        torch._dynamo.reset()
