"""The published Domino / z-lab DFlash checkpoint format, and checks of checkpoint folders.

All conversion between our `DominoConfig` / state dicts and other layouts lives here, called explicitly: by
`load_draft` (what the package's commands load drafts with) and by `domino-spec export`.

Published layout (what SGLang serves): `config.json` with `model_type: "qwen3"`, the Qwen3 layer fields,
`block_size`, `num_target_layers` and a nested `dflash_config` (`mask_token_id`, `target_layer_ids`, and for Domino
`projector_type: "domino"`, `emb_dim` (our `residual_rank`), `gru_hidden_dim`, `pure_draft_prefix_len` (our
`first_corrected_slot`), `shift_label`); weights in `model.safetensors` (or shards with
`model.safetensors.index.json`), the head's at the top level (`prefix_gru.*`, `embed_proj.*`), ours under `head.`.
Older Domino checkpoints nest the head under `logit_head.`; some writers prefix everything with `model.`; our own
older folders have the head at the top level too. The published format has no draft vocabulary: an export drafts
over the whole vocabulary (`W_up` rows of zeros outside the draft vocabulary).

Part of the package, not of a checkpoint's code: `modeling_domino.py` does not import it (a published config makes
`DominoConfig` raise, naming `load_draft`).
"""

import json
import os
import struct
import warnings

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.utils import cached_file

from .configuration_domino import DominoConfig
from .modeling_domino import DominoDraftModel

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, "pytorch_model.bin", "pytorch_model.bin.index.json")

NATIVE, PUBLISHED_DOMINO, PUBLISHED_DFLASH = "native", "published-domino", "dflash"
SUPPORTED_FORMATS = {
    NATIVE: "our own save_pretrained folder (model_type 'domino')",
    PUBLISHED_DOMINO: "published Domino (model_type 'qwen3', dflash_config.projector_type 'domino')",
    PUBLISHED_DFLASH: "z-lab DFlash (model_type 'qwen3', dflash_config without projector_type)",
}
PUBLISHED_ARCHITECTURES = {PUBLISHED_DOMINO: "DominoDraftModel", PUBLISHED_DFLASH: "DFlashDraftModel"}
DOMINO_PROJECTOR = "domino"

# Prefixes of other layouts -> ours, applied in order: first a writer's `model.`, then the head's place.
KEY_PREFIX_RENAMES = (
    ("model.", ""),
    ("logit_head.", "head."),
    ("prefix_gru.", "head.prefix_gru."),
    ("embed_proj.", "head.embed_proj."),
)
HEAD_PREFIX = "head."  # where our head's weights live; the published names drop it
DRAFT_VOCAB_KEY = "draft_vocab"
RESIDUAL_UP_KEY = "head.embed_proj.2.weight"  # W_up, a row per draft-vocabulary token
# Buffers some writers save although they are recomputed at load time.
IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)

# Qwen3 decoder-layer fields, the same names in both formats.
REQUIRED_LAYER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_LAYER_FIELDS = (
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "attention_dropout",
    "initializer_range",
)
# The head's published config fields -> ours (the names ours differ by are DominoConfig's aliases).
DOMINO_HEAD_FIELDS = {"gru_hidden_dim": "gru_hidden_dim", "shift_label": "shift_label", **DominoConfig.attribute_map}


# ---------------------------------------------------------------------- folders and files


# `from_pretrained` options of a published checkpoint: Hub arguments locate its files, the model options go on to the
# model built from the converted weights (`torch_dtype` is the legacy name of `dtype`), and the arguments AutoModel and
# `trust_remote_code` add carry nothing for a local state-dict load. Any other option is ignored with a warning.
HUB_OPTIONS = ("cache_dir", "force_download", "local_files_only", "proxies", "token", "revision", "subfolder")
MODEL_OPTIONS = ("dtype", "device_map", "attn_implementation")
LEGACY_DTYPE_OPTION = "torch_dtype"
IGNORED_OPTIONS = ("config", "trust_remote_code", "_from_auto", "adapter_kwargs")


def _hub_kwargs(kwargs: dict) -> dict:
    return {name: kwargs[name] for name in HUB_OPTIONS if name in kwargs}


def resolve_file(path: str, filename: str, **hub_kwargs) -> str | None:
    """Local path of `filename` in the folder or Hub repo `path`, or None when it has no such file."""
    if os.path.isdir(path):
        candidate = os.path.join(path, hub_kwargs.get("subfolder") or "", filename)
        return candidate if os.path.isfile(candidate) else None
    try:
        return cached_file(path, filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    except (OSError, ValueError):
        return None


def read_config_dict(config_path: str) -> dict:
    """The parsed `config.json`; `ValueError` naming the file if it is not a JSON object."""
    try:
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path} is not a readable JSON file: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}.")
    return config


def detect_format(config: dict, source: str = CONFIG_NAME) -> str:
    """`NATIVE`, `PUBLISHED_DOMINO` or `PUBLISHED_DFLASH`; `ValueError` listing the supported formats otherwise."""
    if config.get("model_type") == "domino":
        return NATIVE
    dflash_config = config.get("dflash_config")
    if isinstance(dflash_config, dict):
        projector_type = dflash_config.get("projector_type")
        if projector_type == DOMINO_PROJECTOR:
            return PUBLISHED_DOMINO
        if projector_type is None:
            return PUBLISHED_DFLASH
        found = f"dflash_config.projector_type={projector_type!r}"
    else:
        found = f"model_type={config.get('model_type')!r}, architectures={config.get('architectures')!r}"
    supported = "; ".join(f"{name}: {description}" for name, description in SUPPORTED_FORMATS.items())
    raise ValueError(f"{source} is not a Domino draft checkpoint ({found}). Supported formats: {supported}.")


def check_safetensors_file(path: str) -> list[str]:
    """Tensor names of a safetensors file; `ValueError` naming the file when it is truncated or corrupt."""
    try:
        with open(path, "rb") as file:
            header_length = struct.unpack("<Q", file.read(8))[0]
        with safe_open(path, framework="pt") as file:
            keys = list(file.keys())
    except (OSError, struct.error, SafetensorError) as error:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {error}") from error
    if header_length <= 0 or not keys:
        raise ValueError(f"{path} holds no tensors.")
    return keys


def weight_files(path: str, **hub_kwargs) -> list[str]:
    """The safetensors files of a checkpoint (one file or the shards of an index), each checked readable.

    `FileNotFoundError` names the missing file; `ValueError` names a broken one.
    """
    single = resolve_file(path, SAFE_WEIGHTS_NAME, **hub_kwargs)
    if single is not None:
        check_safetensors_file(single)
        return [single]
    index_path = resolve_file(path, SAFE_WEIGHTS_INDEX_NAME, **hub_kwargs)
    if index_path is None:
        raise FileNotFoundError(
            f"{path} has no weights: expected {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} beside {CONFIG_NAME}."
        )
    weight_map = read_config_dict(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path} has no `weight_map`.")
    files = []
    for shard in sorted(set(weight_map.values())):
        shard_path = resolve_file(path, shard, **hub_kwargs)
        if shard_path is None:
            raise FileNotFoundError(f"{path} is missing the weight shard {shard} listed in {index_path}.")
        check_safetensors_file(shard_path)
        files.append(shard_path)
    return files


def check_checkpoint_folder(folder: str) -> str:
    """Check a local checkpoint folder before loading it; returns its format.

    Raises `FileNotFoundError` naming a missing `config.json` or weights file and `ValueError` naming a corrupt one,
    instead of the deeper errors a half-written or truncated folder gives otherwise.
    """
    config_path = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{folder} is not a complete checkpoint: {config_path} is missing.")
    checkpoint_format = detect_format(read_config_dict(config_path), config_path)
    if checkpoint_format == NATIVE and not any(os.path.isfile(os.path.join(folder, name)) for name in WEIGHT_FILES):
        expected = " or ".join(WEIGHT_FILES)
        raise FileNotFoundError(
            f"{folder} is not a complete checkpoint: no weights file ({expected}) beside {CONFIG_NAME}."
        )
    for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME):
        if os.path.isfile(os.path.join(folder, name)):
            weight_files(folder)
            break
    else:
        if checkpoint_format != NATIVE:
            weight_files(folder)  # raises: published checkpoints are safetensors only
    return checkpoint_format


def check_draft_folder(folder: str, flag: str = "") -> None:
    """Raise `FileNotFoundError` naming `folder` (and the `flag` that gave it) unless it holds a draft's config.

    The commands read drafts from local folders: a mistyped path fails here at once, not as a Hub download that
    times out.
    """
    if not os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        what = "no such folder" if not os.path.isdir(folder) else f"no {CONFIG_NAME} in it"
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{folder}: {what}, so it is not a draft folder.")


def draft_config(folder: str) -> tuple[DominoConfig, bool]:
    """The draft's config, from our own `config.json` or a published Domino / DFlash one, and whether it is published
    (the SGLang layout `domino-spec export` writes)."""
    check_draft_folder(folder)
    config_path = os.path.join(folder, CONFIG_NAME)
    config = read_config_dict(config_path)
    if detect_format(config, config_path) == NATIVE:
        return DominoConfig.from_pretrained(folder), False
    return DominoConfig(**config_fields_from_published(config, config_path)), True


def needs_conversion(path: str, **kwargs) -> bool:
    """Whether the checkpoint at `path` is in another layout than `save_pretrained` writes today: a published Domino
    or DFlash one, or our own older one (the head's weights at the top level)."""
    hub_kwargs = _hub_kwargs(kwargs)
    config_path = resolve_file(str(path), CONFIG_NAME, **hub_kwargs)
    if config_path is None:
        return False
    try:
        checkpoint_format = detect_format(read_config_dict(config_path), config_path)
    except ValueError:
        return False
    if checkpoint_format != NATIVE:
        return True
    try:
        files = weight_files(str(path), **hub_kwargs)
    except (OSError, ValueError):
        return False  # transformers' own loader reports what is missing
    keys = (key for file in files for key in check_safetensors_file(file))
    return any(rename_key(key) != key for key in keys)


# ---------------------------------------------------------------------- config: published <-> DominoConfig fields


def _pick(config: dict, name: str, default=None):
    """A field from `dflash_config`, else the top level (published checkpoints use both places)."""
    nested = config.get("dflash_config") or {}
    return nested[name] if name in nested else config.get(name, default)


def _require(value, name: str, source: str):
    if value is None:
        raise ValueError(f"{source} is missing `{name}` (top level or dflash_config), which the draft needs.")
    return value


def _rope_parameters(config: dict) -> dict:
    """RoPE as transformers 5 `rope_parameters`, from `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    names = ("rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings")
    return dict(Qwen3Config(**{name: config[name] for name in names if config.get(name) is not None}).rope_parameters)


def _head_field(config: dict, name: str, source: str):
    """A head field of a published config, which may hold it both nested and at the top level (`emb_dim`): they
    must agree."""
    nested, top_level = (config.get("dflash_config") or {}).get(name), config.get(name)
    if nested is not None and top_level is not None and nested != top_level:
        raise ValueError(f"{source}: dflash_config.{name}={nested} differs from the top-level {name}={top_level}.")
    return _require(nested if nested is not None else top_level, name, source)


def config_fields_from_published(config: dict, source: str = CONFIG_NAME) -> dict:
    """`DominoConfig` keyword arguments for a published Domino or DFlash `config.json`.

    DFlash checkpoints load with the head off and `shift_label=False` (block position 0 is the anchor). Missing
    `target_layer_ids` fall back to DFlash's default rule, which `DominoConfig` applies.
    """
    checkpoint_format = detect_format(config, source)
    if checkpoint_format == NATIVE:
        raise ValueError(f"{source} is in our own format (model_type 'domino'): load it with from_pretrained.")
    fields = {name: _require(config.get(name), name, source) for name in REQUIRED_LAYER_FIELDS}
    fields.update({name: config[name] for name in OPTIONAL_LAYER_FIELDS if config.get(name) is not None})
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    fields["rope_parameters"] = _rope_parameters(config)
    fields["num_target_layers"] = _require(_pick(config, "num_target_layers"), "num_target_layers", source)
    fields["block_size"] = _pick(config, "block_size", 16)
    fields["mask_token_id"] = _require(_pick(config, "mask_token_id"), "mask_token_id", source)
    fields["target_layer_ids"] = _pick(config, "target_layer_ids")
    for name in ("target_hidden_size", "target_model_name"):
        if config.get(name) is not None:
            fields[name] = config[name]
    if checkpoint_format == PUBLISHED_DFLASH:
        fields.update(use_domino_head=False, shift_label=False)
    else:
        fields["use_domino_head"] = True
        fields.update({ours: _head_field(config, name, source) for name, ours in DOMINO_HEAD_FIELDS.items()})
    return fields


def checkpoint_dtype(config: dict) -> torch.dtype | None:
    """The weights' dtype recorded in a config (`torch_dtype` or `dtype`), if any."""
    name = config.get("torch_dtype") or config.get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _rope_fields(rope_parameters: dict | None) -> dict:
    """`rope_theta` and `rope_scaling` for readers before transformers 5, plus `rope_parameters`."""
    rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10_000.0})
    scaling = {key: value for key, value in rope_parameters.items() if key != "rope_theta"}
    return {
        "rope_theta": rope_parameters.get("rope_theta"),
        "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
        "rope_parameters": rope_parameters,
    }


def config_to_published(config, dtype: torch.dtype = torch.bfloat16, auto_map: dict | None = None) -> dict:
    """The published `config.json` of a `DominoConfig`: Domino layout with the head, DFlash layout without it."""
    head = bool(config.use_domino_head)
    checkpoint_format = PUBLISHED_DOMINO if head else PUBLISHED_DFLASH
    dflash_config = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    published = {
        "architectures": [PUBLISHED_ARCHITECTURES[checkpoint_format]],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
    }
    if head:
        dflash_config.update(
            projector_type=DOMINO_PROJECTOR,
            **{name: getattr(config, ours) for name, ours in DOMINO_HEAD_FIELDS.items()},
        )
        published["emb_dim"] = config.residual_rank  # duplicated at the top level, as in the published checkpoints
    published["dflash_config"] = dflash_config
    published.update({name: getattr(config, name) for name in REQUIRED_LAYER_FIELDS + OPTIONAL_LAYER_FIELDS})
    published.update(_rope_fields(config.rope_parameters))
    published.update(tie_word_embeddings=False, torch_dtype=str(dtype).removeprefix("torch."))
    if config.target_model_name:
        published["target_model_name"] = config.target_model_name
    if auto_map:
        published["auto_map"] = dict(auto_map)
    return published


# ---------------------------------------------------------------------- weights: published <-> ours


def rename_key(key: str) -> str:
    """A weight's name in another layout (published, older) as ours."""
    for other_prefix, our_prefix in KEY_PREFIX_RENAMES:
        if key.startswith(other_prefix):
            key = our_prefix + key[len(other_prefix) :]
    return key


def load_renamed_state_dict(files: list[str]) -> dict[str, torch.Tensor]:
    """Tensors of the weight files under our names (`rename_key`)."""
    state_dict = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as file:
                for key in file.keys():
                    if not key.endswith(IGNORED_KEY_SUFFIXES):
                        state_dict[rename_key(key)] = file.get_tensor(key)
        except SafetensorError as error:
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {error}") from error
    return state_dict


def check_state_dict(state_dict: dict, expected: dict[str, torch.Size], source: str) -> None:
    """`ValueError` naming the checkpoint and every missing, unexpected or mis-shaped tensor."""
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mis_shaped = [
        f"{key} {tuple(state_dict[key].shape)} (expected {tuple(shape)})"
        for key, shape in expected.items()
        if key in state_dict and state_dict[key].shape != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if mis_shaped:
        problems.append(f"wrong shapes {mis_shaped}")
    if problems:
        raise ValueError(f"The weights in {source} do not match its config.json: " + "; ".join(problems) + ".")


def state_dict_to_published(
    state_dict: dict[str, torch.Tensor], vocab_size: int, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Our parameters under the published names, cast to `dtype`, contiguous. A draft vocabulary, which the format
    cannot hold, becomes the whole `vocab_size`: `W_up` gets rows of zeros for the tokens outside it."""
    state_dict = dict(state_dict)
    vocab = state_dict.pop(DRAFT_VOCAB_KEY, None)
    if vocab is not None and RESIDUAL_UP_KEY in state_dict:
        up = state_dict[RESIDUAL_UP_KEY]
        state_dict[RESIDUAL_UP_KEY] = up.new_zeros(vocab_size, up.shape[1]).index_copy_(0, vocab, up)
    return {
        key.removeprefix(HEAD_PREFIX): tensor.detach().to(dtype=dtype, device="cpu").contiguous()
        for key, tensor in state_dict.items()
    }


# ---------------------------------------------------------------------- load and save


def _model_options(kwargs: dict, source: str) -> dict:
    """The options of `kwargs` for the model built from the converted weights; warns naming any it cannot use."""
    known = {*HUB_OPTIONS, *MODEL_OPTIONS, LEGACY_DTYPE_OPTION, *IGNORED_OPTIONS}
    unsupported = sorted(name for name in kwargs if name not in known)
    if unsupported:
        warnings.warn(
            f"{source} is a published Domino / DFlash checkpoint, whose loader ignores the from_pretrained options "
            f"{unsupported}. Supported: {', '.join(MODEL_OPTIONS + (LEGACY_DTYPE_OPTION,) + HUB_OPTIONS)}.",
            stacklevel=3,
        )
    options = {name: kwargs[name] for name in MODEL_OPTIONS if kwargs.get(name) is not None}
    if "dtype" not in options and kwargs.get(LEGACY_DTYPE_OPTION) is not None:
        options["dtype"] = kwargs[LEGACY_DTYPE_OPTION]  # `dtype` wins when both are given, as in transformers
    # AutoModel moves `attn_implementation` onto the config it passes (None there unless the caller chose one).
    attn_implementation = getattr(kwargs.get("config"), "_attn_implementation", None)
    if "attn_implementation" not in options and attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    return options


def load_converted(model_class, path: str, **kwargs):
    """A `model_class` (`DominoDraftModel`) built from a checkpoint in another layout (`needs_conversion`) at `path`.

    Loading options of `from_pretrained` (`dtype` or the legacy `torch_dtype`, `device_map`, `attn_implementation`,
    Hub arguments) apply; the default dtype is the checkpoint's, as transformers does. A `config` argument (AutoModel
    passes the folder's config) is ignored but for its attention implementation: the config comes from the
    conversion. Any other option is ignored with a warning naming it.
    """
    options = _model_options(kwargs, str(path))
    hub_kwargs = _hub_kwargs(kwargs)
    config_path = resolve_file(str(path), CONFIG_NAME, **hub_kwargs)
    if config_path is None:
        raise FileNotFoundError(f"{path} has no {CONFIG_NAME}.")
    raw_config = read_config_dict(config_path)
    if detect_format(raw_config, config_path) == NATIVE:  # our older layout: the config reads its older names
        config = model_class.config_class.from_pretrained(str(path), **hub_kwargs)
    else:
        config = model_class.config_class(**config_fields_from_published(raw_config, config_path))
    files = weight_files(str(path), **hub_kwargs)
    state_dict = load_renamed_state_dict(files)
    with torch.device("meta"):
        expected = {key: value.shape for key, value in model_class(config).state_dict().items()}
    check_state_dict(state_dict, expected, ", ".join(files))
    if options.get("dtype", "auto") == "auto":
        floats = (tensor.dtype for tensor in state_dict.values() if tensor.is_floating_point())
        options["dtype"] = checkpoint_dtype(raw_config) or next(floats)
    model = model_class.from_pretrained(None, config=config, state_dict=state_dict, **options)
    model.name_or_path = str(path)
    return model.eval()


def save_published(model, output_dir: str, dtype: torch.dtype = torch.bfloat16, auto_map: dict | None = None) -> None:
    """Write `config.json` and `model.safetensors` of `model` in the published layout (weights cast to `dtype`)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, CONFIG_NAME), "w", encoding="utf-8") as file:
        json.dump(config_to_published(model.config, dtype, auto_map), file, indent=2, sort_keys=False)
        file.write("\n")
    weights = state_dict_to_published(model.state_dict(), model.config.vocab_size, dtype)
    save_file(weights, os.path.join(output_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})


def load_draft(path, model_class: type = DominoDraftModel, **kwargs) -> DominoDraftModel:
    """`DominoDraftModel.from_pretrained(path, **kwargs)` for any supported checkpoint: our own folders as they are,
    published Domino and z-lab DFlash ones and our own older layout (the head's weights at the top level) converted
    (`load_converted`; DFlash drafts load with the head off and `shift_label=False`). A local folder is checked
    first, so a missing `config.json` or weights file, or a truncated safetensors file, is named in the error."""
    path = str(path)
    if os.path.isdir(path):
        check_checkpoint_folder(os.path.join(path, kwargs.get("subfolder") or ""))
    if needs_conversion(path, **kwargs):
        return load_converted(model_class, path, **kwargs)
    return model_class.from_pretrained(path, **kwargs)


__all__ = [
    "SUPPORTED_FORMATS",
    "check_checkpoint_folder",
    "config_fields_from_published",
    "config_to_published",
    "detect_format",
    "load_converted",
    "load_draft",
    "needs_conversion",
    "save_published",
]
