"""Domino trees (`generation/trees.py`): one verify pass over a tree of drafts per row, greedy decoding unchanged
and sampling exact.

The tiny targets here have a 12-token vocabulary, so a random draft's other branches often hold the target's token:
rounds accept nodes off the draft's likeliest branch, which a chain would never have verified.
"""

import dataclasses
import warnings

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from domino_spec import DominoContextCache, DraftCosts, DraftingOptions
from domino_spec.drafting import AUTO_TREE_NODES, DraftTree
from domino_spec.generation import left_pad, speculative_generate
from domino_spec.generation.trees import (
    CHILDREN_PER_NODE,
    accept_tree,
    add_branch,
    grow_tree,
    left_the_first_branch,
    sample_tree,
    tree_ancestry,
    tree_attention_mask,
    tree_depths,
)

from conftest import tiny_draft, tiny_target
from speculative_helpers import chi_square_test, random_prompts

VOCAB_SIZE = 12
TREE = DraftingOptions(draft_length="full", tree_nodes=12, prompt_lookup=0)


def small_vocabulary_models(family: str):
    target = tiny_target(family, dtype=torch.float64, vocab_size=VOCAB_SIZE)
    target.generation_config.eos_token_id = None  # stops come from each case
    draft = tiny_draft(target, block_size=6).to(torch.float64)
    return target, draft


def plain_greedy(target, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    return target.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=eos_token_id,
    )


def test_a_hand_made_tree_has_its_depths_ancestors_mask_and_accepted_path():
    # anchor -> a (1), b (2); a -> c (3), d (4); d -> e (5)
    parents = torch.tensor([[0, 0, 1, 1, 4]])
    tokens = torch.tensor([[7, 8, 9, 10, 11]])
    assert tree_depths(parents).tolist() == [[0, 1, 1, 2, 2, 3]]
    ancestry = tree_ancestry(parents)[0]
    assert ancestry[5].nonzero().flatten().tolist() == [0, 1, 4, 5]  # e sees the anchor, a, d and itself
    assert ancestry[2].nonzero().flatten().tolist() == [0, 2]
    mask = tree_attention_mask(parents, torch.tensor([[1, 0, 1]]), torch.float32)
    assert mask.shape == (1, 1, 6, 3 + 6)
    assert (mask[0, 0, :, 1] < 0).all() and (mask[0, 0, :, [0, 2]] == 0).all()  # a hole is masked for every node
    # The target picks a at the anchor, d after a, then 3 after d: two accepted, then its own token 3.
    choice = torch.tensor([[7, 10, 0, 0, 3, 0]])
    logits = torch.nn.functional.one_hot(choice, 12).double()
    accepted, count, next_token, valid = accept_tree(tokens, parents, logits)
    assert count.tolist() == [2] and accepted[0, :2].tolist() == [7, 10] and next_token.tolist() == [3]
    assert valid[0].nonzero().flatten().tolist() == [0, 1, 4]
    assert left_the_first_branch(parents, valid).tolist() == [True]  # d is a's second child


def test_sampling_down_a_hand_made_tree_draws_each_token_from_the_targets_distribution():
    """The first committed token follows the target's (processed) distribution at the anchor, and where it is a node,
    the second follows the distribution at that node: whether the tree holds the likely tokens (a: the anchor's),
    unlikely ones (b), or one the target rules out (e, outside the top-k). A sampler that tried siblings against the
    whole distribution instead of what is left of it, or kept rejected tokens in what is left, fails by a wide
    margin."""
    # anchor -> a (1), b (2), e (3); a -> c (4); c -> d (5)
    parents = torch.tensor([[0, 0, 0, 1, 4]])
    tokens = torch.tensor([[3, 5, 0, 2, 4]])
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)])
    logits = torch.randn(1, 6, 6, generator=torch.Generator().manual_seed(0)) * 2  # [anchor, nodes] x 6 tokens
    anchor = torch.tensor([1e-4, 0.01, 0.05, 0.5, 0.15, 0.3])  # a likely, b less, e ruled out by the top-k
    logits[0, 0] = 0.7 * anchor.log()  # the temperature's undone: these are the anchor's probabilities
    num_samples = 20000
    batch = (tokens.expand(num_samples, -1), parents.expand(num_samples, -1), logits.expand(num_samples, -1, -1))
    accepted, count, next_token, valid = sample_tree(*batch, warpers, torch.Generator().manual_seed(1))
    probs = [warpers(None, slot[None])[0].softmax(-1).tolist() for slot in logits[0]]  # per verify slot
    slot_of = {3: 1, 5: 2}  # the anchor's children whose own slot gives the next token
    exact = {}
    for first, p_first in enumerate(probs[0]):
        for second, p_second in enumerate(probs[slot_of[first]]) if first in slot_of else [(None, 1.0)]:
            exact[(first, second)] = p_first * p_second
    samples = []
    for row_accepted, row_count, row_next in zip(accepted.tolist(), count.tolist(), next_token.tolist()):
        committed = row_accepted[:row_count] + [row_next]
        samples.append((committed[0], committed[1] if committed[0] in slot_of else None))
    assert all(sample in exact and exact[sample] > 0 for sample in samples)  # e is never accepted
    statistic, bound = chi_square_test(samples, exact)
    assert statistic < bound, f"chi-square {statistic:.1f} >= {bound:.1f}"
    assert 0 < float((count >= 2).double().mean()) < 1  # rounds go past a and stop at c
    assert (valid[:, 0]).all() and torch.equal(valid[:, 1:].sum(-1), count)


def drafted_block(target, draft, prompts: torch.Tensor):
    """The draft's block after the last token of each row of `prompts` `[B, T]`, the tokens before it as context."""
    outputs = target(prompts, output_hidden_states=True)
    cache = DominoContextCache()
    positions = torch.arange(prompts.shape[1]).expand_as(prompts)
    features = draft.fuse_target_hidden_states(outputs.hidden_states)
    draft.extend_context(cache, features[:, :-1], positions[:, :-1])
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    return draft.block_logits(prompts[:, -1], positions[:, -1], cache, embed, head)


def test_a_trees_first_branch_is_the_greedy_chain_and_path_probabilities_fall_along_it():
    target, draft = small_vocabulary_models("qwen3")
    prompt = random_prompts(1, seed=3, vocab_size=VOCAB_SIZE)[0]
    embed = target.get_input_embeddings()
    block = drafted_block(target, draft, prompt)
    chain = draft.draft_from_block(block, embed, options=DraftingOptions())
    tree = grow_tree(draft, block, embed, num_nodes=3 * CHILDREN_PER_NODE, max_depth=draft.config.num_draft_tokens)
    node, path = 0, []
    while True:  # follow each node's first child
        children = (tree.parents[0] == node).nonzero().flatten()
        if children.numel() == 0:
            break
        node = int(children[0]) + 1
        path.append(node - 1)
    assert tree.tokens[0, path].tolist() == chain.tokens[0, : len(path)].tolist()
    assert torch.allclose(tree.path_probs[0, path], chain.confidence[0, : len(path)].cumprod(0).float(), rtol=1e-4)
    assert (tree.parents < torch.arange(1, tree.parents.shape[1] + 1)).all()  # a parent comes before its children


@pytest.mark.parametrize("num_nodes", [1, 7, 2 * CHILDREN_PER_NODE])
def test_each_row_of_a_batch_grows_the_tree_it_grows_alone(num_nodes):
    target, draft = small_vocabulary_models("llama")
    prompts = torch.randint(0, VOCAB_SIZE, (3, 9), generator=torch.Generator().manual_seed(4))
    embed, max_depth = target.get_input_embeddings(), draft.config.num_draft_tokens
    batched = grow_tree(draft, drafted_block(target, draft, prompts), embed, num_nodes, max_depth)
    for row in range(prompts.shape[0]):
        alone = grow_tree(draft, drafted_block(target, draft, prompts[row : row + 1]), embed, num_nodes, max_depth)
        assert batched.tokens[row].tolist() == alone.tokens[0].tolist()
        assert batched.parents[row].tolist() == alone.parents[0].tolist()
        assert torch.allclose(batched.path_probs[row], alone.path_probs[0], rtol=1e-6)
    assert batched.tokens.shape == (prompts.shape[0], num_nodes)
    assert len({tuple(row) for row in batched.tokens.tolist()}) > 1  # the rows' trees differ: a mix-up would show


def test_a_tree_round_lays_out_the_heads_weights_as_the_runs_options_say():
    target, draft = small_vocabulary_models("llama")
    prompt = random_prompts(1, seed=4, vocab_size=VOCAB_SIZE)[0]
    expected = plain_greedy(target, prompt, 10, None)
    output = speculative_generate(target, draft, prompt, max_new_tokens=10, eos_token_id=[], options=TREE)
    assert output.tree_rounds > 0 and "gate_table" not in draft.head.derived  # the default: no table
    with_table = dataclasses.replace(TREE, gate_table_max_bytes=2**30)
    output = speculative_generate(target, draft, prompt, max_new_tokens=10, eos_token_id=[], options=with_table)
    assert output.tree_rounds > 0 and "gate_table" in draft.head.derived
    assert torch.equal(output.sequences, expected)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_tree_decoding_is_plain_greedy_decoding(family):
    target, draft = small_vocabulary_models(family)
    draft.drafting_options = TREE
    branch_wins = 0
    for index, prompt in enumerate(random_prompts(16, seed=0, vocab_size=VOCAB_SIZE)):
        max_new_tokens = 9 + index % 7  # length limits at every depth of a tree
        eos_token_id = index % VOCAB_SIZE if index % 2 else None  # EOS inside a round
        expected = plain_greedy(target, prompt, max_new_tokens, eos_token_id)
        output = speculative_generate(
            target,
            draft,
            prompt,
            max_new_tokens=max_new_tokens,
            eos_token_id=[] if eos_token_id is None else eos_token_id,
        )
        assert torch.equal(output.sequences, expected), index
        assert output.tree_rounds == output.num_rounds - output.plain_rounds  # a plain round where one token is left
        branch_wins += output.branch_wins
    assert branch_wins > 0  # accepted nodes a chain would not have verified

    prompts = random_prompts(6, seed=1, vocab_size=VOCAB_SIZE)
    input_ids, attention_mask = left_pad(prompts, 0)
    output = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=14, eos_token_id=5)
    for row, prompt in enumerate(prompts):  # every row its own tree, in one pass
        generated = plain_greedy(target, prompt, 14, eos_token_id=5)[0, prompt.shape[1] :]
        assert output.sequences[row, input_ids.shape[1] :][: generated.numel()].tolist() == generated.tolist()


def test_a_looked_up_branch_joins_the_tree_sorted_by_path_probability():
    # row 0: anchor -> 5 (0.6) -> 6 (0.3); anchor -> 7 (0.2). Row 1: anchor -> 8 (0.9) -> 9 (0.5) -> 10 (0.1).
    tree = DraftTree(
        tokens=torch.tensor([[5, 6, 7], [8, 9, 10]]),
        parents=torch.tensor([[0, 1, 0], [0, 1, 2]]),
        path_probs=torch.tensor([[0.6, 0.3, 0.2], [0.9, 0.5, 0.1]]),
    )
    branches = [
        (torch.tensor([5, 4, 3]), torch.tensor([0.8, 0.7, 0.25], dtype=torch.float64)),  # shares 5, then new nodes
        (torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.float64)),  # no repeat in this row
    ]
    merged = add_branch(tree, branches, max_nodes=5)
    # row 0 by path probability: 5 (raised to 0.8), 4 (0.7, under 5), 6 (0.3, under 5), 3 (0.25, under 4), 7 (0.2)
    assert merged.tokens[0].tolist() == [5, 4, 6, 3, 7]
    assert merged.parents[0].tolist() == [0, 1, 1, 2, 0]
    assert merged.path_probs[0].tolist() == pytest.approx([0.8, 0.7, 0.3, 0.25, 0.2])
    assert merged.looked_up[0].tolist() == [False, True, False, True, False]
    # row 1 unchanged, padded with a child of the anchor of probability 0
    assert merged.tokens[1, :3].tolist() == [8, 9, 10] and merged.parents[1].tolist() == [0, 1, 2, 0, 0]
    assert merged.path_probs[1].tolist() == pytest.approx([0.9, 0.5, 0.1, 0.0, 0.0])
    assert not merged.looked_up[1].any()
    cut = add_branch(tree, branches, max_nodes=3)  # the least likely nodes go first
    assert cut.tokens[0].tolist() == [5, 4, 6] and cut.tokens.shape == (2, 3)
    depths = tree_depths(merged.parents)
    assert (depths[:, 1:] >= 1).all() and depths[0, 1:].tolist() == [1, 2, 2, 3, 1]
    assert add_branch(tree, [branches[1], branches[1]], max_nodes=5) is tree  # nothing looked up: the tree as it was


def test_greedy_trees_with_looked_up_branches_are_plain_greedy_decoding():
    """Prompts that repeat themselves give prompt lookup continuations; each joins its row's tree as a branch, and
    rounds accept nodes only that branch proposed. Output stays plain greedy decoding."""
    target, draft = small_vocabulary_models("qwen3")
    flat = DraftCosts(verify_seconds=(1.0,) * 9, draft_seconds=0.01)  # every round drafts, every node verified
    draft.drafting_options = DraftingOptions(draft_length="cost", draft_costs=flat, tree_nodes=8, prompt_lookup=3)
    lookup_wins = 0
    for index, prompt in enumerate(random_prompts(8, seed=3, vocab_size=VOCAB_SIZE)):
        prompt = torch.cat([prompt, prompt, prompt], dim=-1)
        max_new_tokens = 10 + index % 5
        expected = plain_greedy(target, prompt, max_new_tokens)
        output = speculative_generate(target, draft, prompt, max_new_tokens=max_new_tokens, eos_token_id=[])
        assert torch.equal(output.sequences, expected), index
        lookup_wins += output.lookup_wins
    assert lookup_wins > 0


def lora_wrapped(target):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(target, config).eval()


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "llama-lora"])
def test_trees_on_other_families_and_a_peft_wrapped_target_are_plain_greedy_decoding(family):
    """Each family's attention takes the tree mask and the node positions (gemma3: its sliding layers' window
    spans the whole run, so the holes stay inside it)."""
    overrides = {"sliding_window": 1000} if family == "gemma3" else {}
    target = tiny_target(family.removesuffix("-lora"), dtype=torch.float64, vocab_size=VOCAB_SIZE, **overrides)
    target.generation_config.eos_token_id = None
    if family.endswith("-lora"):
        target = lora_wrapped(target)
    draft = tiny_draft(target, block_size=6).to(torch.float64)
    draft.drafting_options = TREE
    tree_rounds = 0
    for index, prompt in enumerate(random_prompts(6, seed=4, vocab_size=VOCAB_SIZE)):
        expected = plain_greedy(target, prompt, 10 + index)
        output = speculative_generate(target, draft, prompt, max_new_tokens=10 + index, eos_token_id=[])
        assert torch.equal(output.sequences, expected), index
        tree_rounds += output.tree_rounds
    assert tree_rounds > 0  # trees, not the chains of a fallback


def test_cost_aware_trees_verify_only_the_nodes_that_pay():
    target, draft = small_vocabulary_models("qwen3")
    steep = DraftCosts(verify_seconds=tuple(1.0 + 0.15 * k for k in range(9)), draft_seconds=0.1)
    per_round = {}
    for draft_length in ("cost", "full"):
        draft.drafting_options = DraftingOptions(
            draft_length=draft_length, draft_costs=steep, tree_nodes=8, prompt_lookup=0
        )
        prompt = random_prompts(1, seed=5, vocab_size=VOCAB_SIZE)[0]
        output = speculative_generate(target, draft, prompt, max_new_tokens=24, eos_token_id=[])
        assert torch.equal(output.sequences, plain_greedy(target, prompt, 24))
        per_round[draft_length] = output.drafts_verified / output.num_rounds
    assert per_round["cost"] < per_round["full"]


def eight_tokens(target, draft, prompt: torch.Tensor, do_sample: bool):
    return speculative_generate(
        target,
        draft,
        prompt,
        max_new_tokens=8,
        do_sample=do_sample,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )


def test_sampled_rounds_verify_trees_too():
    target, draft = small_vocabulary_models("qwen3")
    draft.drafting_options = TREE
    prompt = random_prompts(1, seed=2, vocab_size=VOCAB_SIZE)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        output = eight_tokens(target, draft, prompt, do_sample=True)
    assert output.tree_rounds > 0 and output.drafts_verified == 12 * output.tree_rounds
    assert output.num_new_tokens == [8]
    with pytest.raises(ValueError, match="tree_nodes=-1 is invalid"):
        DraftingOptions(tree_nodes=-1)


def test_by_default_cost_aware_greedy_rounds_verify_trees_and_others_chains_silently():
    """`tree_nodes=None` (the default): trees of up to `AUTO_TREE_NODES` where the length is cost-aware (on CPU) and
    the run can verify them and decodes greedily; chains, without a warning, where it verifies every draft or samples
    (trees there only where `tree_nodes` asks for them)."""
    target, draft = small_vocabulary_models("qwen3")
    flat = DraftCosts(verify_seconds=(1.0,) * (AUTO_TREE_NODES + 1), draft_seconds=0.01)
    prompt = random_prompts(1, seed=6, vocab_size=VOCAB_SIZE)[0]
    assert DraftingOptions().tree_nodes is None
    assert DraftingOptions().tree_budget(torch.device("cpu")) == AUTO_TREE_NODES
    assert DraftingOptions().tree_budget(torch.device("cuda")) == 0  # "auto" verifies whole blocks there
    assert DraftingOptions().tree_budget(torch.device("cpu"), do_sample=True) == 0
    assert DraftingOptions(tree_nodes=8).tree_budget(torch.device("cpu"), do_sample=True) == 8
    draft.drafting_options = DraftingOptions(draft_costs=flat, prompt_lookup=0)
    output = speculative_generate(target, draft, prompt, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(output.sequences, plain_greedy(target, prompt, 16))
    assert output.tree_rounds > 0 and output.drafts_verified > output.num_rounds * draft.config.num_draft_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        for options, do_sample in ((DraftingOptions(draft_length="full"), False), (draft.drafting_options, True)):
            draft.drafting_options = options
            assert eight_tokens(target, draft, prompt, do_sample).tree_rounds == 0
