"""Domino draft model: a DFlash parallel block drafter plus a cheap causal correction head.

One forward over `[anchor, MASK x (block_size - 1)]`, conditioned on the target's hidden states, gives base
logits for the whole block (paper eq. 1); a GRU over the block's tokens and a low-rank map add a causal
residual to the logits (eq. 2-3), so the sequential part never re-runs the LM head.

This file and the root files it imports (`configuration_domino.py`, `head_domino.py`, `head_step_triton.py`,
`published_format.py`) are copied into every saved checkpoint (`trust_remote_code`), so they import only torch and
transformers (and Triton where installed, for the optional fused head step). That includes the candidate generator
behind `target.generate(..., assistant_model=draft)`.
"""

import functools
import inspect
import itertools
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import StaticLayer
from transformers.generation import GenerationMixin, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)
from transformers.utils import ModelOutput

from .configuration_domino import DominoConfig
from .head_domino import (
    COMPILE_MODES,
    CompiledDrafting,
    DominoHeadWeights,
    greedy_head,
    head_block_inputs,
    head_slot_loop,
    slot_chooser,
)
from .head_step_triton import kernel_runs_on, triton_available
from .published_format import check_checkpoint_folder, load_published, published_config_path

# Shapes: B batch, N blocks per sequence, K block size, S drafts per block, T context length, D hidden,
# V vocabulary, G GRU state, R rank of the logit residual, Hq/Hkv attention heads, Dh head dim.


class DominoContextCache:
    """Keys and values of the target context for every draft layer: context only, never block tokens.

    `attention_mask` (`[B, T]`, bool) marks the slots that hold committed tokens; it stays `None` while every slot
    does (batch size one, no padding), so attention needs no mask.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # per layer: [B, Hkv, T, Dh]
        self.values: list[torch.Tensor] = []
        self.attention_mask: torch.Tensor | None = None

    def get_seq_length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if layer_idx == len(self.keys):
            self.keys.append(keys)
            self.values.append(values)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=-2)

    def append_mask(self, previous_length: int, new_mask: torch.Tensor | None, batch_size: int) -> None:
        """Extend the slot mask by `new_mask` (`[B, T_new]`, `None` means all valid)."""
        if new_mask is None or bool(new_mask.all()):
            if self.attention_mask is not None:
                ones = self.attention_mask.new_ones(batch_size, self.get_seq_length() - previous_length)
                self.attention_mask = torch.cat([self.attention_mask, ones], dim=-1)
            return
        if self.attention_mask is None:
            self.attention_mask = new_mask.new_ones(batch_size, previous_length, dtype=torch.bool)
        self.attention_mask = torch.cat([self.attention_mask, new_mask.bool()], dim=-1)

    def crop(self, max_length: int) -> None:
        """A negative `max_length` drops that many slots from the end, as transformers' cache `crop` does, and 0 drops
        none (so `crop(-num_rejected)` is always right); a positive one keeps the first `max_length` slots
        (transformers' older `crop(max_length)`)."""
        if max_length <= 0:
            max_length = max(self.get_seq_length() + max_length, 0)
        if max_length >= self.get_seq_length():
            return
        self.keys = [k[..., :max_length, :] for k in self.keys]
        self.values = [v[..., :max_length, :] for v in self.values]
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[:, :max_length]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (drop finished sequences)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[rows]


@dataclass
class DominoOutput(ModelOutput):
    """Teacher-forced training output.

    Args:
        logits (`torch.FloatTensor` of shape `(batch_size, num_blocks, num_draft_tokens, vocab_size)`):
            Final logits: base logits plus the Domino head's residual (equal to `base_logits` with the head off).
        base_logits (`torch.FloatTensor` of the same shape): the parallel backbone's logits.
    """

    logits: torch.FloatTensor | None = None
    base_logits: torch.FloatTensor | None = None


@dataclass
class DominoDraft(ModelOutput):
    """One drafted block.

    Args:
        tokens (`torch.LongTensor` of shape `(batch_size, num_draft_tokens)`): the proposed continuation.
        logits (`torch.FloatTensor` of shape `(batch_size, num_draft_tokens, vocab_size)`): the (processed) logits
            each token was drawn from, as exact speculative sampling needs them.
    """

    tokens: torch.LongTensor | None = None
    logits: torch.FloatTensor | None = None


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
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
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


def _croppable_cache(cache_implementation: str | None) -> bool:
    """Whether transformers' cache of `generation_config.cache_implementation` can drop rejected drafts."""
    if cache_implementation in (None, "dynamic"):
        return True
    return cache_implementation == "static" and getattr(StaticLayer, "is_croppable", False)


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise `ValueError` unless `input_ids` is a `[B, T]` batch of at least one row of at least one token, every id in
    `[0, vocab_size)`: an empty batch would fail in a reshape, an id out of range in the embedding lookup (an
    IndexError on CPU, a device-side assert on CUDA)."""
    if input_ids.ndim != 2 or 0 in input_ids.shape:
        raise ValueError(
            f"input_ids must be a [batch_size, length] tensor of at least one row of at least one token, got shape "
            f"{tuple(input_ids.shape)}."
        )
    lowest, highest = (int(value) for value in torch.aminmax(input_ids))
    if lowest < 0 or highest >= vocab_size:
        raise ValueError(
            f"input_ids holds token id {lowest if lowest < 0 else highest}, outside the target's vocabulary of "
            f"{vocab_size} tokens (ids 0 to {vocab_size - 1}): tokenize with the target's tokenizer."
        )


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
    the causal correction head (`prefix_gru`, `embed_proj`), under the published weight names.

    The target's token embeddings and LM head are arguments of every call; they are never parameters of the
    draft and never saved with it.
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
        super().__init__(config)
        hidden_size = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden_size, hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DominoDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if config.use_domino_head:
            self.prefix_gru = nn.GRU(hidden_size, config.gru_hidden_dim, num_layers=1, bias=False, batch_first=True)
            self.embed_proj = nn.Sequential(
                nn.Linear(hidden_size + config.gru_hidden_dim, config.emb_dim, bias=False),
                nn.SiLU(),
                nn.Linear(config.emb_dim, config.vocab_size, bias=False),
            )
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, nn.GRU):
            bound = module.hidden_size**-0.5
            for weight in (module.weight_ih_l0, module.weight_hh_l0):
                init.uniform_(weight, -bound, bound)

    # ------------------------------------------------------------------ building and checking

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> "DominoDraftModel":
        """`PreTrainedModel.from_pretrained`, which also reads published Domino and z-lab DFlash checkpoints.

        Such a folder (`model_type: "qwen3"` with a `dflash_config`) is converted by `published_format.load_published`;
        DFlash drafts load with the head off and `shift_label=False`. A local folder is checked first, so a missing
        `config.json` or weights file, or a truncated safetensors file, is named in the error.
        """
        if pretrained_model_name_or_path is None:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        path = str(pretrained_model_name_or_path)
        if os.path.isdir(path):
            check_checkpoint_folder(os.path.join(path, kwargs.get("subfolder") or ""))
        if published_config_path(path, **kwargs) is not None:
            return load_published(cls, path, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def from_target(
        cls, target: PreTrainedModel, num_hidden_layers: int = 1, block_size: int = 16, tokenizer=None, **overrides
    ) -> "DominoDraftModel":
        """A randomly initialised draft matched to `target` (any HF causal LM: Qwen3, Qwen2, Llama, ...), of the config
        `config_for_target` gives."""
        config = cls.config_for_target(target, num_hidden_layers, block_size, tokenizer, **overrides)
        # Built in the target's dtype, not cast to it: a cast would also round the RoPE frequencies (a float buffer) to
        # bf16, while from_pretrained keeps them in fp32, so the trained and the served draft would rotate differently.
        draft = cls._from_config(config, dtype=target.dtype)
        # Start the final norm at the target's, so base logits begin on the LM head's scale.
        target_norm = getattr(getattr(target.get_decoder(), "norm", None), "weight", None)
        if isinstance(target_norm, torch.Tensor) and target_norm.shape == draft.norm.weight.shape:
            with torch.no_grad():
                draft.norm.weight.copy_(target_norm)
        return draft.to(device=target.device)

    @staticmethod
    def config_for_target(
        target: PreTrainedModel, num_hidden_layers: int = 1, block_size: int = 16, tokenizer=None, **overrides
    ) -> DominoConfig:
        """The config of a draft matched to `target`.

        Layer shapes, vocabulary, RoPE and layer count come from the target. The head defaults scale the published
        Qwen3-8B head (hidden 4096: GRU 1024, rank 256) to the target's width. The mask token is the first embedding
        row past the tokenizer (as Qwen3's published 151669) when `tokenizer` is given and the embedding matrix has
        padding rows, else the last row (a padding or reserved token in Qwen and Llama-3 vocabularies). Any config
        field can be overridden, e.g. `target_layer_ids=[1, 5, 9]` or `mask_token_id=...`.
        """
        text_config = target.config.get_text_config()
        hidden_size = text_config.hidden_size
        num_heads = text_config.num_attention_heads
        vocab_size = target.get_input_embeddings().weight.shape[0]
        if tokenizer is not None and len(tokenizer) < vocab_size:
            mask_token_id = len(tokenizer)
        else:
            mask_token_id = vocab_size - 1
        rope_parameters = getattr(text_config, "rope_parameters", None)
        fields = {
            "hidden_size": hidden_size,
            "intermediate_size": text_config.intermediate_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or num_heads,
            "head_dim": getattr(text_config, "head_dim", None) or hidden_size // num_heads,
            "hidden_act": getattr(text_config, "hidden_act", "silu"),
            "max_position_embeddings": text_config.max_position_embeddings,
            "rms_norm_eps": getattr(text_config, "rms_norm_eps", 1e-6),
            "rope_parameters": dict(rope_parameters) if rope_parameters else None,
            "num_target_layers": text_config.num_hidden_layers,
            "vocab_size": vocab_size,
            "mask_token_id": mask_token_id,
            "block_size": block_size,
            "gru_hidden_dim": max(hidden_size // 4, 8),
            "emb_dim": max(hidden_size // 16, 8),
            # The Hub id, where a local conversion records one: portable, and what model cards cite.
            "target_model_name": _converted_from(target) or getattr(target, "name_or_path", None) or None,
        }
        fields.update(overrides)
        return DominoConfig(**fields)

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

    def _draft_slots(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """The block positions that propose tokens: all with `shift_label`, else all but the anchor.

        Slot s (0-based) then always predicts the token at `anchor + s + 1`: the one alignment rule of the model.
        """
        return block_hidden if self.config.shift_label else block_hidden[..., 1:, :]

    # ------------------------------------------------------------------ Domino head

    def _teacher_forced_logits(
        self, base_logits: torch.Tensor, draft_hidden: torch.Tensor, prefix_embeds: torch.Tensor
    ) -> torch.Tensor:
        """Final logits of whole blocks at once: `[M, S, V]` base, `[M, S, D]` hidden and token embeddings.

        `prefix_embeds[:, s]` embeds the token at `anchor + s`, so the GRU state used by slot s has read the anchor
        and every token before the one slot s predicts. Slots before `pure_draft_prefix_len` keep base logits.
        """
        start = self.config.pure_draft_prefix_len
        states, _ = self.prefix_gru(prefix_embeds.to(self.dtype))  # [M, S, G]
        residual = self.embed_proj(torch.cat([draft_hidden[:, start:], states[:, start:]], dim=-1))
        return torch.cat([base_logits[:, :start], base_logits[:, start:] + residual.to(base_logits.dtype)], dim=1)

    def _derived(self, name: str, sources: tuple[torch.Tensor, ...], build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor derived from weights for fast inference, rebuilt when a source is replaced or changed in place by
        a tensor op; never saved. A write through `.data` changes neither: see `clear_derived_tensors`.

        While gradients are enabled (training) it is built fresh each call, so it stays differentiable.
        """
        if torch.is_grad_enabled():
            return build()
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in sources)
        cache = self.__dict__.setdefault("_derived_tensors", {})
        cached_key, cached_sources, derived = cache.get(name, (None, (), None))
        # Weak references, since an address alone can be reused: a new target's embedding where a freed one was.
        same_sources = len(cached_sources) == len(sources) and all(r() is t for r, t in zip(cached_sources, sources))
        if cached_key != key or not same_sources:
            derived = build()
            cache[name] = (key, tuple(weakref.ref(t) for t in sources), derived)
        return derived

    def __getstate__(self) -> dict:
        """Pickling and copying (`torch.save(draft)`, multiprocessing, `copy.deepcopy`) leave out what is rebuilt on
        use: the derived tensors, held with weak references, and compiled drafting (call `compile_drafting` again on
        the copy)."""
        state = dict(super().__getstate__())
        state.pop("_derived_tensors", None)
        state.pop("_compiled_drafting", None)
        return state

    def clear_derived_tensors(self) -> None:
        """Drop the tensors derived from the draft's and the target's weights for fast inference (the GRU input table,
        the fused state weight, ...); the next drafting round rebuilds them.

        Call it after writing weights through `.data`, which bypasses the change check (peft's `merge_adapter` and
        `unmerge_adapter` do, on the target too).
        """
        self.__dict__.pop("_derived_tensors", None)

    def _gru_input_table(self, embed_tokens: nn.Module) -> torch.Tensor | None:
        """`E @ W_ih^T` (`[V, 3G]`): every token's GRU input gates, when small enough to pay; else `None`.

        It turns a drafted token's embedding lookup and matmul into one row lookup. Only for a plain `nn.Embedding`:
        a module that transforms its rows (Gemma3's scaled embedding, a PEFT adapter) embeds each drafted token
        itself, as it embeds the anchor and, in training, the ground-truth tokens.
        """
        if torch.is_grad_enabled() or type(embed_tokens) is not nn.Embedding:
            return None
        weight_ih, embedding = self.prefix_gru.weight_ih_l0, embed_tokens.weight
        table_bytes = embedding.shape[0] * weight_ih.shape[0] * weight_ih.element_size()
        if table_bytes > self.config.gru_input_table_max_bytes:
            return None
        return self._derived("gru_input_table", (embedding, weight_ih), lambda: F.linear(embedding.to(weight_ih.dtype), weight_ih))

    def _head_weights(self, embed_tokens: nn.Module, logits_dtype: torch.dtype, pool_size: int) -> DominoHeadWeights:
        """The head's weights in the slot loop's layouts for a candidate pool of `pool_size` (0: the whole vocabulary),
        derived once per weight version (`_derived`)."""
        weight_ih, weight_hh = self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0
        down, up = self.embed_proj[0].weight, self.embed_proj[2].weight  # [R, D + G], [V, R]
        hidden_size = down.shape[1] - weight_hh.shape[1]
        state_weight = self._derived("state_weight", (weight_hh, down), lambda: torch.cat([weight_hh, down[:, hidden_size:]]))
        up_columns = None
        if not pool_size:  # in the logits' dtype, so no slot converts [R, V] again
            name = f"up_columns_{logits_dtype}"
            up_columns = self._derived(name, (up,), lambda: up.t().to(logits_dtype).contiguous())  # [R, V]
        gate_table = self._gru_input_table(embed_tokens)
        return DominoHeadWeights(weight_ih, embed_tokens, gate_table, state_weight, down, up, up_columns)

    def _head_loop(
        self,
        base_logits: torch.Tensor,
        draft_hidden: torch.Tensor,
        anchor_embeds: torch.Tensor,
        embed_tokens: nn.Module,
        choose: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
        whole_vocabulary: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequential drafting over the S slots of `[M, S, ...]` blocks (eager): the only sequential part of a round.

        Everything that does not depend on the drafted tokens is prepared once: weight layouts per weight version
        (`_head_weights`: GRU input table, fused state weight, transposed residual projection), per block the
        hidden-state half of the low-rank map, the anchor's GRU state and the candidate pools (`head_block_inputs`);
        `head_slot_loop` then runs the slots. With `config.head_candidate_pool = K` each slot's residual covers only
        its K best base tokens in greedy drafting (lossless: the target verifies every draft); the other tokens get
        -inf. Greedy pooled drafting with `config.fused_head_step` runs the slots as one Triton kernel each instead
        (CUDA).

        `choose(s, logits)` returns `(token, logits it was drawn from)` for slot s; `None` is greedy argmax.
        Processed or sampled drafting (a `choose`) scores the whole vocabulary, since a logits processor may mask
        every token of a pool; so does the training-time test (`whole_vocabulary`: no pool, no fused step).
        Returns `[M, S]` tokens and `[M, S, V]` logits.
        """
        if not self.config.use_domino_head:
            choose = choose or slot_chooser(None, None, do_sample=False)
            tokens, logits = zip(*(choose(slot, base_logits[:, slot]) for slot in range(base_logits.shape[1])))
            return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)
        if choose is None and not whole_vocabulary:
            arguments = self._greedy_head_arguments(embed_tokens, base_logits.dtype)
            return greedy_head(base_logits, draft_hidden, anchor_embeds, *arguments)
        weights = self._head_weights(embed_tokens, base_logits.dtype, pool_size=0)
        block = head_block_inputs(base_logits, draft_hidden, anchor_embeds, weights)
        return head_slot_loop(base_logits, block, weights, self.config.pure_draft_prefix_len, choose)

    def _greedy_head_arguments(
        self, embed_tokens: nn.Module, logits_dtype: torch.dtype
    ) -> tuple[DominoHeadWeights, int, int, bool]:
        """`greedy_head`'s `(weights, first_corrected, pool_size, fused_step)`: the options from the config, checked
        first (against this machine too), then the weights for its candidate pool."""
        config = self.config
        config.check_inference_options()
        if config.fused_head_step:
            device = self.prefix_gru.weight_hh_l0.device
            if not kernel_runs_on(device):
                raise RuntimeError(
                    f"config.fused_head_step runs a Triton kernel on CUDA, but the draft is on {device} and Triton is "
                    f"{'installed' if triton_available() else 'not installed'}; set "
                    "config.fused_head_step = False there."
                )
        weights = self._head_weights(embed_tokens, logits_dtype, config.head_candidate_pool)
        return weights, config.pure_draft_prefix_len, config.head_candidate_pool, config.fused_head_step

    def _greedy_head(
        self,
        base_logits: torch.Tensor,
        draft_hidden: torch.Tensor,
        anchor_embeds: torch.Tensor,
        embed_tokens: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafting of a block: the compiled head after `compile_drafting`, else the eager `_head_loop`."""
        compiled = self.__dict__.get("_compiled_drafting")
        if compiled is None or not self.config.use_domino_head or torch.is_grad_enabled():
            return self._head_loop(base_logits, draft_hidden, anchor_embeds, embed_tokens)
        arguments = self._greedy_head_arguments(embed_tokens, base_logits.dtype)
        return compiled.greedy_head(base_logits, draft_hidden, anchor_embeds, *arguments)

    # ------------------------------------------------------------------ compiled drafting

    def compile_drafting(
        self, mode: str | None = "reduce-overhead", dynamic_backbone: bool = True
    ) -> "DominoDraftModel":
        """Compile the drafting hot path with `torch.compile`: the backbone pass and the greedy head. Returns self.

        The greedy head (`greedy_head`: per-block setup and the slot loop, unrolled over the block) has static
        shapes, so `mode="reduce-overhead"` captures it in one CUDA graph on CUDA: one launch instead of about ten
        per slot. The backbone's key length grows every round, so with `dynamic_backbone=True` it is compiled for
        dynamic shapes and without CUDA graphs (which would record one graph per context length);
        `dynamic_backbone=False` specializes it to each shape in `mode`, CUDA graphs included: for fixed-shape
        benchmarks only, as every new context length recompiles.

        `draft_block` then runs the compiled backbone on every call and the compiled head for plain greedy
        drafting (no logits processor, no sampling); other calls keep the eager loop. Compiled kernels may round
        differently, so a near-tie can flip a draft token; verification keeps decoding lossless either way.
        Compilation happens on first use (seconds to minutes), again per batch size. The compiled functions are
        plain attributes, not modules: nothing is saved, and `mode=None` goes back to eager drafting.
        """
        if mode is None:
            self.__dict__.pop("_compiled_drafting", None)
            return self
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile_drafting: mode must be one of {list(COMPILE_MODES)} or None, got {mode!r}.")
        self.__dict__["_compiled_drafting"] = CompiledDrafting(self.backbone, mode, dynamic_backbone)
        return self

    @property
    def is_drafting_compiled(self) -> bool:
        """Whether `compile_drafting` is on."""
        return "_compiled_drafting" in self.__dict__

    def _drafting_backbone(self) -> Callable[..., torch.Tensor]:
        """`backbone`, compiled after `compile_drafting`."""
        compiled = self.__dict__.get("_compiled_drafting")
        return self.backbone if compiled is None else compiled.backbone

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
            target_hidden (`torch.Tensor` of shape `(batch_size, sequence_length, len(target_layer_ids) * hidden_size)`):
                the target's tapped hidden states for the same sequence (see `fuse_target_hidden_states`).
            anchor_positions (`torch.LongTensor` of shape `(batch_size, num_blocks)`): index of each block's anchor.
                Blocks may overlap; each sees only the context before its anchor and itself.
            embed_tokens, lm_head (`nn.Module`): the target's input embeddings and LM head.
            attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*): 0 on padding.
            head_reads_predictions (`bool`): training-time test: the GRU reads the draft's own greedy tokens
                instead of the ground truth (the paper's ablation).

        Returns `DominoOutput` with logits of shape `(batch_size, num_blocks, num_draft_tokens, vocab_size)`; slot s
        of block n predicts `input_ids[:, anchor_positions[:, n] + s + 1]`.
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
        base_logits = lm_head(draft_hidden.to(lm_head.weight.dtype))  # [B, N, S, V]
        if not self.config.use_domino_head:
            return DominoOutput(logits=base_logits, base_logits=base_logits)

        num_slots = draft_hidden.shape[2]
        flat_hidden = draft_hidden.reshape(batch_size * num_blocks, num_slots, -1)
        flat_base = base_logits.reshape(batch_size * num_blocks, num_slots, -1)
        # Ground truth at anchor + s: the tokens the GRU reads before slot s predicts anchor + s + 1.
        prefix_positions = (anchor_positions[:, :, None] + offsets[:num_slots]).clamp(max=length - 1)
        prefix_ids = input_ids.gather(1, prefix_positions.view(batch_size, -1)).view(-1, num_slots)  # [B*N, S]
        if head_reads_predictions:  # argmax has no gradient: the GRU reads the predictions as constants
            anchor_embeds = embed_tokens(prefix_ids[:, 0])
            _, logits = self._head_loop(flat_base, flat_hidden, anchor_embeds, embed_tokens, whole_vocabulary=True)
        else:
            logits = self._teacher_forced_logits(flat_base, flat_hidden, embed_tokens(prefix_ids))
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
        """Append the keys and values of new target features `[B, T_new, n_layers * D]` to the draft's cache.

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
        previous_length = past_key_values.get_seq_length()
        for layer_idx, (keys, values) in enumerate(self.project_context(target_hidden, position_ids)):
            past_key_values.append(layer_idx, keys, values)
        past_key_values.append_mask(previous_length, attention_mask, target_hidden.shape[0])

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
    ) -> DominoDraft:
        r"""
        One drafting round: append the new context, run the backbone once over `[anchor, MASK...]`, then the head loop.

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
        hidden = self._drafting_backbone()(block_embeds, position_ids, context, mask)
        draft_hidden = self._draft_slots(hidden)  # [B, S, D]
        base_logits = lm_head(draft_hidden.to(lm_head.weight.dtype)).float()  # [B, S, V]
        if logits_processor is None and not do_sample:
            tokens, logits = self._greedy_head(base_logits, draft_hidden, block_embeds[:, 0], embed_tokens)
        else:
            choose = slot_chooser(prefix_ids, logits_processor, do_sample, generator)
            tokens, logits = self._head_loop(base_logits, draft_hidden, block_embeds[:, 0], embed_tokens, choose)
        return DominoDraft(tokens=tokens, logits=logits)

    def get_candidate_generator(
        self,
        target: PreTrainedModel,
        generation_config,
        input_ids: torch.LongTensor,
        logits_processor=None,
        model_kwargs: dict | None = None,
        tokenizer=None,
        **kwargs,
    ) -> "DominoCandidateGenerator":
        """The candidate generator `target.generate(..., assistant_model=draft)` uses (see the generate hook below)."""
        self.check_target(target)
        if input_ids.shape[1] == 0:
            raise ValueError(
                "target.generate(assistant_model=draft) needs the prompt as `input_ids` (with or without "
                "`inputs_embeds`): the draft drafts from the target's features of the prompt's tokens."
            )
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"target.generate(assistant_model=draft) decodes one sequence at a time (got batch size "
                f"{input_ids.shape[0]}): transformers' assisted decoding is batch-1 only. For batches use "
                "`domino_spec.generation.speculative_generate(target, draft, input_ids, attention_mask=...)`."
            )
        check_input_ids(input_ids, self.config.vocab_size)
        for name in ("cache", "past_key_values"):  # the name changed in transformers 5.2x
            cache = (model_kwargs or {}).get(name)
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError(
                    f"target.generate(assistant_model=draft) with a prefilled {name} (a cached prompt prefix) is not "
                    "supported: transformers' assisted decoding then gives wrong tokens, with any assistant, and the "
                    "draft needs the target's features of the whole prompt. Pass the whole prompt without a cache."
                )
        if not _croppable_cache(generation_config.cache_implementation):
            raise ValueError(
                f"Domino speculative decoding needs a cache it can crop after each verification; "
                f"cache_implementation={generation_config.cache_implementation!r} cannot be cropped here. "
                "Leave cache_implementation unset (dynamic cache), or use 'static' where transformers' static cache "
                "can be cropped (5.24 on)."
            )
        return DominoCandidateGenerator(self, target, generation_config, logits_processor, tokenizer)


class DominoCandidateGenerator(CandidateGenerator):
    """Block candidates for transformers' assisted decoding, on its `requires_model_outputs` protocol.

    The target's verify forward returns all hidden states (`model_kwargs_overrides`), so the draft reads the
    features of the tokens just accepted with no extra target pass. Drafts are drawn from the same logits
    processors as the target and their logits returned, so transformers applies exact speculative sampling.
    """

    requires_model_outputs = True
    model_kwargs_overrides = {"output_hidden_states": True}

    def __init__(self, draft: DominoDraftModel, target, generation_config, logits_processor=None, tokenizer=None):
        self.draft = draft
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.cache = DominoContextCache()
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor else None
        self.max_length = generation_config.max_length
        eos = generation_config.eos_token_id
        self.eos_token_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.stop_strings = None
        if generation_config.stop_strings:
            if tokenizer is None:
                raise ValueError("stop_strings need the tokenizer: call generate(..., tokenizer=tokenizer).")
            self.stop_strings = StopStringCriteria(tokenizer, generation_config.stop_strings)
            if self.do_sample:
                mask = StopStringDraftMask(self.stop_strings)
                self.logits_processor = LogitsProcessorList([*(self.logits_processor or []), mask])

    def get_candidates(
        self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, n_last_matches=0, **kwargs
    ):
        # The prefill is the target's own first step: it yields the prompt's features and the first anchor.
        if is_first_iteration:
            return self._prefill_candidates(input_ids)
        num_candidates = min(self.draft.config.num_draft_tokens, self.max_length - input_ids.shape[1] - 1)
        if num_candidates <= 0:
            return input_ids, None
        if model_outputs is None or model_outputs.hidden_states is None:
            raise ValueError("Domino drafting needs the target's hidden states from its last forward.")

        device = self.draft.device
        cached = self.cache.get_seq_length()
        num_new = input_ids.shape[1] - 1 - cached  # committed tokens (before the anchor) not yet in the cache
        target_hidden = self.draft.fuse_target_hidden_states(model_outputs.hidden_states)[:, :num_new]
        attention_mask = (model_kwargs or {}).get("attention_mask")
        if attention_mask is not None:
            attention_mask = attention_mask[:, : input_ids.shape[1]].to(device)
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            context_mask = attention_mask[:, cached:-1]
        else:
            positions = torch.arange(input_ids.shape[1], device=device)[None]
            context_mask = None
        draft = self.draft.draft_block(
            anchor_ids=input_ids[:, -1].to(device),
            anchor_position_ids=positions[:, -1],
            past_key_values=self.cache,
            embed_tokens=self.embed_tokens,
            lm_head=self.lm_head,
            target_hidden=target_hidden.to(device),
            context_position_ids=positions[:, cached:-1],
            context_mask=context_mask,
            do_sample=self.do_sample,
            logits_processor=self.logits_processor,
            prefix_ids=input_ids.to(device),
        )
        num_candidates = self._cut_at_stop(input_ids, draft.tokens, num_candidates)
        if num_candidates == 0:
            # No candidates: return no logits either, transformers' speculative sampling cannot take an empty block.
            return input_ids, None
        tokens = draft.tokens[:, :num_candidates].to(input_ids.device)
        logits = draft.logits[:, :num_candidates].to(input_ids.device)
        return torch.cat([input_ids, tokens], dim=-1), logits

    def _prefill_candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No drafts before the target has run, except a placeholder where the prompt itself ends in a stop.

        Transformers 5.17 checks its stopping criteria on the candidates' last token: with none that is the prompt's,
        and a prompt ending in EOS (or a stop string) then got no new token. The placeholder is a token that completes
        no stop string (EOS where there is one: every version cuts after it), with all of the draft's probability;
        the target verifies it like any draft (greedy matching, or rejection sampling against a one-hot q), so the
        output stays exact on every version.
        """
        ends_in_stop = int(input_ids[0, -1]) in self.eos_token_ids
        if self.stop_strings is not None:
            ends_in_stop = ends_in_stop or bool(self.stop_strings(input_ids, None).any())
        if not ends_in_stop:
            return input_ids, None
        vocab_size = self.lm_head.weight.shape[0]
        for token in itertools.chain(sorted(self.eos_token_ids), range(vocab_size)):  # EOS first, usually the one
            placeholder = torch.full_like(input_ids[:, -1:], token)  # [1, 1]
            if self._cut_at_stop(input_ids, placeholder, 1) == 1:
                break
        logits = torch.full((1, 1, vocab_size), -torch.inf, device=input_ids.device)
        logits[0, 0, token] = 0.0
        return torch.cat([input_ids, placeholder], dim=-1), logits

    def update_candidate_strategy(self, input_ids, scores, num_matches) -> None:
        """Nothing to adapt: the block size is fixed (transformers 5.17's base class raises if not overridden)."""

    def _cut_at_stop(self, input_ids: torch.Tensor, tokens: torch.Tensor, num_candidates: int) -> int:
        """Stop proposing after an EOS draft, and before a draft that would complete a stop string.

        Transformers checks stop strings only at the end of the sequence; ending the candidates just before the
        completing token makes the target's own token land there, so generation stops exactly where plain decoding
        does. Sampled drafts avoid such tokens (`StopStringDraftMask`): a cut that depended on the sampled value
        would bias sampling. Where they cannot, the cut happens whatever the draft, and sampling stays exact.
        """
        for index in range(num_candidates):
            token = int(tokens[0, index])
            if self.stop_strings is not None:
                sequence = torch.cat([input_ids, tokens[:, : index + 1].to(input_ids.device)], dim=-1)
                if bool(self.stop_strings(sequence, None).any()):
                    return index
            if token in self.eos_token_ids:
                return index + 1
        return num_candidates


class StopStringDraftMask:
    """A logits processor for sampled drafts: tokens that would complete a stop string get -inf.

    Speculative sampling corrects any draft distribution exactly, so the target still produces such a token where
    its own distribution says so, as its next token, and generation stops there. A row where every token would
    complete a stop string is left as it is: the block is then cut there whatever the draft (`_cut_at_stop`).
    """

    def __init__(self, stop_strings: StopStringCriteria):
        self.stop_strings = stop_strings
        # Per token, the lengths of the stop strings' ends it can hold; -1 pads. A token holding none ends no match.
        first_end_column = stop_strings.max_valid_positions * stop_strings.num_stop_strings
        end_lengths = stop_strings.embedding_vec[:, first_end_column:-1]
        self.final_tokens = (end_lengths > 0).any(dim=-1).nonzero().flatten()  # [F]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tokens = self.final_tokens[self.final_tokens < scores.shape[-1]].to(input_ids.device)
        if tokens.numel() == 0:
            return scores
        tail = input_ids[:, -self.stop_strings.maximum_token_len :]  # a match spans at most this many tokens
        masked = scores.clone()
        for row in range(input_ids.shape[0]):
            continued = torch.cat([tail[row].expand(len(tokens), -1), tokens[:, None]], dim=-1)  # [F, T + 1]
            completing = tokens[self.stop_strings(continued, None)].to(scores.device)
            masked[row, completing] = float("-inf")
            if bool(torch.isneginf(masked[row]).all()):
                masked[row] = scores[row]
        return masked


# ---------------------------------------------------------------------- generate(assistant_model=draft) hook

_HOOK_PARAMETERS = ("generation_config", "input_ids", "logits_processor", "model_kwargs", "assistant_model")


def install_generate_hook() -> bool:
    """Let an assistant model supply its own candidate generator in `GenerationMixin.generate`.

    Transformers has no such hook, so this wraps the private `_get_candidate_generator` once: when the assistant
    has a `get_candidate_generator` method, that is used; otherwise nothing changes. If the private signature is
    not the expected one, warn once and leave generate untouched. Returns whether the hook is installed.
    """
    original = GenerationMixin._get_candidate_generator
    if getattr(original, "_domino_hook", False):
        _install_validation_hook()  # a copy of this file (trust_remote_code) may have installed the first hook only
        return True
    parameters = inspect.signature(original).parameters
    if not all(name in parameters for name in _HOOK_PARAMETERS):
        warnings.warn(
            "domino: transformers' GenerationMixin._get_candidate_generator has an unexpected signature; "
            "generate(assistant_model=draft) will not use Domino drafting. Use "
            "domino_spec.generation.speculative_generate instead.",
            stacklevel=2,
        )
        return False

    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        bound = inspect.signature(original).bind(self, *args, **kwargs)
        arguments = bound.arguments
        factory = getattr(arguments.get("assistant_model"), "get_candidate_generator", None)
        if factory is None:
            return original(self, *args, **kwargs)
        return factory(
            target=self,
            generation_config=arguments["generation_config"],
            input_ids=arguments["input_ids"],
            logits_processor=arguments["logits_processor"],
            model_kwargs=arguments["model_kwargs"],
            tokenizer=arguments.get("target_tokenizer"),
        )

    _get_candidate_generator._domino_hook = True
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    _install_validation_hook()
    return True


def _install_validation_hook() -> None:
    """Run the assistant's own `check_target` before transformers rejects an assistant of another vocabulary.

    `generate` validates assistants (`_validate_generation_mode`, 5.17 to 5.24) before building the candidate
    generator, and takes another vocabulary size for another tokenizer ("universal assisted decoding"). A Domino
    draft drafts with the target's own embeddings and LM head, so its `check_target` names the real mismatch. It runs
    only where transformers would raise, so a draft's name warning is not given twice. Other assistants, and
    transformers versions without this method, are left as they are.
    """
    original = getattr(GenerationMixin, "_validate_generation_mode", None)
    if original is None or getattr(original, "_domino_hook", False):
        return
    signature = inspect.signature(original)
    if "generation_mode_kwargs" not in signature.parameters:
        return

    @functools.wraps(original)
    def _validate_generation_mode(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        assistant = (arguments.get("generation_mode_kwargs") or {}).get("assistant_model")
        check_target = getattr(assistant, "check_target", None)
        if callable(check_target) and hasattr(assistant, "get_candidate_generator"):
            target_vocab_size = self.config.get_text_config().vocab_size
            if target_vocab_size != assistant.config.get_text_config().vocab_size:
                check_target(self)
        return original(self, *args, **kwargs)

    _validate_generation_mode._domino_hook = True
    GenerationMixin._validate_generation_mode = _validate_generation_mode


install_generate_hook()
# save_pretrained then writes `auto_map` and copies this file (and the config file) into the checkpoint.
DominoDraftModel.register_for_auto_class("AutoModel")

__all__ = [
    "DominoCandidateGenerator",
    "DominoContextCache",
    "DominoDraft",
    "DominoDraftModel",
    "DominoOutput",
    "block_attention_mask",
    "check_input_ids",
    "flex_block_attention_mask",
    "install_generate_hook",
]
