"""The Domino head at inference: a GRU over the block's tokens and a low-rank logit residual, slot by slot.

Split into weight layouts (`DominoHeadWeights`, derived once per weight version by the model), per-block inputs
(`head_block_inputs`) and the slot loop (`head_slot_loop`). Tensors in, tensors out: the greedy head (`greedy_head`)
has no Python callback, so `DominoDraftModel.compile_drafting` can capture it in one graph (`CompiledDrafting`).

On CUDA, `fused_pooled_slot_loop` runs the greedy pooled loop as one Triton kernel per slot (`head_step_triton.py`).

Copied into every saved checkpoint with `modeling_domino.py` (`trust_remote_code`): imports only torch (and Triton
through `head_step_triton.py`, where it is installed).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .head_step_triton import head_step

# Shapes: M rows (sequences, or blocks in training), S drafts per block, V vocabulary, D hidden, G GRU state,
# R rank of the logit residual, K candidate pool.


def select_token(logits: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """Argmax, or a sample from softmax(logits); `logits` is `[..., V]`, already processed."""
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = logits.float().softmax(dim=-1)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), num_samples=1, generator=generator)
    return flat.view(probs.shape[:-1])


def slot_chooser(
    prefix_ids: torch.LongTensor | None, logits_processor: Callable | None, do_sample: bool, generator=None
) -> Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The head loop's `choose` for processed or sampled drafting; the processor sees `prefix_ids` + drafts so far."""
    drafted = prefix_ids

    def choose(slot: int, slot_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal drafted
        if logits_processor is not None:
            slot_logits = logits_processor(drafted, slot_logits)
        token = select_token(slot_logits, do_sample, generator)
        if drafted is not None:
            drafted = torch.cat([drafted, token[:, None]], dim=-1)
        return token, slot_logits

    return choose


def _greedy_pool_logits(
    base_logits: torch.Tensor, pool_logits: torch.Tensor, pool_ids: torch.Tensor, first_corrected: int
) -> torch.Tensor:
    """Greedy pooled drafting's logits `[M, S, V]`: the base logits of the slots before `first_corrected`, then each
    corrected slot's pool logits (`[M, S - first_corrected, K]`) over its `pool_ids` (`[M, S, K]`), -inf elsewhere."""
    spread = pool_logits.new_full((*pool_logits.shape[:2], base_logits.shape[-1]), float("-inf"))
    spread.scatter_(-1, pool_ids[:, first_corrected:], pool_logits)
    return torch.cat([base_logits[:, :first_corrected], spread], dim=1)


def gru_cell(input_gates: torch.Tensor, state_gates: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One step of a bias-free `nn.GRU` from its projected gates.

    `input_gates` = x @ W_ih^T and `state_gates` = h @ W_hh^T (`[M, 3G]`, PyTorch's r|z|n order), `state` `[M, G]`.
    Taking projections lets the head loop precompute the input side and fuse the state side with other matmuls.
    """
    gate_size = state.shape[-1]
    reset, update = torch.sigmoid(input_gates[:, : 2 * gate_size] + state_gates[:, : 2 * gate_size]).chunk(2, dim=-1)
    candidate = torch.tanh(input_gates[:, 2 * gate_size :] + reset * state_gates[:, 2 * gate_size :])
    return candidate + update * (state - candidate)


class DominoHeadWeights(NamedTuple):
    """The Domino head's weights in the layouts the slot loop reads (built by `DominoDraftModel._head_weights`)."""

    weight_ih: torch.Tensor  # [3G, D]: GRU input projection (the anchor's gates; every token's without a table)
    embed_tokens: nn.Module  # the target's input embeddings: drafted tokens go through it, as the anchor does
    gate_table: torch.Tensor | None  # [V, 3G] = E @ W_ih^T: a drafted token's gates in one row lookup, or None
    state_weight: torch.Tensor  # [3G + R, G]: W_hh and the state's half of the low-rank map, fused into one matmul
    down: torch.Tensor  # [R, D + G]: the low-rank map's input side
    up: torch.Tensor  # [V, R]: its vocabulary side (rows gathered for a candidate pool)
    up_columns: torch.Tensor | None  # [R, V] in the logits' dtype, contiguous (fast GEMV); None with a pool


class DominoHeadBlock(NamedTuple):
    """Per-block inputs of the slot loop: everything that does not depend on the drafted tokens."""

    hidden_part: torch.Tensor  # [M, S, R]: the hidden-state half of the low-rank map, all slots at once
    state: torch.Tensor  # [M, G]: the GRU state after reading the anchor
    pool_ids: torch.Tensor | None = None  # [M, S, K]: each slot's candidate pool, its K best base tokens
    pool_base: torch.Tensor | None = None  # [M, S, K]: their base logits
    pool_up: torch.Tensor | None = None  # [M, S, K, R]: their rows of `up`


def gru_input_gates(weights: DominoHeadWeights, tokens: torch.Tensor) -> torch.Tensor:
    """GRU input gates `[..., 3G]` of token ids `[...]`: a table row, else the token's embedding times W_ih."""
    if weights.gate_table is not None:
        return weights.gate_table[tokens]
    return F.linear(weights.embed_tokens(tokens).to(weights.weight_ih.dtype), weights.weight_ih)


def head_block_inputs(
    base_logits: torch.Tensor,
    draft_hidden: torch.Tensor,
    anchor_embeds: torch.Tensor,
    weights: DominoHeadWeights,
    pool_size: int = 0,
) -> DominoHeadBlock:
    """What the slot loop needs of a block (`[M, S, V]` base logits, `[M, S, D]` hidden, `[M, D]` anchor embeds)."""
    hidden_part = F.linear(draft_hidden, weights.down[:, : draft_hidden.shape[-1]])  # [M, S, R]
    zeros = draft_hidden.new_zeros(draft_hidden.shape[0], weights.state_weight.shape[1])  # [M, G]
    anchor_gates = F.linear(anchor_embeds.to(weights.weight_ih.dtype), weights.weight_ih)  # [M, 3G]
    state = gru_cell(anchor_gates, zeros.new_zeros(zeros.shape[0], weights.weight_ih.shape[0]), zeros)
    if not pool_size:
        return DominoHeadBlock(hidden_part, state)
    pool_ids = base_logits.topk(pool_size, dim=-1).indices  # [M, S, K]
    pool_up = weights.up[pool_ids].to(base_logits.dtype)  # [M, S, K, R]
    return DominoHeadBlock(hidden_part, state, pool_ids, base_logits.gather(-1, pool_ids), pool_up)


def head_slot_loop(
    base_logits: torch.Tensor,
    block: DominoHeadBlock,
    weights: DominoHeadWeights,
    first_corrected: int,
    choose: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part of a drafting round over the S slots of `[M, S, V]` base logits.

    Per slot: one matmul of the GRU state (its recurrent gates and its half of the low-rank map, fused), the
    rank-R residual fused with the base-logit add (only over the slot's candidate pool when `block` has one, in
    greedy drafting: the other tokens get -inf), a pick, and the GRU step on the picked token. Slots before
    `first_corrected` (`pure_draft_prefix_len`) keep their base logits. `choose(s, logits)` returns `(token, logits
    it was drawn from)`; `None` is greedy argmax with no Python callback, which is what makes the loop compilable
    (unrolled). Returns `[M, S]` tokens and `[M, S, V]` logits.
    """
    num_slots = base_logits.shape[1]
    gate_size = weights.weight_ih.shape[0]
    state, pooled = block.state, block.pool_ids is not None
    if pooled and choose is not None:
        raise ValueError(
            "A candidate pool is for greedy drafting (choose=None): a logits processor could mask all of it. Build "
            "the block with pool_size=0 for processed or sampled drafting."
        )
    tokens, logits = [], []
    for slot in range(num_slots):
        state_gates, state_part = F.linear(state, weights.state_weight).split(
            [gate_size, weights.state_weight.shape[0] - gate_size], dim=-1
        )
        slot_logits, candidates = base_logits[:, slot], None  # candidates: the token ids slot_logits cover (None: all)
        if slot >= first_corrected:
            activation = F.silu(block.hidden_part[:, slot] + state_part).to(base_logits.dtype)  # [M, R]
            if pooled:
                candidates = block.pool_ids[:, slot]
                slot_logits = block.pool_base[:, slot] + (block.pool_up[:, slot] @ activation[:, :, None]).squeeze(-1)
            else:
                slot_logits = torch.addmm(slot_logits, activation, weights.up_columns)
        if choose is None:  # greedy: pick inside the pool, spread its logits to the vocabulary once at the end
            token = slot_logits.argmax(dim=-1)
            if candidates is not None:
                token = candidates.gather(-1, token[:, None]).squeeze(-1)
        else:
            token, slot_logits = choose(slot, slot_logits)
        tokens.append(token)
        logits.append(slot_logits)
        if slot + 1 < num_slots:
            state = gru_cell(gru_input_gates(weights, token), state_gates, state)
    if pooled and first_corrected < num_slots:
        pool_logits = torch.stack(logits[first_corrected:], dim=1)  # [M, S - first_corrected, K]
        logits = _greedy_pool_logits(base_logits, pool_logits, block.pool_ids, first_corrected)
        return torch.stack(tokens, dim=1), logits
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)


def fused_pooled_slot_loop(
    base_logits: torch.Tensor, block: DominoHeadBlock, weights: DominoHeadWeights, first_corrected: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_slot_loop` for greedy drafting with a candidate pool, one Triton launch per slot (`head_step_triton`).

    Each pool token's GRU input gates are looked up (or projected) once per block instead of once per slot, so a
    slot is the launch alone. Slots before `first_corrected` draft their base argmax: it goes first in their pool.
    """
    num_slots = base_logits.shape[1]
    pool_ids = block.pool_ids.clone()
    pool_ids[:, :first_corrected, 0] = base_logits[:, :first_corrected].argmax(dim=-1)
    pool_gates = gru_input_gates(weights, pool_ids).contiguous()  # [M, S, K, 3G]
    tokens = pool_ids[:, :, 0].contiguous()  # [M, S]: the kernel overwrites the corrected slots'
    pool_logits = torch.empty_like(block.pool_base)  # [M, S, K]
    state = block.state.contiguous()
    projected = F.linear(state, weights.state_weight)  # [M, 3G + R]: slot 0's, the only matmul outside the kernel
    for slot in range(num_slots):
        projected, state = head_step(
            projected, state, slot, slot >= first_corrected, slot + 1 < num_slots, tokens, pool_logits,
            block.hidden_part, block.pool_base, block.pool_up, pool_ids, pool_gates, weights.state_weight,
        )  # fmt: skip
    return tokens, _greedy_pool_logits(base_logits, pool_logits[:, first_corrected:], pool_ids, first_corrected)


def greedy_head(
    base_logits: torch.Tensor,
    draft_hidden: torch.Tensor,
    anchor_embeds: torch.Tensor,
    weights: DominoHeadWeights,
    first_corrected: int,
    pool_size: int = 0,
    fused_step: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole greedy head of a block as one pure tensor function: what `compile_drafting` captures.

    `fused_step` (needs a pool) runs the slots with `fused_pooled_slot_loop` instead of `head_slot_loop`.
    """
    block = head_block_inputs(base_logits, draft_hidden, anchor_embeds, weights, pool_size)
    if fused_step:
        return fused_pooled_slot_loop(base_logits, block, weights, first_corrected)
    return head_slot_loop(base_logits, block, weights, first_corrected)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


class CompiledDrafting:
    """What `DominoDraftModel.compile_drafting` builds: the compiled backbone and greedy head (not modules)."""

    def __init__(self, backbone: Callable[..., torch.Tensor], mode: str, dynamic_backbone: bool):
        self.mode, self.dynamic_backbone = mode, dynamic_backbone
        # With dynamic shapes, CUDA graphs would still be recorded once per context length: compile without them.
        backbone_mode = _WITHOUT_CUDA_GRAPHS.get(mode, mode) if dynamic_backbone else mode
        self._backbone_graphs = backbone_mode in _WITHOUT_CUDA_GRAPHS
        self._backbone = torch.compile(backbone, mode=backbone_mode, dynamic=dynamic_backbone)
        self._greedy_head = torch.compile(greedy_head, mode=mode, dynamic=False)

    def backbone(self, *args) -> torch.Tensor:
        """`DominoDraftModel.backbone`, compiled."""
        if not self._backbone_graphs:
            return self._backbone(*args)
        torch.compiler.cudagraph_mark_step_begin()
        return self._backbone(*args).clone()  # the head's graph must not read a buffer a later replay rewrites

    def greedy_head(
        self,
        base_logits: torch.Tensor,
        draft_hidden: torch.Tensor,
        anchor_embeds: torch.Tensor,
        weights: DominoHeadWeights,
        first_corrected: int,
        pool_size: int,
        fused_step: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy_head`, compiled; returns tensors the caller owns."""
        for tensor in weights:
            if isinstance(tensor, torch.Tensor):
                # Weights keep their address across calls: CUDA graphs read them in place instead of copying them
                # into the graph's input buffers every call (parameters are marked so by torch.compile already).
                torch._dynamo.mark_static_address(tensor)
        torch.compiler.cudagraph_mark_step_begin()  # a new drafting round: earlier graph outputs may be overwritten
        inputs = (base_logits, draft_hidden, anchor_embeds, weights, first_corrected, pool_size, fused_step)
        tokens, logits = self._greedy_head(*inputs)
        return tokens.clone(), logits.clone()  # the next replay overwrites a CUDA graph's outputs


__all__ = [
    "COMPILE_MODES",
    "CompiledDrafting",
    "DominoHeadBlock",
    "DominoHeadWeights",
    "fused_pooled_slot_loop",
    "greedy_head",
    "gru_cell",
    "gru_input_gates",
    "head_block_inputs",
    "head_slot_loop",
    "select_token",
    "slot_chooser",
]
