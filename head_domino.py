"""The Domino head: a GRU over the block's tokens and a low-rank residual on the backbone's logits (paper eq. 2-3).

Slot s of a block predicts the token at anchor + s + 1. The head adds `dL_s = W_up silu(W_down [H_s; S_s])` to
the slot's base logits, where H_s is the backbone's hidden state and S_s the GRU state after reading the anchor and
the tokens up to anchor + s. Slots before `first_corrected_slot` keep their base logits.

Two paths share one GRU recurrence (`gru_cell`):
- `DominoHead.forward`, teacher forcing: whole blocks whose tokens are given (training);
- `DominoHead.draft`, the slot loop of a drafting round, the GRU reading each drafted token. What does not depend
  on the drafted tokens is computed once per block (`block_inputs`) or once per weight version (`DerivedTensors`),
  so a slot costs one small matmul, a rank-R product and a pick. Greedy drafting (`greedy_head`) is a pure tensor
  function that `torch.compile` captures whole (`domino_spec.generation.compiled_drafting`); on CUDA a Triton kernel
  can run each pooled slot (`domino_spec.generation.fused_head_step`).

Logits live in the draft vocabulary: the token ids a draft may propose (`vocab`, index -> token id; the whole
vocabulary when None), whose rows of the LM head and of `W_up` the draft keeps.

Copied into every saved checkpoint with `modeling_domino.py` (`trust_remote_code`): imports only torch.
"""

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_domino import DominoConfig
from .drafting import DraftingOptions, DraftSampling

DEFAULT_OPTIONS = DraftingOptions()

# Shapes: M rows (sequences, or blocks in training), S slots (drafts per block), V draft vocabulary, D hidden,
# G GRU state, R rank of the logit residual, P candidate pool.

# `choose(slot, logits)` picks a slot's token from its whole-vocabulary logits: `(token ids [M], the logits it drew
# from [M, V_target])`, e.g. after logits processors, or by sampling.
Chooser = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def select_token(logits: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """Argmax, or a sample from softmax(logits); `logits` is `[..., V]`, already processed."""
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = logits.float().softmax(dim=-1)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), num_samples=1, generator=generator)
    return flat.view(probs.shape[:-1])


def slot_chooser(
    prefix_ids: torch.LongTensor | None, logits_processor: Callable | None, do_sample: bool, generator=None
) -> Chooser:
    """The `choose` of processed or sampled drafting; the processor sees `prefix_ids` and the drafts so far."""
    drafted = prefix_ids

    def choose(slot: int, slot_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal drafted
        if logits_processor is not None:
            processed = logits_processor(drafted, slot_logits)
            # A processor may rule out every token the draft has (its draft vocabulary): it then proposes its own
            # best one with all of q, which exact speculative sampling rejects wherever the target rules it out.
            none_left = torch.isneginf(processed).all(-1, keepdim=True)
            best = F.one_hot(slot_logits.argmax(-1), slot_logits.shape[-1]).bool()
            slot_logits = torch.where(none_left, torch.where(best, 0.0, float("-inf")), processed)
        token = select_token(slot_logits, do_sample, generator)
        if drafted is not None:
            drafted = torch.cat([drafted, token[:, None]], dim=-1)
        return token, slot_logits

    return choose


def gru_cell(input_gates: torch.Tensor, state_gates: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One step of a bias-free `nn.GRU` from its projected gates, the recurrence of every path.

    `input_gates` = x @ W_ih^T and `state_gates` = h @ W_hh^T (`[M, 3G]`, PyTorch's r|z|n order), `state` `[M, G]`.
    Taking projections lets drafting precompute the input side and fuse the state side with other matmuls.
    """
    state_size = state.shape[-1]
    reset, update = torch.sigmoid(input_gates[:, : 2 * state_size] + state_gates[:, : 2 * state_size]).chunk(2, -1)
    candidate = torch.tanh(input_gates[:, 2 * state_size :] + reset * state_gates[:, 2 * state_size :])
    return candidate + update * (state - candidate)


def pick_confidence(logits: torch.Tensor) -> torch.Tensor:
    """The probability `softmax(logits)` gives its most likely token, per row: `[..., V]` -> `[...]`. It depends on
    the distribution only, never on a sampled token, so choosing a draft length from it keeps sampling exact."""
    logits = logits.float()
    return (logits.amax(-1) - logits.logsumexp(-1)).exp()


class DerivedTensors:
    """Tensors built from weights for fast drafting (a lookup table, a fused weight, a linear of some rows), never
    saved. Each is rebuilt when a source tensor is replaced or changed in place by a tensor op; a write through `.data`
    (peft's `merge_adapter`) changes neither, so `clear()` after one. With gradients enabled (training) each is
    built fresh, so it stays differentiable. Copies and pickles start empty. `prepare`, where set, is called with
    each one built (`optimize_for_cpu` plans the linears' kernels).
    """

    prepare: Callable[[torch.Tensor | nn.Module], None] | None = None

    def __init__(self):
        self._cache: dict[str, tuple] = {}

    def get(self, name: str, sources: tuple[torch.Tensor, ...], build: Callable) -> torch.Tensor | nn.Module:
        if torch.is_grad_enabled():
            return build()
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in sources)
        cached_key, cached_sources, derived = self._cache.get(name, (None, (), None))
        # Weak references, since an address alone can be reused: a new target's embedding where a freed one was.
        same_sources = len(cached_sources) == len(sources) and all(r() is t for r, t in zip(cached_sources, sources))
        if cached_key != key or not same_sources:
            derived = build()
            if self.prepare is not None:
                self.prepare(derived)
            self._cache[name] = (key, tuple(weakref.ref(t) for t in sources), derived)
        return derived

    def clear(self) -> None:
        self._cache = {}

    def __contains__(self, name: str) -> bool:
        return name in self._cache

    def __getstate__(self) -> dict:
        return {"_cache": {}}


class HeadWeights(NamedTuple):
    """The head's weights in the layouts the slot loop reads (`DominoHead.weights`)."""

    weight_ih: torch.Tensor  # [3G, D]: GRU input projection (the anchor's gates; every token's without a table)
    embed_tokens: nn.Module  # the target's input embeddings: drafted tokens go through it, as the anchor does
    vocab: torch.Tensor | None  # [V]: draft-vocabulary index -> token id (None: they are equal)
    gate_table: torch.Tensor | None  # [V, 3G]: each draft token's GRU input gates in one row lookup, or None
    state_weight: torch.Tensor  # [3G + R, G]: W_hh and the state's half of W_down, fused into one matmul
    down: torch.Tensor  # [R, D + G]: W_down
    up: torch.Tensor  # [V, R]: W_up (rows gathered for a candidate pool)
    up_columns: torch.Tensor | None  # [R, V] in the logits' dtype, contiguous (fast GEMV); None with a pool


class BlockInputs(NamedTuple):
    """What the slot loop needs of a block and does not depend on the drafted tokens."""

    hidden_part: torch.Tensor  # [M, S, R]: the hidden-state half of W_down, all slots at once
    state: torch.Tensor  # [M, G]: the GRU state after reading the anchor
    pool_ids: torch.Tensor | None = None  # [M, S, P]: each slot's candidate pool (draft-vocabulary indices)
    pool_base: torch.Tensor | None = None  # [M, S, P]: their base logits
    pool_up: torch.Tensor | None = None  # [M, S, P, R]: their rows of W_up


def token_ids(indices: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Draft-vocabulary indices as token ids."""
    return indices if vocab is None else vocab[indices]


def to_target_vocabulary(logits: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """`[..., V]` draft-vocabulary logits spread over the target's `vocab_size` tokens, -inf outside the draft's."""
    if vocab is None:
        return logits
    spread = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return spread.index_copy_(-1, vocab, logits)


def input_gates(weights: HeadWeights, indices: torch.Tensor) -> torch.Tensor:
    """GRU input gates `[..., 3G]` of draft-vocabulary indices `[...]`: a table row, else the embedding times W_ih."""
    if weights.gate_table is not None:
        return weights.gate_table[indices]
    embeds = weights.embed_tokens(token_ids(indices, weights.vocab))
    return F.linear(embeds.to(weights.weight_ih.dtype), weights.weight_ih)


def block_inputs(
    base_logits: torch.Tensor,
    draft_hidden: torch.Tensor,
    anchor_embeds: torch.Tensor,
    weights: HeadWeights,
    pool_size: int = 0,
) -> BlockInputs:
    """`BlockInputs` of a block: `[M, S, V]` base logits, `[M, S, D]` hidden states, `[M, D]` anchor embeddings."""
    hidden_part = F.linear(draft_hidden, weights.down[:, : draft_hidden.shape[-1]])  # [M, S, R]
    zeros = draft_hidden.new_zeros(draft_hidden.shape[0], weights.state_weight.shape[1])  # [M, G]
    anchor_gates = F.linear(anchor_embeds.to(weights.weight_ih.dtype), weights.weight_ih)  # [M, 3G]
    state = gru_cell(anchor_gates, zeros.new_zeros(zeros.shape[0], weights.weight_ih.shape[0]), zeros)
    if not pool_size:
        return BlockInputs(hidden_part, state)
    pool_ids = base_logits.topk(min(pool_size, base_logits.shape[-1]), dim=-1).indices  # [M, S, P]
    pool_up = weights.up[pool_ids].to(base_logits.dtype)  # [M, S, P, R]
    return BlockInputs(hidden_part, state, pool_ids, base_logits.gather(-1, pool_ids), pool_up)


def slot_loop(
    base_logits: torch.Tensor,
    block: BlockInputs,
    weights: HeadWeights,
    first_corrected: int,
    choose: Chooser | None = None,
    vocab_size: int | None = None,
    sampling: DraftSampling | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequential part of a drafting round over the S slots of `[M, S, V]` base logits.

    Per slot: one matmul of the GRU state (its recurrent gates and its half of W_down, fused), the rank-R residual
    added to the base logits (over the slot's candidate pool only, when `block` has one), a pick, and the GRU step on
    the picked token. Greedy (`choose` and `sampling` None) picks the argmax with no Python callback, which makes the
    loop compilable (unrolled); `sampling` draws from the slot's logits over the draft vocabulary, as cheap as
    greedy; a `choose` sees each slot's logits over the target's `vocab_size` tokens.

    Returns token ids `[M, S]`, the logits each was picked from (`[M, S, vocab_size]` with a `choose`; else over the
    draft vocabulary, -inf outside a pool) and each pick's confidence `[M, S]` (`pick_confidence`).
    """
    num_slots, state_gates_width = base_logits.shape[1], weights.weight_ih.shape[0]  # 3G
    state, pooled = block.state, block.pool_ids is not None
    if pooled and (choose is not None or sampling is not None):
        raise ValueError(
            "A candidate pool is for greedy drafting: a chooser (logits processor, sampler) may mask all of it, and "
            "sampling draws from the whole draft vocabulary. Build the block with pool_size=0 for processed or "
            "sampled drafting."
        )
    tokens, logits = [], []
    for slot in range(num_slots):
        state_gates, state_part = F.linear(state, weights.state_weight).split(
            [state_gates_width, weights.state_weight.shape[0] - state_gates_width], dim=-1
        )
        slot_logits = base_logits[:, slot]
        if slot >= first_corrected:
            activation = F.silu(block.hidden_part[:, slot] + state_part).to(base_logits.dtype)  # [M, R]
            if pooled:
                slot_logits = block.pool_base[:, slot] + (block.pool_up[:, slot] @ activation[:, :, None]).squeeze(-1)
            else:
                slot_logits = torch.addmm(slot_logits, activation, weights.up_columns)
        if sampling is not None:
            index, slot_logits = sampling.draw(slot_logits, generator)
            gates = input_gates(weights, index) if slot + 1 < num_slots else None
            token = token_ids(index, weights.vocab)
        elif choose is None:
            index = slot_logits.argmax(dim=-1)  # within the pool for a corrected pooled slot
            if pooled and slot >= first_corrected:
                index = block.pool_ids[:, slot].gather(-1, index[:, None]).squeeze(-1)
            gates = input_gates(weights, index) if slot + 1 < num_slots else None
            token = token_ids(index, weights.vocab)
        else:
            token, slot_logits = choose(slot, to_target_vocabulary(slot_logits, weights.vocab, vocab_size))
            gates = F.linear(weights.embed_tokens(token).to(weights.weight_ih.dtype), weights.weight_ih)
        tokens.append(token)
        logits.append(slot_logits)
        if slot + 1 < num_slots:
            state = gru_cell(gates, state_gates, state)
    if pooled and first_corrected < num_slots:
        pool_logits = torch.stack(logits[first_corrected:], dim=1)  # [M, S - first_corrected, P]
        return torch.stack(tokens, 1), *_pooled_outputs(base_logits, pool_logits, block.pool_ids, first_corrected)
    logits = torch.stack(logits, 1)
    return torch.stack(tokens, 1), logits, pick_confidence(logits)


def _pooled_outputs(
    base_logits: torch.Tensor, pool_logits: torch.Tensor, pool_ids: torch.Tensor, first_corrected: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled greedy drafting's logits `[M, S, V]` (base logits before `first_corrected`, then each corrected slot's
    pool logits over its pool, -inf elsewhere) and confidences `[M, S]`."""
    spread = pool_logits.new_full((*pool_logits.shape[:2], base_logits.shape[-1]), float("-inf"))
    spread.scatter_(-1, pool_ids[:, first_corrected:], pool_logits)
    uncorrected = base_logits[:, :first_corrected]
    confidence = torch.cat([pick_confidence(uncorrected), pick_confidence(pool_logits)], dim=1)
    return torch.cat([uncorrected, spread], dim=1), confidence


def greedy_head(
    base_logits: torch.Tensor,
    draft_hidden: torch.Tensor,
    anchor_embeds: torch.Tensor,
    weights: HeadWeights,
    first_corrected: int,
    pool_size: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy drafting of a block as one pure tensor function (what `compile_drafting` captures): `slot_loop`."""
    return slot_loop(
        base_logits,
        block_inputs(base_logits, draft_hidden, anchor_embeds, weights, pool_size),
        weights,
        first_corrected,
    )


def base_drafts(
    base_logits: torch.Tensor,
    vocab: torch.Tensor | None,
    choose: Chooser | None = None,
    vocab_size: int | None = None,
    sampling: DraftSampling | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`slot_loop`'s result for a draft without a head: each slot picks from its base logits alone."""
    if sampling is not None:
        indices, logits = sampling.draw(base_logits.flatten(0, 1), generator)
        logits = logits.view_as(base_logits)
        return token_ids(indices.view(base_logits.shape[:2]), vocab), logits, pick_confidence(logits)
    if choose is None:
        return token_ids(base_logits.argmax(-1), vocab), base_logits, pick_confidence(base_logits)
    picks = [
        choose(slot, to_target_vocabulary(base_logits[:, slot], vocab, vocab_size))
        for slot in range(base_logits.shape[1])
    ]
    logits = torch.stack([slot_logits for _, slot_logits in picks], 1)
    return torch.stack([token for token, _ in picks], 1), logits, pick_confidence(logits)


class DominoHead(nn.Module):
    """The Domino head's weights (`prefix_gru`, `embed_proj`: the published names) and its two paths.

    `embed_proj` is `W_down` (`Linear(D + G -> R)`), SiLU and `W_up` (`Linear(R -> V)`, V the draft vocabulary).
    The GRU's weights live in an `nn.GRU` for their published names and initialisation; `gru_cell` runs them.
    """

    def __init__(self, config: DominoConfig):
        super().__init__()
        self.first_corrected_slot = config.first_corrected_slot
        self.prefix_gru = nn.GRU(config.hidden_size, config.gru_hidden_dim, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(
            nn.Linear(config.hidden_size + config.gru_hidden_dim, config.residual_rank, bias=False),
            nn.SiLU(),
            nn.Linear(config.residual_rank, config.draft_vocab_size or config.vocab_size, bias=False),
        )
        self.derived = DerivedTensors()

    def forward(
        self, base_logits: torch.Tensor, draft_hidden: torch.Tensor, prefix_embeds: torch.Tensor
    ) -> torch.Tensor:
        """Final logits of whole teacher-forced blocks: `[M, S, V]` base logits, `[M, S, D]` hidden states, and the
        embeddings `[M, S, D]` of the tokens at anchor + s, the GRU's input before slot s predicts anchor + s + 1."""
        start = self.first_corrected_slot
        weight_ih, weight_hh = self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0
        gates = F.linear(prefix_embeds.to(weight_ih.dtype), weight_ih)  # [M, S, 3G]
        state = gates.new_zeros(gates.shape[0], weight_hh.shape[1])
        states = []
        for slot in range(gates.shape[1]):
            state = gru_cell(gates[:, slot], F.linear(state, weight_hh), state)
            states.append(state)
        states = torch.stack(states, dim=1)  # [M, S, G]
        residual = self.embed_proj(torch.cat([draft_hidden[:, start:].to(states.dtype), states[:, start:]], dim=-1))
        return torch.cat([base_logits[:, :start], base_logits[:, start:] + residual.to(base_logits.dtype)], dim=1)

    def weights(
        self,
        embed_tokens: nn.Module,
        vocab: torch.Tensor | None,
        logits_dtype: torch.dtype,
        options: DraftingOptions = DEFAULT_OPTIONS,
        whole_vocabulary: bool = False,
    ) -> HeadWeights:
        """The weights in the slot loop's layouts, derived once per weight version; `whole_vocabulary` prepares for
        a loop without a candidate pool whatever `options` say."""
        weight_ih, weight_hh = self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0
        down, up = self.embed_proj[0].weight, self.embed_proj[2].weight  # [R, D + G], [V, R]
        hidden_size = down.shape[1] - weight_hh.shape[1]
        state_weight = self.derived.get(
            "state_weight", (weight_hh, down), lambda: torch.cat([weight_hh, down[:, hidden_size:]])
        )
        up_columns = None
        if whole_vocabulary or not options.candidate_pool:  # in the logits' dtype, so no slot converts [R, V] again
            up_columns = self.derived.get(
                f"up_columns_{logits_dtype}", (up,), lambda: up.t().to(logits_dtype).contiguous()
            )
        gate_table = self._gate_table(embed_tokens, vocab, options.gate_table_max_bytes)
        return HeadWeights(weight_ih, embed_tokens, vocab, gate_table, state_weight, down, up, up_columns)

    def _gate_table(self, embed_tokens: nn.Module, vocab: torch.Tensor | None, max_bytes: int) -> torch.Tensor | None:
        """`E[vocab] @ W_ih^T` (`[V, 3G]`) when at most `max_bytes`: a drafted token's gates in one row lookup.

        Only for a plain `nn.Embedding`: a module that transforms its rows (Gemma3's scaled embedding, a PEFT adapter)
        embeds each drafted token itself, as it embeds the anchor and, in training, the ground truth.
        """
        if torch.is_grad_enabled() or type(embed_tokens) is not nn.Embedding:
            return None
        weight_ih, embedding = self.prefix_gru.weight_ih_l0, embed_tokens.weight
        rows = embedding.shape[0] if vocab is None else vocab.shape[0]
        if rows * weight_ih.shape[0] * weight_ih.element_size() > max_bytes:
            return None
        sources = (embedding, weight_ih) if vocab is None else (embedding, weight_ih, vocab)
        rows_of = (lambda: embedding) if vocab is None else (lambda: embedding[vocab])
        return self.derived.get("gate_table", sources, lambda: F.linear(rows_of().to(weight_ih.dtype), weight_ih))

    def draft(
        self,
        base_logits: torch.Tensor,
        draft_hidden: torch.Tensor,
        anchor_embeds: torch.Tensor,
        embed_tokens: nn.Module,
        vocab: torch.Tensor | None,
        options: DraftingOptions = DEFAULT_OPTIONS,
        choose: Chooser | None = None,
        vocab_size: int | None = None,
        whole_vocabulary: bool = False,
        greedy: Callable[..., tuple] = greedy_head,
        sampling: DraftSampling | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft a block: token ids `[M, S]`, the logits each was picked from and its confidence (`slot_loop`).

        Greedy drafting (no `choose`, no `sampling`) follows `options` (a candidate pool) and runs `greedy`
        (`greedy_head`, or the draft's compiled or fused one); `sampling`, a `choose` (processed drafting), and greedy
        drafting over the `whole_vocabulary` (the training-time test) score every draft token, since a logits
        processor may mask every token of a pool and sampling may draw any.
        """
        if choose is not None or sampling is not None or whole_vocabulary:
            weights = self.weights(embed_tokens, vocab, base_logits.dtype, options, whole_vocabulary=True)
            block = block_inputs(base_logits, draft_hidden, anchor_embeds, weights)
            return slot_loop(
                base_logits, block, weights, self.first_corrected_slot, choose, vocab_size, sampling, generator
            )
        weights = self.weights(embed_tokens, vocab, base_logits.dtype, options)
        return greedy(
            base_logits, draft_hidden, anchor_embeds, weights, self.first_corrected_slot, options.candidate_pool
        )


__all__ = [
    "BlockInputs",
    "DerivedTensors",
    "DominoHead",
    "HeadWeights",
    "base_drafts",
    "block_inputs",
    "greedy_head",
    "gru_cell",
    "input_gates",
    "pick_confidence",
    "select_token",
    "slot_chooser",
    "slot_loop",
    "to_target_vocabulary",
    "token_ids",
]
