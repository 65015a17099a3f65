"""Domino draft model: a DFlash parallel block drafter plus a cheap causal correction head.

One forward over `[anchor, MASK x (block_size - 1)]`, conditioned on the target's hidden states, gives base
logits for the whole block (paper eq. 1); the head (`head_domino.py`: a GRU over the block's tokens and a low-rank
map) adds a causal residual to them (eq. 2-3), so the sequential part never re-runs the LM head.

This file and the root files it imports are copied into every saved checkpoint (`trust_remote_code`), so they
import only torch and transformers. The package (`domino_spec`) adds what a checkpoint does not need: conversion from
and to the published format (`published_format.load_draft`), compiled drafting and the fused head step
(`generation/`), building a draft for a target (`draft_building.py`).
"""

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half
from transformers.utils import ModelOutput

from .cache_domino import DominoContextCache
from .configuration_domino import PUBLISHED_FORMAT_ERROR, DominoConfig, check_input_ids
from .drafting import DraftingOptions, DraftSampling
from .generation_domino import DominoCandidateGenerator, candidate_generator
from .head_domino import (
    Chooser,
    DerivedTensors,
    DominoHead,
    base_drafts,
    greedy_head,
    slot_chooser,
    to_target_vocabulary,
)

# Shapes: B batch, N blocks per sequence, K block size, S drafts per block, T context length, D hidden,
# V vocabulary (the draft's, a subset of the target's), Hq/Hkv attention heads, Dh head dim.


@dataclass
class DominoOutput(ModelOutput):
    """Teacher-forced training output.

    Args:
        logits (`torch.FloatTensor` of shape `(batch_size, num_blocks, num_draft_tokens, draft_vocab_size)`):
            Final logits over the draft vocabulary: base logits plus the head's residual (without a head, the base).
        base_logits (`torch.FloatTensor` of the same shape): the parallel backbone's logits.
    """

    logits: torch.FloatTensor | None = None
    base_logits: torch.FloatTensor | None = None


@dataclass
class DominoDraft(ModelOutput):
    """One drafted block.

    Args:
        tokens (`torch.LongTensor` of shape `(batch_size, num_draft_tokens)`): the proposed continuation.
        logits (`torch.FloatTensor` of shape `(batch_size, num_draft_tokens, vocab_size)`): over the target's
            vocabulary, the (processed) logits each token was drawn from, as exact speculative sampling needs them;
            -inf outside the draft vocabulary (and, greedy, outside a candidate pool).
        confidence (`torch.FloatTensor` of shape `(batch_size, num_draft_tokens)`): the probability each slot's
            distribution gives its most likely token, which the cost-aware draft length weighs.
    """

    tokens: torch.LongTensor | None = None
    logits: torch.FloatTensor | None = None
    confidence: torch.FloatTensor | None = None


class DominoBlock(NamedTuple):
    """A block after the backbone: what the head drafts from."""

    base_logits: torch.Tensor  # [B, S, V]: the target's LM head over the draft vocabulary
    hidden: torch.Tensor  # [B, S, D]: the drafting slots' hidden states
    anchor_embeds: torch.Tensor  # [B, D]: the anchor's embedding, the GRU's first input


def block_attention_mask(
    anchor_positions: torch.Tensor, context_length: int, block_size: int, context_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Training mask: each block sees the context strictly before its anchor and its own block, both ways.

    `anchor_positions` is `[B, N]`; returns a boolean `[B, 1, N*K, T + N*K]` mask (True = attend). The anchor's own
    target feature is excluded because at inference it is unknown until the anchor is verified.
    """
    batch_size, num_blocks = anchor_positions.shape
    device = anchor_positions.device
    context_index = torch.arange(context_length, device=device)
    sees_context = context_index[None, None, :] < anchor_positions[:, :, None]  # [B, N, T]
    if context_mask is not None:
        sees_context = sees_context & context_mask[:, None, :].bool()
    sees_context = sees_context[:, :, None, :].expand(-1, -1, block_size, -1)  # [B, N, K, T]
    block_index = torch.arange(num_blocks, device=device)
    same_block = block_index[:, None, None] == block_index[None, None, :]  # [N, 1, N]
    sees_block = same_block[:, :, :, None].expand(-1, block_size, -1, block_size)  # [N, K, N, K]
    sees_block = sees_block.reshape(1, num_blocks, block_size, num_blocks * block_size).expand(batch_size, -1, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1)  # [B, N, K, T + N*K]
    return mask.reshape(batch_size, 1, num_blocks * block_size, context_length + num_blocks * block_size)


def apply_rope(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `[B, H, L, Dh]` states at the positions `cos`/`sin` (`[B, L, Dh]`) were built for."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return states * cos + rotate_half(states) * sin


def flex_block_attention_mask(
    anchor_positions: torch.Tensor, context_length: int, block_size: int, context_mask: torch.Tensor | None = None
) -> BlockMask:
    """The same training mask as `block_attention_mask`, as a sparse flex_attention `BlockMask`."""
    batch_size, num_blocks = anchor_positions.shape
    if context_mask is None:
        context_mask = anchor_positions.new_ones(batch_size, context_length)
    context_mask = context_mask.bool()

    def allowed(batch, head, query, key):
        block = query // block_size
        anchor = anchor_positions[batch, block]
        in_context = key < context_length
        sees_context = in_context & (key < anchor) & context_mask[batch, key.clamp(max=context_length - 1)]
        sees_block = ~in_context & ((key - context_length) // block_size == block)
        return sees_context | sees_block

    num_queries = num_blocks * block_size
    return create_block_mask(
        allowed, batch_size, None, num_queries, context_length + num_queries, device=anchor_positions.device
    )


_compiled_flex_attention = None


def _flex_attention(query, keys, values, block_mask, enable_gqa):
    """flex_attention, compiled once on CUDA (where it pays); eager elsewhere."""
    global _compiled_flex_attention
    if not query.is_cuda:
        return flex_attention(query, keys, values, block_mask=block_mask, enable_gqa=enable_gqa)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention(query, keys, values, block_mask=block_mask, enable_gqa=enable_gqa)


class DominoAttention(nn.Module):
    """Adapted from Qwen3Attention: queries come from the block; keys and values also read the target context."""

    def __init__(self, config: DominoConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        key_value_width = self.num_key_value_heads * self.head_dim
        self.k_proj = nn.Linear(config.hidden_size, key_value_width, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, key_value_width, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _keys_values(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        batch_size, length, _ = hidden_states.shape
        shape = (batch_size, length, self.num_key_value_heads, self.head_dim)
        keys = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)  # [B, Hkv, L, Dh]
        values = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return apply_rope(keys, cos, sin), values

    def project_context(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys and values `[B, Hkv, T, Dh]` of the fused target context `[B, T, D]`."""
        return self._keys_values(context, cos, sin)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_keys: torch.Tensor,
        context_values: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch_size, length, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch_size, length, self.num_heads, self.head_dim)
        query = apply_rope(self.q_norm(query).transpose(1, 2), cos, sin)  # [B, Hq, Q, Dh]
        block_keys, block_values = self._keys_values(hidden_states, cos, sin)
        keys = torch.cat([context_keys, block_keys], dim=-2)  # [B, Hkv, T + Q, Dh]
        values = torch.cat([context_values, block_values], dim=-2)
        enable_gqa = self.num_heads != self.num_key_value_heads
        if isinstance(attention_mask, BlockMask):
            if self.training and self.attention_dropout:
                raise ValueError(
                    f"flex_attention has no attention dropout, but config.attention_dropout is {self.attention_dropout}"
                    ": set it to 0.0, or train with attn_implementation='sdpa'."
                )
            output = _flex_attention(query, keys, values, attention_mask, enable_gqa)
            return self.o_proj(output.transpose(1, 2).reshape(batch_size, length, -1))
        output = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=attention_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            enable_gqa=enable_gqa,
        )
        return self.o_proj(output.transpose(1, 2).reshape(batch_size, length, -1))


class DominoDecoderLayer(GradientCheckpointingLayer):
    """A Qwen3 decoder layer whose attention also reads the target context (KV injection)."""

    def __init__(self, config: DominoConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DominoAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, cos, sin, context_keys, context_values, attention_mask=None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, cos, sin, context_keys, context_values, attention_mask)
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


def _index_of(token_ids: torch.Tensor, vocab_size: int, missing: int) -> torch.Tensor:
    """`[vocab_size]`: each token's position in `token_ids`, `missing` for the tokens not in it."""
    index_of = torch.full((vocab_size,), missing, dtype=torch.long, device=token_ids.device)
    return index_of.index_copy_(0, token_ids, torch.arange(token_ids.numel(), device=token_ids.device))


def rows_of(linear: nn.Linear, rows: torch.Tensor | slice) -> nn.Linear:
    """An `nn.Linear` of its own for `linear`'s outputs `rows`: their weights and biases, frozen (views for a slice)."""
    weight = linear.weight.detach()[rows]
    part = nn.Linear(linear.in_features, weight.shape[0], bias=linear.bias is not None, device="meta")
    part.weight = nn.Parameter(weight, requires_grad=False)
    part.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows], requires_grad=False)
    return part


def _model_name(name_or_path: str) -> str:
    """A model's name without its folder or Hub organisation: a local copy and the Hub id compare equal."""
    return os.path.basename(name_or_path.rstrip("/")).lower()


def _converted_from(target: PreTrainedModel) -> str | None:
    """The Hub id a local conversion of `target` records in its config (`assets.target_dir` writes it), if any.

    A folder converted from a GGUF file is named after the asset (`.../targets/smollm2-135m`), not the Hub model, so
    its path alone does not tell that it is the model a draft was built for.
    """
    return getattr(target.config, "converted_from", None) or None


class DominoDraftModel(PreTrainedModel):
    """Domino draft: DFlash backbone (`fc`, `hidden_norm`, `layers`, `norm`) and, when `config.use_domino_head`,
    the causal correction head (`head`); with `config.draft_vocab_size`, the token ids it may propose
    (`draft_vocab`, the most frequent first).

    The target's token embeddings and LM head are arguments of every call; they are never parameters of the
    draft and never saved with it. `drafting_options` (not saved) are the run-time options of drafting.
    """

    config_class = DominoConfig
    base_model_prefix = "domino"
    main_input_name = "input_ids"
    _no_split_modules = ["DominoDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True  # used by the training forward's block mask
    supports_gradient_checkpointing = True  # `--gradient_checkpointing`: the decoder layers recompute in backward
    # The loss is computed by DominoTrainer from logits; Trainer must scale it for gradient accumulation.
    accepts_loss_kwargs = False

    def __init__(self, config: DominoConfig):
        if getattr(config, "dflash_config", None) is not None:  # AutoModel passes a published folder's Qwen3Config
            raise ValueError(PUBLISHED_FORMAT_ERROR)
        super().__init__(config)
        hidden_size = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden_size, hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DominoDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.head = DominoHead(config) if config.use_domino_head else None
        # The draft vocabulary's token ids, most frequent first; None: the target's whole vocabulary.
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)
        self.drafting_options = DraftingOptions()
        self.derived = DerivedTensors()
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, nn.GRU):
            bound = module.hidden_size**-0.5
            for weight in (module.weight_ih_l0, module.weight_hh_l0):
                init.uniform_(weight, -bound, bound)

    # ------------------------------------------------------------------ checking

    def check_target(self, target: PreTrainedModel) -> None:
        """Raise `ValueError` if `target` is not the model this draft was built for, or not on the draft's device."""
        text_config = target.config.get_text_config()
        config = self.config
        problems = []
        if text_config.hidden_size != config.target_hidden_size:
            problems.append(f"hidden size {text_config.hidden_size} (draft expects {config.target_hidden_size})")
        vocab_size = target.get_input_embeddings().weight.shape[0]
        if vocab_size != config.vocab_size:
            problems.append(f"vocabulary of {vocab_size} rows (draft expects {config.vocab_size})")
        num_layers = text_config.num_hidden_layers
        if num_layers <= max(config.target_layer_ids):
            problems.append(
                f"{num_layers} layers, too few for the draft's target_layer_ids {list(config.target_layer_ids)}"
            )
        elif num_layers != config.num_target_layers:
            problems.append(f"{num_layers} layers (draft expects {config.num_target_layers})")
        built_for, target_name = config.target_model_name, getattr(target, "name_or_path", None)
        target_names = {_model_name(name) for name in (target_name, _converted_from(target)) if name}
        if not problems and built_for and target_names and _model_name(built_for) not in target_names:
            warnings.warn(
                f"This Domino draft was built for {built_for}, and the target is {target_name}: same shapes, but a "
                "draft trained on another model's outputs (say, the base model of a chat model) drafts poorly. "
                "Outputs stay exact (the target verifies every draft).",
                stacklevel=2,
            )
        if problems:
            raise ValueError(
                f"This Domino draft was built for {built_for or 'another target'}, but the target "
                f"{target_name or type(target).__name__} has "
                + "; ".join(problems)
                + ". Use the draft trained for this target, or train one with `domino-spec train --target ...`."
            )
        # The draft runs the target's embeddings and LM head on its own activations.
        devices = {
            "draft": self.fc.weight.device,
            "target's embedding layer": target.get_input_embeddings().weight.device,
            "target's LM head": target.get_output_embeddings().weight.device,
        }
        if len(set(devices.values())) > 1:
            raise ValueError(
                "The draft and the target's embeddings and LM head must share a device, but "
                + ", ".join(f"the {name} is on {device}" for name, device in devices.items())
                + ": move the draft with draft.to(target.get_input_embeddings().weight.device), and keep the target's "
                "embeddings and LM head on one device (device_map)."
            )

    # ------------------------------------------------------------------ backbone

    def fuse_target_hidden_states(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Concatenate the tapped layers of a target's `output_hidden_states` output: `[B, T, n_layers * D]`.

        `hidden_states[0]` is the embedding output, so layer `i`'s output is `hidden_states[i + 1]`.
        """
        return torch.cat([hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    def project_context(self, target_hidden: torch.Tensor, position_ids: torch.Tensor) -> list[tuple]:
        """Per draft layer, keys and values `[B, Hkv, T, Dh]` of the target features `[B, T, n_layers * D]`.

        The context never enters the draft's residual stream: only `hidden_norm(fc(features))` projected by each
        layer's k/v, so this can be computed once, apart from any block.
        """
        self._check_target_hidden(target_hidden)
        context = self.hidden_norm(self.fc(target_hidden.to(self.dtype)))  # [B, T, D]
        cos, sin = self.rotary_emb(context, position_ids)
        return [layer.self_attn.project_context(context, cos, sin) for layer in self.layers]

    def backbone(
        self,
        block_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        context_keys_values: list[tuple],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Parallel pass over block tokens `[B, Q, D]` at `position_ids` `[B, Q]`; returns normed hidden `[B, Q, D]`."""
        hidden_states = block_embeds.to(self.dtype)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        for layer, (context_keys, context_values) in zip(self.layers, context_keys_values):
            hidden_states = layer(hidden_states, cos, sin, context_keys, context_values, attention_mask)
        return self.norm(hidden_states)

    @staticmethod
    def _check_anchor_positions(anchor_positions: torch.Tensor, length: int) -> None:
        # Out-of-range anchors would fail deep inside `gather` (a device-side assert on CUDA).
        if anchor_positions.ndim != 2:
            raise ValueError(
                f"anchor_positions must have shape (batch_size, num_blocks), got {tuple(anchor_positions.shape)}."
            )
        if anchor_positions.numel() and not (0 <= int(anchor_positions.min()) and int(anchor_positions.max()) < length):
            raise ValueError(
                f"anchor_positions must index the sequence: values in [0, {length - 1}], got "
                f"[{int(anchor_positions.min())}, {int(anchor_positions.max())}]."
            )

    def _check_target_hidden(self, target_hidden: torch.Tensor) -> None:
        expected = len(self.config.target_layer_ids) * self.config.target_hidden_size
        if target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target features have width {target_hidden.shape[-1]}, expected {expected} "
                f"({len(self.config.target_layer_ids)} tapped layers x hidden {self.config.target_hidden_size}): "
                "pass `fuse_target_hidden_states(outputs.hidden_states)` of the target this draft was built for."
            )

    def base_logits(self, draft_hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The target's LM head over the draft vocabulary: `[..., D]` hidden states -> `[..., V]` logits.

        With a draft vocabulary, only its rows of the LM head are multiplied, by a linear of their own (`rows_of`,
        never saved; `optimize_for_cpu` plans its kernels), where a round would spend most on the whole vocabulary.
        """
        hidden = draft_hidden.to(lm_head.weight.dtype)
        vocab = self.draft_vocab
        if vocab is None:
            return lm_head(hidden)
        if type(lm_head) is not nn.Linear:  # a module that transforms its output (an adapter): its logits, then ours
            return lm_head(hidden)[..., vocab]
        return self.derived.get("draft_lm_head", (lm_head.weight, vocab), lambda: rows_of(lm_head, vocab))(hidden)

    def to_draft_vocab(self, token_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Token ids as draft-vocabulary indices (training labels); ids outside it, and `ignore_index`, become
        `ignore_index`."""
        if self.draft_vocab is None:
            return token_ids
        index_of = _index_of(self.draft_vocab.to(token_ids.device), self.config.vocab_size, missing=ignore_index)
        return torch.where(token_ids == ignore_index, ignore_index, index_of[token_ids.clamp(min=0)])

    def _draft_slots(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """The block positions that propose tokens: all with `shift_label`, else all but the anchor.

        Slot s (0-based) then always predicts the token at `anchor + s + 1`: the one alignment rule of the model.
        """
        return block_hidden if self.config.shift_label else block_hidden[..., 1:, :]

    # ------------------------------------------------------------------ training forward

    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden: torch.Tensor,
        anchor_positions: torch.LongTensor,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        attention_mask: torch.Tensor | None = None,
        head_reads_predictions: bool = False,
    ) -> DominoOutput:
        r"""
        Teacher-forced training forward: context of whole sequences plus one block at each anchor.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`): the ground-truth sequence.
            target_hidden (`torch.Tensor` of shape
                `(batch_size, sequence_length, len(target_layer_ids) * hidden_size)`): the target's tapped hidden states
                for the same sequence (see `fuse_target_hidden_states`).
            anchor_positions (`torch.LongTensor` of shape `(batch_size, num_blocks)`): index of each block's anchor.
                Blocks may overlap; each sees only the context before its anchor and itself.
            embed_tokens, lm_head (`nn.Module`): the target's input embeddings and LM head.
            attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*): 0 on padding.
            head_reads_predictions (`bool`): training-time test: the GRU reads the draft's own greedy tokens
                instead of the ground truth (the paper's ablation).

        Returns `DominoOutput` with logits of shape `(batch_size, num_blocks, num_draft_tokens, V)` over the draft
        vocabulary (`to_draft_vocab` maps labels to it); slot s of block n predicts
        `input_ids[:, anchor_positions[:, n] + s + 1]`.
        """
        check_input_ids(input_ids, self.config.vocab_size)
        batch_size, length = input_ids.shape
        self._check_anchor_positions(anchor_positions, length)
        num_blocks = anchor_positions.shape[1]
        block_size = self.config.block_size
        positions = torch.arange(length, device=input_ids.device).expand(batch_size, -1)
        context = self.project_context(target_hidden, positions)

        offsets = torch.arange(block_size, device=input_ids.device)
        block_positions = anchor_positions[:, :, None] + offsets  # [B, N, K]
        block_ids = torch.full_like(block_positions, self.config.mask_token_id)
        block_ids[:, :, 0] = input_ids.gather(1, anchor_positions)
        if self.config._attn_implementation == "flex_attention":
            mask = flex_block_attention_mask(anchor_positions, length, block_size, attention_mask)
        else:
            mask = block_attention_mask(anchor_positions, length, block_size, attention_mask)
        hidden = self.backbone(
            embed_tokens(block_ids.view(batch_size, -1)), block_positions.view(batch_size, -1), context, mask
        )
        draft_hidden = self._draft_slots(hidden.view(batch_size, num_blocks, block_size, -1))  # [B, N, S, D]
        base_logits = self.base_logits(draft_hidden, lm_head)  # [B, N, S, V]
        if self.head is None:
            return DominoOutput(logits=base_logits, base_logits=base_logits)

        num_slots = draft_hidden.shape[2]
        flat_hidden = draft_hidden.reshape(batch_size * num_blocks, num_slots, -1)
        flat_base = base_logits.reshape(batch_size * num_blocks, num_slots, -1)
        # Ground truth at anchor + s: the tokens the GRU reads before slot s predicts anchor + s + 1.
        prefix_positions = (anchor_positions[:, :, None] + offsets[:num_slots]).clamp(max=length - 1)
        prefix_ids = input_ids.gather(1, prefix_positions.view(batch_size, -1)).view(-1, num_slots)  # [B*N, S]
        if head_reads_predictions:  # argmax has no gradient: the GRU reads the predictions as constants
            _, logits, _ = self.head.draft(
                flat_base,
                flat_hidden,
                embed_tokens(prefix_ids[:, 0]),
                embed_tokens,
                self.draft_vocab,
                whole_vocabulary=True,
            )
        else:
            logits = self.head(flat_base, flat_hidden, embed_tokens(prefix_ids))
        return DominoOutput(logits=logits.view_as(base_logits), base_logits=base_logits)

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def extend_context(
        self,
        past_key_values: DominoContextCache,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        """Append the keys and values of new target features `[B, T_new, n_layers * D]` to the draft's cache, after
        the context it holds pending (`DominoContextCache.defer`).

        Only the new positions are computed; `attention_mask` (`[B, T_new]`) marks slots that hold no committed
        token (padding, rejected drafts) with 0.
        """
        if not isinstance(target_hidden, torch.Tensor):
            raise TypeError(
                f"target_hidden must be the tapped layers' features, a tensor [B, T, n_layers * D], not a "
                f"{type(target_hidden).__name__}: pass draft.fuse_target_hidden_states(outputs.hidden_states)."
            )
        if position_ids is None:
            raise ValueError("target_hidden needs the positions of its tokens: pass context_position_ids ([B, T]).")
        target_hidden, position_ids, attention_mask = past_key_values.take_pending(
            target_hidden, position_ids, attention_mask
        )
        previous_length = past_key_values.get_seq_length()
        for layer_idx, (keys, values) in enumerate(self.project_context(target_hidden, position_ids)):
            past_key_values.append(layer_idx, keys, values)
        past_key_values.append_mask(previous_length, attention_mask, target_hidden.shape[0])

    @torch.no_grad()
    def block_logits(
        self,
        anchor_ids: torch.LongTensor,
        anchor_position_ids: torch.LongTensor,
        past_key_values: DominoContextCache,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        num_slots: int | None = None,
    ) -> DominoBlock:
        """The backbone's pass over `[anchor, MASK...]` after the cached context (the whole block, as in training) and
        the base logits of its first `num_slots` draft slots (all by default): a drafting round before the head."""
        batch_size = anchor_ids.shape[0]
        block_size = self.config.block_size
        block_ids = anchor_ids.new_full((batch_size, block_size), self.config.mask_token_id)
        block_ids[:, 0] = anchor_ids
        position_ids = anchor_position_ids[:, None] + torch.arange(block_size, device=anchor_ids.device)
        mask = None
        if past_key_values.attention_mask is not None:
            block_mask = past_key_values.attention_mask.new_ones(batch_size, block_size)
            mask = torch.cat([past_key_values.attention_mask, block_mask], dim=-1)[:, None, None, :]
        context = list(zip(past_key_values.keys, past_key_values.values))
        block_embeds = embed_tokens(block_ids)
        compiled = self.__dict__.get("_compiled_drafting")  # `domino_spec.generation.compile_drafting`: not saved
        backbone = self.backbone if compiled is None else compiled.backbone
        draft_hidden = self._draft_slots(backbone(block_embeds, position_ids, context, mask))[:, :num_slots]
        return DominoBlock(self.base_logits(draft_hidden, lm_head).float(), draft_hidden, block_embeds[:, 0])

    @torch.no_grad()
    def draft_block(
        self,
        anchor_ids: torch.LongTensor,
        anchor_position_ids: torch.LongTensor,
        past_key_values: DominoContextCache,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        target_hidden: torch.Tensor | None = None,
        context_position_ids: torch.LongTensor | None = None,
        context_mask: torch.Tensor | None = None,
        do_sample: bool = False,
        logits_processor: Callable | None = None,
        prefix_ids: torch.LongTensor | None = None,
        generator: torch.Generator | None = None,
        options: DraftingOptions | None = None,
        sampling: DraftSampling | None = None,
        num_slots: int | None = None,
    ) -> DominoDraft:
        r"""
        One drafting round: append the new context, run the backbone once over `[anchor, MASK...]`, then the head.

        Args:
            anchor_ids (`torch.LongTensor` of shape `(batch_size,)`): the last committed token of each row.
            anchor_position_ids (`torch.LongTensor` of shape `(batch_size,)`): its position.
            past_key_values (`DominoContextCache`): the draft's context cache; after the call it holds only context.
            embed_tokens, lm_head (`nn.Module`): the target's input embeddings and LM head.
            target_hidden (`torch.Tensor` of shape `(batch_size, new_length, n_layers * hidden)`, *optional*): target
                features of the tokens committed since the last call, with `context_position_ids` and `context_mask`.
            do_sample (`bool`): sample each draft from softmax of its (processed) logits, else argmax.
            logits_processor (*optional*): called as `logits_processor(ids, logits)` on each slot's logits, with
                `ids` = `prefix_ids` followed by the drafts so far (transformers' `LogitsProcessorList` works).
            options (`DraftingOptions`, *optional*): the run-time options; default `self.drafting_options`.
            sampling (`DraftSampling`, *optional*): sample each draft from its logits over the draft vocabulary with
                these temperature, top-k and top-p instead (as cheap as greedy drafting; `do_sample` and
                `logits_processor` are then unused).
            num_slots (`int`, *optional*): draft only the block's first that many tokens (default: all).
        """
        if anchor_ids.ndim != 1 or anchor_position_ids.shape != anchor_ids.shape:
            # The block is built here from one anchor per row; a longer block input would silently misalign.
            raise ValueError(
                f"draft_block takes one anchor token per row: anchor_ids and anchor_position_ids of shape "
                f"(batch_size,), got {tuple(anchor_ids.shape)} and {tuple(anchor_position_ids.shape)}. The block "
                f"[anchor, MASK x {self.config.block_size - 1}] is built from the anchor; earlier tokens are context "
                "(`target_hidden`)."
            )
        if target_hidden is not None:
            self.extend_context(past_key_values, target_hidden, context_position_ids, context_mask)
        if past_key_values.get_seq_length() == 0:
            raise ValueError(
                "draft_block needs target context: pass `target_hidden` (the target's tapped hidden states of the "
                "prompt) on the first call."
            )
        block = self.block_logits(anchor_ids, anchor_position_ids, past_key_values, embed_tokens, lm_head, num_slots)
        choose = None
        if sampling is None and (logits_processor is not None or do_sample):
            choose = slot_chooser(prefix_ids, logits_processor, do_sample, generator)
        return self.draft_from_block(block, embed_tokens, choose, options, sampling, generator)

    @torch.no_grad()
    def draft_from_block(
        self,
        block: DominoBlock,
        embed_tokens: nn.Module,
        choose: Chooser | None = None,
        options: DraftingOptions | None = None,
        sampling: DraftSampling | None = None,
        generator: torch.Generator | None = None,
    ) -> DominoDraft:
        """The rest of a drafting round after `block_logits`: the head's slot loop (compiled or fused where the package
        set that up: `domino_spec.generation`), or without a head each slot's pick from its base logits. `choose`
        (processed or sampled drafting, `head_domino.slot_chooser`) picks from each slot's logits over the target's
        vocabulary; `sampling` draws from the draft vocabulary's; neither is greedy."""
        vocab_size = self.config.vocab_size
        if self.head is None:
            tokens, logits, confidence = base_drafts(
                block.base_logits, self.draft_vocab, choose, vocab_size, sampling, generator
            )
        else:
            greedy = self.__dict__.get("_greedy_head", greedy_head)  # fused: `domino_spec.generation.fuse_head_step`
            compiled = self.__dict__.get("_compiled_drafting")
            greedy = greedy if compiled is None else compiled.greedy_head(greedy)
            tokens, logits, confidence = self.head.draft(
                *block,
                embed_tokens,
                self.draft_vocab,
                options or self.drafting_options,
                choose,
                vocab_size,
                greedy=greedy,
                sampling=sampling,
                generator=generator,
            )
        if choose is None:  # greedy and sampled logits are the draft vocabulary's
            logits = to_target_vocabulary(logits, self.draft_vocab, vocab_size)
        return DominoDraft(tokens=tokens, logits=logits, confidence=confidence)

    def clear_derived_tensors(self) -> None:
        """Drop the tensors derived from the draft's and the target's weights for fast drafting (the draft's rows of
        the LM head, the GRU input table, ...); the next drafting round rebuilds them.

        Call it after writing weights through `.data`, which bypasses the change check (peft's `merge_adapter` and
        `unmerge_adapter` do, on the target too).
        """
        self.derived.clear()
        if self.head is not None:
            self.head.derived.clear()

    def __getstate__(self) -> dict:
        """Pickling and copying (`torch.save(draft)`, multiprocessing, `copy.deepcopy`) leave out compiled drafting
        (`domino_spec.generation.compile_drafting`: compile the copy again)."""
        state = dict(super().__getstate__())
        state.pop("_compiled_drafting", None)
        return state

    def get_candidate_generator(
        self,
        target: PreTrainedModel,
        generation_config,
        input_ids: torch.LongTensor,
        logits_processor=None,
        model_kwargs: dict | None = None,
        tokenizer=None,
        **kwargs,
    ) -> DominoCandidateGenerator:
        """The candidate generator `target.generate(..., assistant_model=draft)` uses (`generation_domino.py`)."""
        return candidate_generator(
            self, target, generation_config, input_ids, logits_processor, model_kwargs, tokenizer
        )


DominoDraftModel.register_for_auto_class("AutoModel")  # save_pretrained then writes `auto_map` and copies the code

__all__ = [
    "DominoBlock",
    "DominoContextCache",
    "DominoDraft",
    "DominoDraftModel",
    "DominoOutput",
    "block_attention_mask",
    "flex_block_attention_mask",
    "rows_of",
]
