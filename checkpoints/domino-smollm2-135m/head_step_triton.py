"""One Triton kernel per slot of the greedy pooled head loop: the GPU form of `head_domino.head_slot_loop`.

Unfused, a slot costs about ten small dependent kernels (the GRU state matmul, the pool residual, argmax, the
drafted token's gate lookup, the GRU cell), tens of microseconds on a GPU even inside a CUDA graph. Slot s needs
the GRU state's projection `projected_s = state_s @ [W_hh; W_down_state]^T` (`[M, 3G + R]`), which is too big a
matmul for one thread block, and everything after it (pick, GRU step) is tiny. So each launch finishes slot s and
starts slot s + 1: every program recomputes slot s's pick (K x R multiply-adds) and the next GRU state (G values,
chunk by chunk), then writes its own rows of `projected_{s+1}`. Redundant work instead of a grid-wide barrier: one
launch per slot, and the [3G + R, G] weight is read once per slot across the whole GPU.

Copied into saved checkpoints with `head_domino.py`. Triton ships with CUDA builds of PyTorch; without it this module
still imports and `triton_available()` is False. `TRITON_INTERPRET=1` runs the kernel on CPU tensors (tests).
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds ship without Triton
    triton = None

# Programs split the projection's 3G + R rows in tiles of this many; each reads its tile of the weight once per slot.
ROWS_PER_PROGRAM = 16
STATE_CHUNK = 256  # GRU state values per inner step (weight tile [ROWS_PER_PROGRAM, STATE_CHUNK])
RANK_CHUNK = 64  # residual rank per inner step of the pick (pool tile [K, RANK_CHUNK])


def triton_available() -> bool:
    return triton is not None


def kernel_runs_on(device: torch.device) -> bool:
    """Whether the kernel can run on tensors of `device`: CUDA with Triton, or any device in interpreter mode."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


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
        gate_size,
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
        width = 3 * gate_size + rank
        slot_row = (row * num_slots + slot).to(tl.int64)  # offsets into [M, S, K, 3G] outgrow int32 at large M
        candidates = tl.arange(0, BLOCK_K)
        in_pool = candidates < pool_size

        if PICK:  # logits = base + up_pool @ silu(hidden_part + state_part), over the pool only
            logits = tl.load(pool_base_ptr + slot_row * pool_size + candidates, mask=in_pool, other=float("-inf"))
            logits = logits.to(tl.float32)
            for start in range(0, rank, RANK_CHUNK):
                ranks = start + tl.arange(0, RANK_CHUNK)
                in_rank = ranks < rank
                hidden = tl.load(hidden_part_ptr + slot_row * rank + ranks, mask=in_rank, other=0.0).to(tl.float32)
                state_part = tl.load(projected_ptr + row * width + 3 * gate_size + ranks, mask=in_rank, other=0.0)
                activation = hidden + state_part.to(tl.float32)
                activation = activation * tl.sigmoid(activation)
                up_offsets = (slot_row * pool_size + candidates[:, None]) * rank + ranks[None, :]
                up = tl.load(pool_up_ptr + up_offsets, mask=in_pool[:, None] & in_rank[None, :], other=0.0)
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
            state_writes = tl.where(writer, gate_size, 0)
            gates_row = pool_gates_ptr + (slot_row * pool_size + choice) * (3 * gate_size)
            for start in range(0, gate_size, STATE_CHUNK):
                units = start + tl.arange(0, STATE_CHUNK)
                in_state = units < gate_size
                input_r = tl.load(gates_row + units, mask=in_state, other=0.0).to(tl.float32)
                input_z = tl.load(gates_row + gate_size + units, mask=in_state, other=0.0).to(tl.float32)
                input_n = tl.load(gates_row + 2 * gate_size + units, mask=in_state, other=0.0).to(tl.float32)
                state_r = tl.load(projected_ptr + row * width + units, mask=in_state, other=0.0).to(tl.float32)
                state_z = tl.load(projected_ptr + row * width + gate_size + units, mask=in_state, other=0.0)
                state_n = tl.load(projected_ptr + row * width + 2 * gate_size + units, mask=in_state, other=0.0)
                state = tl.load(state_ptr + row * gate_size + units, mask=in_state, other=0.0).to(tl.float32)
                reset = tl.sigmoid(input_r + state_r)
                update = tl.sigmoid(input_z + state_z.to(tl.float32))
                candidate = 2.0 * tl.sigmoid(2.0 * (input_n + reset * state_n.to(tl.float32))) - 1.0  # tanh
                next_state = (candidate + update * (state - candidate)).to(next_state_ptr.dtype.element_ty)
                tl.store(next_state_ptr + row * gate_size + units, next_state, mask=units < state_writes)
                weight_offsets = rows[:, None] * gate_size + units[None, :]
                weight = tl.load(state_weight_ptr + weight_offsets, mask=in_rows[:, None] & in_state[None, :], other=0.0)
                accumulator += tl.sum(weight.to(tl.float32) * next_state.to(tl.float32)[None, :], axis=1)
            tl.store(next_projected_ptr + row * width + rows, accumulator, mask=in_rows)


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
    num_rows, gate_size = state.shape
    num_slots, pool_size, rank = pool_up.shape[1:]
    width = projected.shape[1]
    # Fresh even when not `step` (left unwritten then): no tensor is passed twice, which torch.compile would have to
    # untangle for a kernel that writes its arguments.
    next_projected, next_state = torch.empty_like(projected), torch.empty_like(state)
    tiles = triton.cdiv(width, ROWS_PER_PROGRAM) if step else 1
    _head_step_kernel[(num_rows, tiles)](
        projected, state, next_projected, next_state, tokens, pool_logits,
        hidden_part, pool_base, pool_up, pool_ids, pool_gates, state_weight,
        slot, num_slots, gate_size, rank, pool_size,
        PICK=pick, STEP=step, BLOCK_K=triton.next_power_of_2(pool_size),
        RANK_CHUNK=RANK_CHUNK, STATE_CHUNK=STATE_CHUNK, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
    )  # fmt: skip
    return next_projected, next_state


__all__ = ["head_step", "kernel_runs_on", "triton_available"]
