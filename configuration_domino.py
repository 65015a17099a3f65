"""Domino draft model configuration.

This file is copied into every saved checkpoint (``trust_remote_code``), so it imports only
torch and transformers.
"""

from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import RopeParameters

# DFlash taps target layers evenly between these two: the first layer after the embeddings, and
# the third from the end (the last layers specialise in the target's own next-token prediction).
FIRST_TAPPED_LAYER = 1
LAYERS_SKIPPED_AT_END = 3


def default_target_layer_ids(num_target_layers: int, num_tapped_layers: int) -> list[int]:
    """Evenly spaced target layers to tap, the DFlash recipe: 36 target and 5 tapped give [1, 9, 17, 25, 33]."""
    if num_tapped_layers == 1:
        return [num_target_layers // 2]
    last = max(num_target_layers - LAYERS_SKIPPED_AT_END, FIRST_TAPPED_LAYER + num_tapped_layers - 1)
    span = last - FIRST_TAPPED_LAYER
    return [round(FIRST_TAPPED_LAYER + i * span / (num_tapped_layers - 1)) for i in range(num_tapped_layers)]


def _is_integer(value) -> bool:
    """An int, not a bool: `True` is an int in Python, and `[True, 3]` as layer ids is a mistake, not layer 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_number(value) -> bool:
    """An int or float above 0, not a bool and not a string such as "1e-6" (JSON for a number is unquoted)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


# The published (SGLang) layout's config and weight names differ from ours; the package converts it.
PUBLISHED_FORMAT_ERROR = (
    "This is a published Domino / DFlash checkpoint (model_type 'qwen3' with a dflash_config), which the model code "
    "does not read: load it with the package (`pip install domino-spec`), `domino_spec.published_format.load_draft`."
)


def _check(condition: bool, field: str, value, expected: str) -> None:
    if not condition:
        raise ValueError(f"DominoConfig.{field}={value!r} is invalid: expected {expected}.")


# Below the model, the generate glue and the engine alike, which all check the ids they are given with it.
def check_input_ids(input_ids, vocab_size: int) -> None:
    """Raise `ValueError` unless `input_ids` is a `[B, T]` batch of at least one row of at least one token, every id in
    `[0, vocab_size)`: an empty batch would fail in a reshape, an id out of range in the embedding lookup (an
    IndexError on CPU, a device-side assert on CUDA)."""
    if input_ids.ndim != 2 or 0 in input_ids.shape:
        raise ValueError(
            f"input_ids must be a [batch_size, length] tensor of at least one row of at least one token, got shape "
            f"{tuple(input_ids.shape)}."
        )
    lowest, highest = (int(value) for value in (input_ids.min(), input_ids.max()))
    if lowest < 0 or highest >= vocab_size:
        raise ValueError(
            f"input_ids holds token id {lowest if lowest < 0 else highest}, outside the target's vocabulary of "
            f"{vocab_size} tokens (ids 0 to {vocab_size - 1}): tokenize with the target's tokenizer."
        )


class DominoConfig(PretrainedConfig):
    r"""
    Configuration of a [`DominoDraftModel`]: a DFlash-style parallel block drafter conditioned on a target
    model's hidden states, plus the Domino causal correction head.

    The draft reads the target's token embeddings and LM head at call time, so its `hidden_size` and
    `vocab_size` are the target's. Defaults are the published Qwen3-8B draft (5 layers, block 16).
    `domino_spec.draft_building.config_for_target` builds a config matched to any Hugging Face causal LM.

    Example:

    ```python
    >>> from domino_spec import DominoConfig, DominoDraftModel
    >>> config = DominoConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
    ...                       num_key_value_heads=2, head_dim=16, vocab_size=100, num_target_layers=4,
    ...                       mask_token_id=99, gru_hidden_dim=32, residual_rank=8)
    >>> model = DominoDraftModel(config)
    ```
    """

    model_type = "domino"
    default_theta = 1_000_000.0

    # Draft decoder layers (Qwen3 layout: pre-norm RMSNorm, q_norm/k_norm attention, SwiGLU MLP)
    hidden_size: int = 4096  # width of the draft, equal to the target's (it shares its embeddings and LM head)
    intermediate_size: int = 12288  # SwiGLU inner width
    num_hidden_layers: int = 5  # draft decoder layers
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_parameters: RopeParameters | dict | None = None  # absolute RoPE, as the target's positions
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02

    # The target this draft was built for
    target_hidden_size: int | None = None  # the target's hidden size; defaults to hidden_size, must equal it
    num_target_layers: int = 36  # decoder layers of the target
    vocab_size: int = 151936  # rows of the target's embedding matrix and LM head
    target_layer_ids: list[int] | None = None  # target layers whose outputs feed the draft; default evenly spaced
    mask_token_id: int = 151669  # an unused embedding row of the target, fills the block after the anchor
    target_model_name: str | None = None  # name or path of the target, for clear mismatch errors

    # Block drafting
    block_size: int = 16  # tokens per drafted block: the anchor plus block_size - 1 mask tokens
    shift_label: bool = True  # block position i predicts token anchor + i + 1 (block_size drafts); else anchor + i

    # Domino head: GRU over the block's tokens + low-rank residual on the logits
    use_domino_head: bool = True  # False gives the DFlash backbone alone
    gru_hidden_dim: int = 1024  # GRU state width
    residual_rank: int = 256  # rank of the logit residual (the published `emb_dim`)
    first_corrected_slot: int = 1  # slots before it keep the backbone's logits (the published `pure_draft_prefix_len`)

    # Draft vocabulary: the tokens the draft may propose, its most frequent ones (`draft_vocab` in the weights)
    draft_vocab_size: int | None = None  # None: the whole vocabulary

    # The published checkpoint format's names of our fields, still read from older configs.
    attribute_map = {"emb_dim": "residual_rank", "pure_draft_prefix_len": "first_corrected_slot"}

    def __post_init__(self, **kwargs):
        if "dflash_config" in kwargs:
            raise ValueError(PUBLISHED_FORMAT_ERROR)
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
            if max(self.target_layer_ids) >= self.num_target_layers:
                raise ValueError(
                    f"A target of {self.num_target_layers} layers is too shallow for the default target_layer_ids of "
                    f"a {self.num_hidden_layers}-layer draft ({self.target_layer_ids}): pass target_layer_ids."
                )
        self._check_rope_parameters()  # before transformers fills in its defaults, which fails unclearly on a non-dict
        super().__post_init__(**kwargs)
        self.check()

    @property
    def num_draft_tokens(self) -> int:
        """Tokens proposed per block (the verify pass reads one more: the anchor)."""
        return self.block_size if self.shift_label else self.block_size - 1

    def check(self) -> None:
        """Raise `ValueError` naming the first invalid field."""
        for field in ("shift_label", "use_domino_head"):  # a JSON string such as "false" would otherwise read as true
            value = getattr(self, field)
            _check(
                isinstance(value, bool), field, value, 'a boolean: true or false in config.json, unquoted (not "false")'
            )
        for field in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_target_layers",
            "vocab_size",
            "gru_hidden_dim",
            "residual_rank",
        ):
            value = getattr(self, field)
            _check(_is_integer(value) and value > 0, field, value, "a positive integer")
        _check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            self.num_key_value_heads,
            f"a divisor of num_attention_heads={self.num_attention_heads}",
        )
        _check(
            self.target_hidden_size == self.hidden_size,
            "target_hidden_size",
            self.target_hidden_size,
            f"hidden_size={self.hidden_size}: the draft embeds with the target's embeddings and projects with its LM "
            "head",
        )
        _check(
            _is_integer(self.block_size) and self.block_size >= 2,
            "block_size",
            self.block_size,
            "an integer >= 2 (the anchor plus at least one mask token)",
        )
        _check(
            isinstance(self.target_layer_ids, (list, tuple))
            and len(self.target_layer_ids) > 0
            and all(_is_integer(i) and 0 <= i < self.num_target_layers for i in self.target_layer_ids),
            "target_layer_ids",
            self.target_layer_ids,
            f"a non-empty list of layer indices in [0, {self.num_target_layers - 1}] "
            f"(num_target_layers={self.num_target_layers})",
        )
        _check(
            _is_integer(self.mask_token_id) and 0 <= self.mask_token_id < self.vocab_size,
            "mask_token_id",
            self.mask_token_id,
            f"a token id in [0, {self.vocab_size - 1}] (vocab_size={self.vocab_size})",
        )
        _check(
            _is_integer(self.first_corrected_slot) and 0 <= self.first_corrected_slot <= self.num_draft_tokens,
            "first_corrected_slot",
            self.first_corrected_slot,
            f"an integer in [0, {self.num_draft_tokens}] (the number of drafts per block)",
        )
        _check(
            self.draft_vocab_size is None
            or (_is_integer(self.draft_vocab_size) and 0 < self.draft_vocab_size <= self.vocab_size),
            "draft_vocab_size",
            self.draft_vocab_size,
            f"None (the whole vocabulary) or a size in [1, {self.vocab_size}] (vocab_size={self.vocab_size})",
        )
        _check(0.0 <= self.attention_dropout < 1.0, "attention_dropout", self.attention_dropout, "a float in [0, 1)")
        _check(
            _is_positive_number(self.rms_norm_eps), "rms_norm_eps", self.rms_norm_eps, "a positive float such as 1e-06"
        )
        _check(
            isinstance(self.hidden_act, str) and self.hidden_act in ACT2FN,
            "hidden_act",
            self.hidden_act,
            f"an activation of transformers' ACT2FN: {', '.join(sorted(ACT2FN))}",
        )
        self._check_rope_parameters()

    def _check_rope_parameters(self) -> None:
        """None (transformers fills in the defaults) or a dict whose `rope_theta`, if given, is a positive number."""
        rope_parameters = self.rope_parameters
        _check(
            rope_parameters is None
            or (
                isinstance(rope_parameters, dict)
                and _is_positive_number(rope_parameters.get("rope_theta", self.default_theta))
            ),
            "rope_parameters",
            rope_parameters,
            'null or a dict with a positive rope_theta, such as {"rope_type": "default", "rope_theta": 1000000.0}',
        )


# save_pretrained then writes `auto_map` and copies this file into the checkpoint.
DominoConfig.register_for_auto_class()

__all__ = ["DominoConfig", "check_input_ids", "default_target_layer_ids"]
