"""The fused head step: one Triton kernel per slot of the greedy pooled head loop, the GPU form of
`head_domino.slot_loop`. `fuse_head_step(draft)` makes a draft's greedy drafting run it (with a candidate pool).

Unfused, a slot costs about ten small dependent kernels (the GRU state matmul, the pool residual, argmax, the
drafted token's gates lookup, the GRU cell), tens of microseconds on a GPU even inside a CUDA graph. Slot s needs
the GRU state's projection `projected_s = state_s @ [W_hh; W_down_state]^T` (`[M, 3G + R]`), which is too big a
matmul for one thread block, and everything after it (pick, GRU step) is tiny. So each launch finishes slot s and
starts slot s + 1: every program recomputes slot s's pick (K x R multiply-adds) and the next GRU state (G values,
chunk by chunk), then writes its own rows of `projected_{s+1}`. Redundant work instead of a grid-wide barrier: one
launch per slot, and the [3G + R, G] weight is read once per slot across the whole GPU. How a launch splits that work
(`LAUNCH_CONFIGS`) is autotuned on the GPU at hand.

Part of the package, not of a checkpoint's code: a draft loaded with `trust_remote_code` gets it from
`fuse_head_step`. Triton ships with CUDA builds of PyTorch; without it this module still imports and
`triton_available()` is False. `TRITON_INTERPRET=1` runs the kernel on CPU tensors (tests).
"""

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..head_domino import BlockInputs, HeadWeights, _pooled_outputs, block_inputs, input_gates, slot_loop, token_ids

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds ship without Triton
    triton = None


class LaunchConfig(NamedTuple):
    """How a launch splits the work of a slot (the kernel's tuned constexprs and warps)."""

    rows_per_program: int  # rows of `projected_{s+1}` a program writes: its tile of the weight, read once per slot
    state_chunk: int  # GRU state values per inner step of the GRU step (weight tile [rows_per_program, state_chunk])
    rank_chunk: int  # residual ranks per inner step of the pick (pool tile [K, rank_chunk])
    num_warps: int


# What `triton.autotune` picks from on CUDA, timing each at the first call of a shape (a few seconds, once per
# process): fewer rows per program mean more programs; small chunks hold few values in registers, whole vectors (one
# inner step at Qwen3-8B's G = 1024, R = 256) wait on memory fewer times per slot. None spills registers at those
# shapes with a pool of 64 on sm_90, with the ptxas of Triton 3.6 or 3.9 (tests/test_head_step_triton.py). The
# interpreter runs the first.
LAUNCH_CONFIGS = (
    LaunchConfig(rows_per_program=16, state_chunk=256, rank_chunk=64, num_warps=4),
    LaunchConfig(rows_per_program=8, state_chunk=256, rank_chunk=64, num_warps=4),
    LaunchConfig(rows_per_program=32, state_chunk=256, rank_chunk=64, num_warps=4),
    LaunchConfig(rows_per_program=16, state_chunk=512, rank_chunk=128, num_warps=8),
    LaunchConfig(rows_per_program=16, state_chunk=1024, rank_chunk=256, num_warps=8),
    # 16 warps leave a thread 128 registers: with whole rank vectors, Triton 3.6's ptxas (the H200 machine's) spills
    LaunchConfig(rows_per_program=16, state_chunk=1024, rank_chunk=128, num_warps=16),
)


def triton_available() -> bool:
    return triton is not None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_runs_on(device: torch.device) -> bool:
    """Whether the kernel can run on tensors of `device`: CUDA with Triton, or any device in interpreter mode."""
    return triton is not None and (device.type == "cuda" or _interpreted())


def _constexprs(config: LaunchConfig) -> dict[str, int]:
    return dict(ROWS_PER_PROGRAM=config.rows_per_program, STATE_CHUNK=config.state_chunk, RANK_CHUNK=config.rank_chunk)


if triton is not None:

    @triton.jit
    def _head_step_kernel(
        projected_ptr,  # [M, P] with P = 3G + R: slot s's state projection (r|z|n gates, then the residual's half)
        state_ptr,  # [M, G]: slot s's GRU state
        next_projected_ptr,  # [M, P]: written, slot s + 1's projection
        next_state_ptr,  # [M, G]: written, slot s + 1's state
        tokens_ptr,  # [M, S] int64: slot s's token, written when PICK
        pool_logits_ptr,  # [M, S, K]: written when PICK
        hidden_part_ptr,  # [M, S, R]: the hidden-state half of the low-rank map
        pool_base_ptr,  # [M, S, K]: base logits of each slot's pool
        pool_up_ptr,  # [M, S, K, R]: the pool tokens' rows of `up`
        pool_ids_ptr,  # [M, S, K] int64; a slot that does not PICK drafts its pool's first token
        pool_gates_ptr,  # [M, S, K, 3G]: the pool tokens' GRU input gates
        state_weight_ptr,  # [P, G]: W_hh stacked over the state's half of the low-rank map
        slot,
        num_slots,
        state_size,
        rank,
        pool_size,
        PICK: tl.constexpr,  # pick slot s's token from its corrected pool logits (else it is the pool's first)
        STEP: tl.constexpr,  # compute slot s + 1's state and projection (not after the last slot)
        BLOCK_K: tl.constexpr,
        RANK_CHUNK: tl.constexpr,
        STATE_CHUNK: tl.constexpr,
        ROWS_PER_PROGRAM: tl.constexpr,
    ):
        row, tile = tl.program_id(0), tl.program_id(1)
        writer = tile == 0  # one program writes the slot's outputs (all of them compute the same values)
        width = 3 * state_size + rank
        slot_row = (row * num_slots + slot).to(tl.int64)  # offsets into [M, S, K, 3G] outgrow int32 at large M
        candidates = tl.arange(0, BLOCK_K)
        in_pool = candidates < pool_size

        if PICK:  # logits = base + up_pool @ silu(hidden_part + state_part), over the pool only
            pool_base_row = pool_base_ptr + slot_row * pool_size  # row pointers in int64, offsets within rows in int32
            pool_up_row = pool_up_ptr + slot_row * pool_size * rank
            logits = tl.load(pool_base_row + candidates, mask=in_pool, other=float("-inf")).to(tl.float32)
            for start in range(0, rank, RANK_CHUNK):
                ranks = start + tl.arange(0, RANK_CHUNK)
                in_rank = ranks < rank
                hidden = tl.load(hidden_part_ptr + slot_row * rank + ranks, mask=in_rank, other=0.0).to(tl.float32)
                state_part = tl.load(projected_ptr + row * width + 3 * state_size + ranks, mask=in_rank, other=0.0)
                activation = hidden + state_part.to(tl.float32)
                activation = activation * tl.sigmoid(activation)
                up_offsets = candidates[:, None] * rank + ranks[None, :]
                up = tl.load(pool_up_row + up_offsets, mask=in_pool[:, None] & in_rank[None, :], other=0.0)
                logits += tl.sum(up.to(tl.float32) * activation[None, :], axis=1)
            choice = tl.argmax(logits, axis=0)
            written = candidates < tl.where(writer, pool_size, 0)
            tl.store(pool_logits_ptr + slot_row * pool_size + candidates, logits, mask=written)
            token = tl.load(pool_ids_ptr + slot_row * pool_size + choice)
            tl.store(tokens_ptr + slot_row, token, mask=writer)
        else:
            choice = 0

        if STEP:  # GRU step on the picked token, chunk by chunk, each chunk folded into this program's rows
            rows = tile * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
            in_rows = rows < width
            accumulator = tl.zeros([ROWS_PER_PROGRAM], tl.float32)
            state_writes = tl.where(writer, state_size, 0)
            gates_row = pool_gates_ptr + (slot_row * pool_size + choice) * (3 * state_size)
            for start in range(0, state_size, STATE_CHUNK):
                units = start + tl.arange(0, STATE_CHUNK)
                in_state = units < state_size
                input_r = tl.load(gates_row + units, mask=in_state, other=0.0).to(tl.float32)
                input_z = tl.load(gates_row + state_size + units, mask=in_state, other=0.0).to(tl.float32)
                input_n = tl.load(gates_row + 2 * state_size + units, mask=in_state, other=0.0).to(tl.float32)
                state_r = tl.load(projected_ptr + row * width + units, mask=in_state, other=0.0).to(tl.float32)
                state_z = tl.load(projected_ptr + row * width + state_size + units, mask=in_state, other=0.0)
                state_n = tl.load(projected_ptr + row * width + 2 * state_size + units, mask=in_state, other=0.0)
                state = tl.load(state_ptr + row * state_size + units, mask=in_state, other=0.0).to(tl.float32)
                reset = tl.sigmoid(input_r + state_r)
                update = tl.sigmoid(input_z + state_z.to(tl.float32))
                candidate = 2.0 * tl.sigmoid(2.0 * (input_n + reset * state_n.to(tl.float32))) - 1.0  # tanh
                next_state = (candidate + update * (state - candidate)).to(next_state_ptr.dtype.element_ty)
                tl.store(next_state_ptr + row * state_size + units, next_state, mask=units < state_writes)
                weight_offsets = rows[:, None] * state_size + units[None, :]
                in_weight = in_rows[:, None] & in_state[None, :]
                weight = tl.load(state_weight_ptr + weight_offsets, mask=in_weight, other=0.0)
                accumulator += tl.sum(weight.to(tl.float32) * next_state.to(tl.float32)[None, :], axis=1)
            tl.store(next_projected_ptr + row * width + rows, accumulator, mask=in_rows)

    # Every launch config computes the same values, and a launch writes only its outputs, none of which it reads:
    # the tuner's repeated launches need no restoring.
    _tuned_head_step_kernel = triton.autotune(
        configs=[triton.Config(_constexprs(config), num_warps=config.num_warps) for config in LAUNCH_CONFIGS],
        key=["state_size", "rank", "pool_size", "PICK", "STEP"],
    )(_head_step_kernel)


def tuned_launch_configs() -> dict[str, LaunchConfig]:
    """What the autotuner picked so far outside torch.compile (which tunes its own copy), per tuning key: gate size,
    rank, pool size, PICK, STEP and the arguments' dtypes. Empty before the first launch on CUDA."""
    if triton is None:
        return {}
    picks = {}
    for key, config in _tuned_head_step_kernel.cache.items():
        constexprs = config.kwargs
        picks[", ".join(map(str, key))] = LaunchConfig(
            constexprs["ROWS_PER_PROGRAM"], constexprs["STATE_CHUNK"], constexprs["RANK_CHUNK"], config.num_warps
        )
    return picks


def head_step(
    projected: torch.Tensor,
    state: torch.Tensor,
    slot: int,
    pick: bool,
    step: bool,
    tokens: torch.Tensor,
    pool_logits: torch.Tensor,
    hidden_part: torch.Tensor,
    pool_base: torch.Tensor,
    pool_up: torch.Tensor,
    pool_ids: torch.Tensor,
    pool_gates: torch.Tensor,
    state_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Finish slot `slot` (its pick when `pick`) and return slot + 1's `(projected, state)` (computed when `step`).

    Shapes as in `_head_step_kernel`; every tensor contiguous. Writes `tokens[:, slot]` and `pool_logits[:, slot]`
    when `pick`; otherwise the slot's token is the caller's `pool_ids[:, slot, 0]`.
    """
    num_rows, state_size = state.shape
    num_slots, pool_size, rank = pool_up.shape[1:]
    width = projected.shape[1]
    # Fresh even when not `step` (left unwritten then): no tensor is passed twice, which torch.compile would have to
    # untangle for a kernel that writes its arguments.
    next_projected, next_state = torch.empty_like(projected), torch.empty_like(state)

    def grid(constexprs: dict) -> tuple[int, int]:
        return num_rows, triton.cdiv(width, constexprs["ROWS_PER_PROGRAM"]) if step else 1

    if _interpreted():  # no timing to tune on: the first config
        kernel, launch = _head_step_kernel, dict(_constexprs(LAUNCH_CONFIGS[0]), num_warps=LAUNCH_CONFIGS[0].num_warps)
    else:
        kernel, launch = _tuned_head_step_kernel, {}
    kernel[grid](
        projected,
        state,
        next_projected,
        next_state,
        tokens,
        pool_logits,
        hidden_part,
        pool_base,
        pool_up,
        pool_ids,
        pool_gates,
        state_weight,
        slot,
        num_slots,
        state_size,
        rank,
        pool_size,
        PICK=pick,
        STEP=step,
        BLOCK_K=triton.next_power_of_2(pool_size),
        **launch,
    )
    return next_projected, next_state


def fused_pooled_slot_loop(
    base_logits: torch.Tensor, block: BlockInputs, weights: HeadWeights, first_corrected: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`slot_loop` for greedy drafting with a candidate pool, one Triton launch per slot (`head_step`).

    Each pool token's GRU input gates are looked up once per block instead of once per slot, so a slot is the launch
    alone. Slots before `first_corrected` draft their base argmax: it goes first in their pool.
    """
    num_slots = base_logits.shape[1]
    pool_ids = block.pool_ids.clone()
    pool_ids[:, :first_corrected, 0] = base_logits[:, :first_corrected].argmax(dim=-1)
    pool_gates = input_gates(weights, pool_ids).contiguous()  # [M, S, P, 3G]
    indices = pool_ids[:, :, 0].contiguous()  # [M, S]: the kernel writes the corrected slots'
    pool_logits = torch.empty_like(block.pool_base)  # [M, S, P]
    state = block.state.contiguous()
    projected = F.linear(state, weights.state_weight)  # [M, 3G + R]: slot 0's, the only matmul outside the kernel
    for slot in range(num_slots):
        projected, state = head_step(
            projected,
            state,
            slot,
            slot >= first_corrected,
            slot + 1 < num_slots,
            indices,
            pool_logits,
            block.hidden_part,
            block.pool_base,
            block.pool_up,
            pool_ids,
            pool_gates,
            weights.state_weight,
        )
    logits, confidence = _pooled_outputs(base_logits, pool_logits[:, first_corrected:], pool_ids, first_corrected)
    return token_ids(indices, weights.vocab), logits, confidence


def fused_greedy_head(
    base_logits: torch.Tensor,
    draft_hidden: torch.Tensor,
    anchor_embeds: torch.Tensor,
    weights: HeadWeights,
    first_corrected: int,
    pool_size: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`head_domino.greedy_head` with the fused step: `fused_pooled_slot_loop` (the plain `slot_loop` without a
    candidate pool, which the kernel needs)."""
    block = block_inputs(base_logits, draft_hidden, anchor_embeds, weights, pool_size)
    if not pool_size:
        return slot_loop(base_logits, block, weights, first_corrected)
    return fused_pooled_slot_loop(base_logits, block, weights, first_corrected)


def fuse_head_step(draft, fused: bool = True):
    """Make `draft`'s greedy drafting with a candidate pool (`DraftingOptions(candidate_pool=...)`) run one Triton
    kernel per slot (`fused=False` goes back to the unfused loop). Returns the draft.

    `compile_drafting` compiles it too, set before or after. Nothing is saved: the greedy head is a plain attribute of
    the draft (`_greedy_head`, read by `DominoDraftModel.draft_from_block`).
    `RuntimeError` if the kernel cannot run on the draft's device.
    """
    if not fused:
        draft.__dict__.pop("_greedy_head", None)
        return draft
    if not kernel_runs_on(draft.device):
        raise RuntimeError(
            f"the fused head step runs a Triton kernel on CUDA, but the draft is on {draft.device} and Triton is "
            f"{'installed' if triton_available() else 'not installed'}: draft without fuse_head_step there."
        )
    draft.__dict__["_greedy_head"] = fused_greedy_head
    return draft


__all__ = [
    "LAUNCH_CONFIGS",
    "LaunchConfig",
    "fuse_head_step",
    "fused_greedy_head",
    "fused_pooled_slot_loop",
    "head_step",
    "kernel_runs_on",
    "triton_available",
    "tuned_launch_configs",
]
