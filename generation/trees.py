"""Domino trees: a round verifies a tree of drafts, not a chain, in one target pass.

The backbone runs once per round, as for a chain. The head is causal, so each branch gets its own corrected
distribution: rolling the GRU along a branch's tokens over the backbone's states gives the distribution of that node's
children. `grow_tree` adds nodes best first (two a step in large trees), by the probability the draft gives the path to
each (the product of the head's probabilities along it, warped as the run samples), so every prefix of its nodes is a
tree and the cost-aware length keeps the prefix that pays. Where the context's last tokens occurred before, the tokens
that followed them there (prompt lookup) join the tree as one more branch (`add_branch`), with the probability the run's
earlier looked-up tokens give each. Greedy verification follows the target's argmax down the tree (`accept_tree`): the
output is the target's own greedy decoding. Sampled verification (`sample_tree`) tries each reached node's children in
turn against what is left of the target's distribution there: the tree's tokens are chosen, not drawn, so each is a
draft whose q is all on it, and the output is distributed as the target's own sampling.

The verify pass reads `[anchor, node_1..node_N]`; each node attends to the committed cache and to its ancestors only
(`tree_attention_mask`), at position anchor + depth. The engine keeps the accepted path's slots and masks the rest as
holes, as it does for a batch's rejected drafts.

Shapes: B rows, N nodes, m nodes added a step, K children offered per node, V draft vocabulary, G GRU state, R rank,
C cache slots.
"""

import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList

from ..drafting import DraftingOptions, DraftSampling, DraftTree
from ..head_domino import block_inputs, gru_cell, input_gates, token_ids
from ..modeling_domino import DominoBlock
from .sampling import process_logits, sample

CHILDREN_PER_NODE = 8  # each node offers its K likeliest next tokens; 8 accepts 2-4% more than 4 at 8 nodes, 16 no more
# Nodes a growing step adds at once, in one batched GRU step, in trees of at least PAIRED_FROM nodes: on CPU, where a
# step is a dozen small operations, 2 grow a 16-node tree in ~30% less time than 1, accepted as often (4 cut deep
# paths short). A smaller tree grows one node a step: there a pair spends nodes on siblings that a confident path would
# not take (gsm_symbolic's tau -13% at 4 nodes, -1.6% at 8; BENCHMARKS.md, trees).
NODES_PER_STEP, PAIRED_FROM = 2, 16


@torch.no_grad()
def grow_tree(
    draft,
    block: DominoBlock,
    embed_tokens: torch.nn.Module,
    num_nodes: int,
    max_depth: int,
    options: DraftingOptions | None = None,
    sampling: DraftSampling | None = None,
) -> DraftTree:
    """A tree of `num_nodes` drafts per row, at most `max_depth` deep, from the backbone's `block`, with the head's
    weights laid out as `options` say (the draft's `drafting_options` by default).

    Best first, `NODES_PER_STEP` at a time from `PAIRED_FROM` nodes on, else one: each step adds, in every row, the
    candidates with the highest path probabilities, runs the GRU on their tokens from their parents' states, and
    offers each one's K likeliest children (the head's logits at the slot of its depth, with `sampling`'s
    temperature, top-k and top-p where the run samples, as the target's warpers shape what it samples). A row whose
    candidates run out adds nodes of path probability 0, which the cost-aware length leaves out.
    """
    head = draft.head
    options = options or draft.drafting_options
    weights = head.weights(embed_tokens, draft.draft_vocab, block.base_logits.dtype, options, whole_vocabulary=True)
    inputs = block_inputs(block.base_logits, block.hidden, block.anchor_embeds, weights)
    base_logits, rows = block.base_logits, torch.arange(block.base_logits.shape[0], device=block.base_logits.device)
    batch_size, state_width = rows.shape[0], weights.weight_ih.shape[0]  # B, 3G

    def offer(state: torch.Tensor, depth: torch.Tensor, path_prob: torch.Tensor, row: torch.Tensor):
        """The K likeliest children `[M, K]` of M nodes of rows `row` `[M]` with GRU `state` `[M, G]` at `depth`
        `[M]`: their draft vocabulary indices and path probabilities, and the nodes' state projection `[M, 3G + R]`."""
        projected = F.linear(state, weights.state_weight)
        slot = depth.clamp(max=base_logits.shape[1] - 1)
        logits = base_logits[row, slot]  # [M, V]
        activation = F.silu(inputs.hidden_part[row, slot] + projected[:, state_width:]).to(logits.dtype)  # [M, R]
        residual = activation @ weights.up_columns
        logits = torch.where((slot >= head.first_corrected_slot)[:, None], logits + residual, logits)
        logits = logits.float() if sampling is None else sampling.warp(logits.float())
        probs, indices = logits.softmax(-1).topk(CHILDREN_PER_NODE, dim=-1)
        probs = torch.where((depth < max_depth)[:, None], probs * path_prob[:, None], -1.0)  # none past the depth
        return indices, probs, projected

    root_depth = torch.zeros_like(rows)
    indices, probs, projected = offer(inputs.state, root_depth, torch.ones_like(rows, dtype=torch.float32), rows)
    candidates = [indices, probs, torch.zeros_like(indices), torch.ones_like(indices)]  # index, prob, parent, depth
    states, projections = [inputs.state[:, None]], [projected[:, None]]  # node i's at [:, i] once concatenated
    tokens, parents, path_probs = [], [], []
    num_added, per_step = 0, NODES_PER_STEP if num_nodes >= PAIRED_FROM else 1
    while num_added < num_nodes:
        step = min(per_step, num_nodes - num_added)
        prob = candidates[1]
        best = prob.topk(step, dim=-1).indices  # [B, m]
        chosen_index, chosen_prob, chosen_parent, chosen_depth = (c.gather(1, best) for c in candidates)  # [B, m]
        prob.scatter_(1, best, -1.0)  # taken
        parent_state = torch.cat(states, 1)[rows[:, None], chosen_parent].flatten(0, 1)  # [B*m, G]
        parent_gates = torch.cat(projections, 1)[rows[:, None], chosen_parent, :state_width].flatten(0, 1)  # [B*m, 3G]
        state = gru_cell(input_gates(weights, chosen_index).flatten(0, 1), parent_gates, parent_state)
        path_prob = chosen_prob.clamp(min=0.0)
        new_indices, new_probs, projected = offer(
            state, chosen_depth.flatten(), path_prob.flatten(), rows.repeat_interleave(step)
        )
        states.append(state.view(batch_size, step, -1))
        projections.append(projected.view(batch_size, step, -1))
        new_nodes = num_added + 1 + torch.arange(step, device=rows.device)  # their numbers (0: the anchor)
        offered = (
            new_indices.view(batch_size, -1),
            new_probs.view(batch_size, -1),
            new_nodes.repeat_interleave(CHILDREN_PER_NODE).expand(batch_size, -1),
            (chosen_depth + 1).repeat_interleave(CHILDREN_PER_NODE, dim=1),
        )
        candidates = [torch.cat([old, new], 1) for old, new in zip(candidates, offered)]
        tokens.append(token_ids(chosen_index, draft.draft_vocab))
        parents.append(chosen_parent)
        path_probs.append(path_prob)
        num_added += step
    return DraftTree(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(path_probs, 1))


def add_branch(tree: DraftTree, branches: list[tuple[torch.Tensor, torch.Tensor]], max_nodes: int) -> DraftTree:
    """`tree` with each row's branch, tokens `[L]` from the anchor down with the probability `[L]` of reaching each,
    merged in: a branch token already a child of the node reached raises that node's path probability to the
    branch's where higher, else it is a new node (`looked_up` marks those). Nodes are re-sorted by path probability
    (shallower first among equals), so every prefix is still a tree, and cut at `max_nodes`; rows with fewer nodes
    are padded with children of the anchor of probability 0."""
    if all(tokens.numel() == 0 for tokens, _ in branches):
        return tree
    merged = []
    for row, (branch_tokens, branch_probs) in enumerate(branches):
        tokens, parents = tree.tokens[row].tolist(), tree.parents[row].tolist()
        probs, looked_up = tree.path_probs[row].tolist(), [False] * len(tokens)
        node = 0  # the anchor
        for token, prob in zip(branch_tokens.tolist(), branch_probs.tolist()):
            child = next((i + 1 for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
            if child is None:
                tokens.append(token)
                parents.append(node)
                probs.append(prob)
                looked_up.append(True)
                child = len(tokens)
            probs[child - 1] = max(probs[child - 1], prob)
            node = child
        depths = tree_depths(torch.tensor([parents]))[0, 1:].tolist()
        order = sorted(range(len(tokens)), key=lambda i: (-probs[i], depths[i]))[:max_nodes]
        position = {old + 1: new + 1 for new, old in enumerate(order)} | {0: 0}
        merged.append([(tokens[i], position[parents[i]], probs[i], looked_up[i]) for i in order])
    num_nodes = max(len(nodes) for nodes in merged)
    padding = (int(tree.tokens[0, 0]), 0, 0.0, False)
    rows = [nodes + [padding] * (num_nodes - len(nodes)) for nodes in merged]

    def column(field: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([[node[field] for node in nodes] for nodes in rows], dtype=dtype, device=tree.tokens.device)

    return DraftTree(
        column(0, tree.tokens.dtype),
        column(1, tree.parents.dtype),
        column(2, tree.path_probs.dtype),
        column(3, torch.bool),
    )


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """The depth `[B, N + 1]` of the anchor (0) and of each node, from `parents` `[B, N]` (0: the anchor)."""
    depths = [torch.zeros_like(parents[:, 0])]
    for node in range(parents.shape[1]):
        depths.append(torch.stack(depths, 1).gather(1, parents[:, node : node + 1]).squeeze(1) + 1)
    return torch.stack(depths, 1)


def tree_ancestry(parents: torch.Tensor) -> torch.Tensor:
    """`[B, N + 1, N + 1]`: whether slot j (the anchor, then the nodes) is slot i itself or one of its ancestors."""
    batch_size, num_nodes = parents.shape
    ancestry = torch.eye(num_nodes + 1, dtype=torch.bool, device=parents.device).repeat(batch_size, 1, 1)
    rows = torch.arange(batch_size, device=parents.device)
    for node in range(1, num_nodes + 1):
        ancestry[:, node] |= ancestry[rows, parents[:, node - 1]]
    return ancestry


def tree_attention_mask(parents: torch.Tensor, slot_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The verify pass's additive mask `[B, 1, N + 1, C + N + 1]`: each slot of `[anchor, nodes]` sees the committed
    cache slots (`slot_mask` `[B, C]`) and its own ancestors; 0 where it attends, the dtype's minimum elsewhere."""
    num_slots = parents.shape[1] + 1
    cache = slot_mask.bool()[:, None, :].expand(-1, num_slots, -1)
    allowed = torch.cat([cache, tree_ancestry(parents)], dim=-1)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=parents.device).masked_fill(~allowed, torch.finfo(dtype).min)


def accept_tree(tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification of a tree: from the anchor, step to the child holding the target's argmax while there is
    one. For `tokens` and `parents` `[B, N]` and the target's logits `[B, N + 1, V]` at `[anchor, nodes]`, returns
    the accepted tokens `[B, N]` (left-aligned), their count `[B]`, the target's next token `[B]`, and which verify
    slots hold committed tokens `[B, N + 1]` (the anchor and the accepted path)."""
    batch_size, num_nodes = tokens.shape
    rows = torch.arange(batch_size, device=tokens.device)
    choice = target_logits.argmax(-1)  # [B, N + 1]
    current = torch.zeros_like(rows)  # the verify slot reached: 0 is the anchor
    accepted = torch.zeros_like(tokens)
    count = torch.zeros_like(rows)
    valid = torch.zeros(batch_size, num_nodes + 1, dtype=torch.bool, device=tokens.device)
    valid[:, 0] = True
    for _ in range(num_nodes):
        wanted = choice[rows, current]  # [B]
        match = (parents == current[:, None]) & (tokens == wanted[:, None])  # [B, N]
        found = match.any(-1)
        if not bool(found.any()):
            break
        child = match.long().argmax(-1)  # the first matching child
        accepted[rows[found], count[found]] = tokens[rows[found], child[found]]
        valid[rows[found], child[found] + 1] = True
        current = torch.where(found, child + 1, current)
        count = count + found.long()
    return accepted, count, choice[rows, current], valid


def sample_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_logits: torch.Tensor,
    warpers: LogitsProcessorList,
    generator: torch.Generator | None = None,
):
    """Exact speculative sampling down a tree whose tokens the draft chose rather than drew. From the anchor, each
    reached node's children are tried in order, each accepted with the probability that the target's distribution
    there, less the children already rejected, gives it; at the first node where none is (or a leaf), the next token
    is drawn from what is left. Each child is a draft whose q is all on it (`certain_logits`), its residual
    max(0, p - q) p without it, so every committed token is distributed as the target's, whichever tokens the tree
    holds. For `tokens` and `parents` `[B, N]`, the target's raw logits `[B, N + 1, V]` at `[anchor, nodes]` (the
    run's `warpers` process the slots reached only), returns what `accept_tree` returns."""
    batch_size, num_nodes = tokens.shape
    accepted = torch.zeros_like(tokens)
    count = torch.zeros(batch_size, dtype=torch.long, device=tokens.device)
    next_token = torch.zeros_like(count)
    valid = torch.zeros(batch_size, num_nodes + 1, dtype=torch.bool, device=tokens.device)
    valid[:, 0] = True
    at_anchor = process_logits(warpers, target_logits[:, 0]).double().softmax(-1)  # [B, V]: every row starts there
    for row, (row_tokens, row_parents) in enumerate(zip(tokens.tolist(), parents.tolist())):
        children = [[] for _ in range(num_nodes + 1)]  # per verify slot, in the order the tree added them
        for node, parent in enumerate(row_parents):
            children[parent].append(node + 1)
        slot = 0
        while True:
            if slot == 0:
                residual = at_anchor[row].clone()  # [V]
            else:
                residual = process_logits(warpers, target_logits[row, slot]).double().softmax(-1)
            for child in children[slot]:
                token = row_tokens[child - 1]
                uniform = torch.rand((), generator=generator, dtype=torch.float64, device=residual.device)
                if uniform * residual.sum() < residual[token]:  # strict: a token the target rules out never passes
                    break
                residual[token] = 0.0
            else:
                next_token[row] = sample(residual, generator)
                break
            accepted[row, count[row]] = token
            count[row] += 1
            valid[row, child] = True
            slot = child
    return accepted, count, next_token, valid


def left_the_first_branch(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`[B]`: whether a row's accepted path took a node other than its parent's first child (the draft's likeliest
    continuation there): a branch a chain would not have verified."""
    num_nodes = parents.shape[1]
    node_ids = torch.arange(num_nodes, device=parents.device)
    # [B, N, N]: node j is an earlier child of node i's parent
    siblings_before = (parents[:, None, :] == parents[:, :, None]) & (node_ids[None, :] < node_ids[:, None])
    return (siblings_before.any(-1) & valid[:, 1:]).any(-1)


__all__ = [
    "CHILDREN_PER_NODE",
    "accept_tree",
    "add_branch",
    "grow_tree",
    "left_the_first_branch",
    "sample_tree",
    "tree_ancestry",
    "tree_attention_mask",
    "tree_depths",
]
