"""Building a draft for a target: its config, a fresh draft, its first layers copied from the target, a draft
vocabulary, and more layers for a trained draft. Training, the demo and the benchmarks build drafts; a checkpoint's
users only load one, so this is part of the package and not of a checkpoint's code (`modeling_domino.py` never
imports it).
"""

import torch
from transformers import PreTrainedModel

from .configuration_domino import DominoConfig
from .modeling_domino import DominoDraftModel, _converted_from, _index_of


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
        "residual_rank": max(hidden_size // 16, 8),
        # The Hub id, where a local conversion records one: portable, and what model cards cite.
        "target_model_name": _converted_from(target) or getattr(target, "name_or_path", None) or None,
    }
    fields.update(overrides)
    return DominoConfig(**fields)


def from_target(
    target: PreTrainedModel,
    num_hidden_layers: int = 1,
    block_size: int = 16,
    tokenizer=None,
    draft_vocab: torch.Tensor | list[int] | None = None,
    draft_class: type = DominoDraftModel,
    **overrides,
) -> DominoDraftModel:
    """A randomly initialised `draft_class` matched to `target` (any HF causal LM: Qwen3, Qwen2, Llama, ...), of the
    config `config_for_target` gives; `draft_vocab` (token ids, the most frequent first) limits what it proposes."""
    if draft_vocab is not None:
        draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long)
        overrides["draft_vocab_size"] = draft_vocab.numel()
    config = config_for_target(target, num_hidden_layers, block_size, tokenizer, **overrides)
    # Built in the target's dtype, not cast to it: a cast would also round the RoPE frequencies (a float buffer) to
    # bf16, while from_pretrained keeps them in fp32, so the trained and the served draft would rotate differently.
    draft = draft_class._from_config(config, dtype=target.dtype)
    with torch.no_grad():
        if draft_vocab is not None:
            set_draft_vocab(draft, draft_vocab)
        # Start the final norm at the target's, so base logits begin on the LM head's scale.
        target_norm = getattr(getattr(target.get_decoder(), "norm", None), "weight", None)
        if isinstance(target_norm, torch.Tensor) and target_norm.shape == draft.norm.weight.shape:
            draft.norm.weight.copy_(target_norm)
    return draft.to(device=target.device)


@torch.no_grad()
def copy_target_layers(draft: DominoDraftModel, target: PreTrainedModel, layer_ids: list[int]) -> None:
    """Start draft layer i as target layer `layer_ids[i]`: every weight the two share by name and shape (the
    attention and MLP projections, the norms). A draft layer's own `q_norm`/`k_norm` stay as they are where the
    target has none (Llama)."""
    target_layers = target.get_decoder().layers
    if len(layer_ids) != len(draft.layers) or not all(0 <= i < len(target_layers) for i in layer_ids):
        raise ValueError(
            f"copy_target_layers needs one target layer in [0, {len(target_layers) - 1}] per draft layer "
            f"({len(draft.layers)}), got {layer_ids}."
        )
    for layer, index in zip(draft.layers, layer_ids):
        source = dict(target_layers[index].named_parameters())
        for name, parameter in layer.named_parameters():
            if name in source and source[name].shape == parameter.shape:
                parameter.copy_(source[name])


def _check_draft_vocab(token_ids: torch.Tensor, vocab_size: int, size: int | None = None) -> None:
    """Raise `ValueError` unless `token_ids` are distinct ids of the target's vocabulary (`size` of them if given)."""
    valid = token_ids.ndim == 1 and token_ids.numel() > 0 and token_ids.numel() == (size or token_ids.numel())
    valid = valid and token_ids.unique().numel() == token_ids.numel()
    if not valid or int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
        count = f"{size} distinct (draft_vocab_size of the config)" if size else "distinct"
        span = f", ids {int(token_ids.min())} to {int(token_ids.max())}" if token_ids.numel() else ""
        raise ValueError(
            f"a draft vocabulary is {count} token ids in [0, {vocab_size - 1}] (the target's vocabulary), got shape "
            f"{tuple(token_ids.shape)}{span}."
        )


@torch.no_grad()
def set_draft_vocab(draft: DominoDraftModel, token_ids: torch.Tensor) -> None:
    """Make `token_ids` (the draft's `draft_vocab_size` distinct ids, most frequent first) its draft vocabulary."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=draft.fc.weight.device)
    _check_draft_vocab(token_ids, draft.config.vocab_size, draft.config.draft_vocab_size)
    draft.draft_vocab.copy_(token_ids)


@torch.no_grad()
def with_draft_vocab(draft: DominoDraftModel, token_ids: torch.Tensor | list[int]) -> DominoDraftModel:
    """A new draft that proposes only `token_ids` (distinct, the most frequent first): `draft`'s weights, the head's
    `W_up` rows of those tokens. Shrunk, without a candidate pool, it drafts what `draft` drafts wherever `draft`'s pick
    is among `token_ids`. Grown, the tokens outside `draft`'s vocabulary get zero rows: the backbone's base logits
    alone score them until training gives them residuals."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=draft.fc.weight.device)
    vocab_size = draft.config.vocab_size
    _check_draft_vocab(token_ids, vocab_size)  # before they index the head's rows
    state_dict = {**draft.state_dict(), "draft_vocab": token_ids}
    if draft.head is not None:
        rows = token_ids  # a head over the whole vocabulary has a row per token id
        if draft.draft_vocab is not None:
            rows = _index_of(draft.draft_vocab, vocab_size, missing=-1)[token_ids]
        residual = state_dict["head.embed_proj.2.weight"][rows.clamp(min=0)]  # [V, R]
        state_dict["head.embed_proj.2.weight"] = residual.masked_fill((rows < 0)[:, None], 0.0)
    return _rebuilt(draft, {"draft_vocab_size": token_ids.numel()}, state_dict)


@torch.no_grad()
def with_more_layers(draft: DominoDraftModel, num_layers: int) -> DominoDraftModel:
    """A new draft of `num_layers` decoder layers: `draft`'s, then copies of its last one with their attention and MLP
    output projections zeroed, so each new layer passes its input through and the new draft drafts what `draft`
    drafts until training moves them."""
    depth = draft.config.num_hidden_layers
    if num_layers <= depth:
        raise ValueError(f"with_more_layers adds layers: num_layers must exceed the draft's {depth}, got {num_layers}.")
    state_dict = draft.state_dict()
    last = f"layers.{depth - 1}."
    for name, value in list(state_dict.items()):
        if not name.startswith(last):
            continue
        output_projection = ".o_proj." in name or ".down_proj." in name
        for index in range(depth, num_layers):
            state_dict[f"layers.{index}.{name[len(last) :]}"] = (
                torch.zeros_like(value) if output_projection else value.clone()
            )
    return _rebuilt(draft, {"num_hidden_layers": num_layers}, state_dict)


@torch.no_grad()
def backbone_only(draft: DominoDraftModel) -> DominoDraftModel:
    """A DFlash-only draft of `draft`'s backbone: the same weights without the Domino head (the head's twin at equal
    data and steps when both go on training)."""
    state_dict = {name: value for name, value in draft.state_dict().items() if not name.startswith("head.")}
    return _rebuilt(draft, {"use_domino_head": False}, state_dict)


def _rebuilt(draft: DominoDraftModel, config_changes: dict, state_dict: dict) -> DominoDraftModel:
    """A draft of `draft`'s config with `config_changes`, holding `state_dict`, with its drafting options and mode."""
    config = type(draft.config).from_dict({**draft.config.to_dict(), **config_changes})
    rebuilt = type(draft)._from_config(config, dtype=draft.dtype).to(draft.fc.weight.device)  # RoPE stays in fp32
    rebuilt.load_state_dict(state_dict)
    rebuilt.drafting_options = draft.drafting_options
    return rebuilt.train(draft.training)


__all__ = [
    "backbone_only",
    "config_for_target",
    "copy_target_layers",
    "from_target",
    "set_draft_vocab",
    "with_draft_vocab",
    "with_more_layers",
]
