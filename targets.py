"""The target model and its tokenizer, as every command uses them: loading, chat prompts, stop tokens, batches.

`load_target` takes a local model folder, the name of a model shipped in a package (`assets.TARGETS`), or the name of
a random-weight model of a real model's shapes (`SHAPE_PRESETS`, for timing: speed depends on shapes, not weights).
"""

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import assets
from .published_format import CONFIG_NAME, WEIGHT_FILES

# Any one of these marks a saved tokenizer; which of them a model needs depends on its tokenizer class.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# Random-weight targets of real models' layer shapes, named `<model>-shapes` (and `tiny`).
SHAPE_PRESETS = {
    "tiny": dict(
        model_type="qwen3",
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen3-0.6b-shapes": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-4b-shapes": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-8b-shapes": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """bf16 on accelerators; fp32 on CPU, where bf16 products of several tokens are much slower."""
    return torch.float32 if device == "cpu" else torch.bfloat16


def load_target(
    name_or_path: str, dtype: torch.dtype | None = None, device: str | None = None
) -> tuple[PreTrainedModel, object]:
    """`(model, tokenizer)` of a local model folder, an asset name or a shape preset (whose tokenizer is None), in
    eval mode on `device` (default: CUDA if there is one) in `dtype` (default: `default_dtype`)."""
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if name_or_path in SHAPE_PRESETS:
        fields = dict(SHAPE_PRESETS[name_or_path])
        config = AutoConfig.for_model(fields.pop("model_type"), max_position_embeddings=40960, **fields)
        with torch.device(device):  # random weights, built where they run
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), None
    if name_or_path in assets.TARGETS:
        folder = assets.target_dir(name_or_path)
    elif os.path.isdir(name_or_path):
        check_model_folder(name_or_path)
        folder = name_or_path
    else:  # the Hub may be out of reach: a name is a folder, an asset or a preset
        known = ", ".join(sorted([*assets.TARGETS, *SHAPE_PRESETS]))
        raise FileNotFoundError(f"target {name_or_path!r}: no such folder, and not a known name ({known})")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    if name_or_path in assets.TARGETS:
        model.name_or_path = assets.TARGETS[name_or_path].hub_id
    return model, tokenizer


def check_model_folder(folder: str) -> None:
    """Raise `FileNotFoundError` naming what `folder` lacks to be a saved model: transformers would otherwise report an
    empty folder as a missing tokenizer library."""
    names = set(os.listdir(folder))
    missing = [f"no {CONFIG_NAME}"] if CONFIG_NAME not in names else []
    if not names & set(WEIGHT_FILES):
        missing.append(f"no weights ({' or '.join(WEIGHT_FILES)})")
    if not names & set(TOKENIZER_FILES):
        missing.append(f"no tokenizer files ({' or '.join(TOKENIZER_FILES)})")
    if missing:
        raise FileNotFoundError(
            f"target {folder} holds no model: it has {', '.join(missing)}; a model folder holds all three, as "
            "`save_pretrained` of a model and of its tokenizer writes them."
        )


def prompt_token_ids(
    tokenizer, messages: list[dict], thinking: bool | None = None, answer: str | None = None
) -> list[int]:
    """The target's chat template with the assistant turn opened, or holding `answer`. `thinking` sets Qwen3's
    `enable_thinking`."""
    extra = {} if thinking is None else {"enable_thinking": thinking}
    if answer is not None:
        messages = [*messages, {"role": "assistant", "content": answer}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=answer is None, tokenize=True, **extra)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def eos_token_ids(target: PreTrainedModel, tokenizer) -> list[int]:
    """The ids that end a response: the target's generation config's, and the tokenizer's EOS."""
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


def pad_token_id(tokenizer) -> int | None:
    """The tokenizer's pad token, else its EOS (many chat models have no pad token; a padded slot is masked anyway)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def left_pad(prompts: list, pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch prompts (token-id lists, or `[1, P]`/`[P]` tensors) with left padding: `input_ids`, `attention_mask`."""
    rows = [torch.as_tensor(prompt, dtype=torch.long).flatten() for prompt in prompts]
    width = max(row.numel() for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, width - row.numel() :] = row
        attention_mask[index, width - row.numel() :] = 1
    return input_ids, attention_mask


__all__ = [
    "SHAPE_PRESETS",
    "check_model_folder",
    "eos_token_ids",
    "left_pad",
    "load_target",
    "pad_token_id",
    "prompt_token_ids",
]
