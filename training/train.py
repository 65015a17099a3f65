"""`domino-spec train`: train a Domino draft for a target on regenerated data.

    domino-spec train --target DIR --data FILE --output DIR --max_steps N [--draft_vocab_size N] [--config recipe.yaml]

Every `transformers.TrainingArguments` flag works (parsed with `HfArgumentParser`), and `--config recipe.yaml`, whose
keys are the same flag names; flags on the command line win over the file. Rerunning resumes. `cache-features` takes
the same flags (`parse_train_arguments`, `load_target_and_data`).
"""

import argparse
import difflib
import json
import os
import sys
from dataclasses import dataclass, field

import torch
import yaml
from transformers import HfArgumentParser, set_seed

from ..draft_building import backbone_only, copy_target_layers, from_target, with_more_layers
from ..modeling_domino import DominoDraftModel
from ..published_format import check_draft_folder, load_draft
from ..targets import load_target, pad_token_id
from .checkpoints import check_resumable, checkpoint_to_resume, final_draft_problem, finished_at
from .collator import DominoDataCollator
from .data import (
    check_regenerated_by,
    check_vocabulary,
    draft_vocabulary,
    generation_settings,
    load_training_dataset,
    summarize,
)
from .features import FeatureStore
from .trainer import DominoTrainer, DominoTrainingArguments

# The published Qwen3-8B draft has 5 layers for a 36-layer target; `train` scales this to other targets.
PUBLISHED_DRAFT_LAYERS, PUBLISHED_TARGET_LAYERS = 5, 36


@dataclass
class DraftArguments:
    """What to train: the target, the data and the draft's shape."""

    target: str = field(metadata={"help": "Target model folder or asset name."})
    data: str = field(metadata={"help": "Regenerated .jsonl from `domino-spec generate-data`."})
    draft_layers: int | None = field(
        default=None,
        metadata={
            "help": "Draft decoder layers (default: the published 5-for-36 ratio). With --init_from, more than the "
            "draft has appends layers that start by passing their input through (the draft drafts as before)."
        },
    )
    block_size: int | None = field(default=None, metadata={"help": "Tokens per drafted block (default 16)."})
    use_domino_head: bool | None = field(
        default=None, metadata={"help": "False trains the DFlash backbone alone (default True)."}
    )
    shift_label: bool | None = field(
        default=None,
        metadata={
            "help": "Block position i predicts anchor + i + 1 (default True); False is the published DFlash layout "
            "(position 0 holds the anchor), which a head-less draft needs for `export --format sglang`."
        },
    )
    gru_hidden_dim: int | None = field(default=None, metadata={"help": "GRU width (default hidden_size / 4)."})
    residual_rank: int | None = field(
        default=None, metadata={"help": "Rank of the logit residual (default hidden_size / 16)."}
    )
    target_layer_ids: str | None = field(
        default=None, metadata={"help": "Comma-separated target layers to tap (default evenly spaced)."}
    )
    mask_token_id: int | None = field(default=None, metadata={"help": "Target embedding row used as the mask token."})
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "Tokens the draft may propose: the N most frequent in the training responses (unset or 0: the "
            "target's whole vocabulary). Far cheaper drafting and training on CPU; the target still verifies all."
        },
    )
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "Start from this draft folder instead of random (with --use_domino_head false, from its backbone "
            "alone)."
        },
    )
    init_from_target_layers: bool = field(
        default=False,
        metadata={"help": "Start a fresh draft's layers as the target's last layers (the weights they share)."},
    )
    max_length: int = field(default=3072, metadata={"help": "Training sequence length cap."})
    features: str | None = field(
        default=None, metadata={"help": "Folder of precomputed target features (domino-spec cache-features)."}
    )
    eval_data: str | None = field(
        default=None,
        metadata={
            "help": "Held-out regenerated .jsonl, scored (eval_loss, eval_acceptance_final, ...) per --eval_strategy, "
            "or once after training when that is 'no'."
        },
    )


def draft_shape(draft_args: DraftArguments) -> dict:
    """The `DominoConfig` fields the draft-shape flags set, for those given."""
    layer_ids = draft_args.target_layer_ids
    fields = {
        "num_hidden_layers": draft_args.draft_layers,
        "block_size": draft_args.block_size,
        "use_domino_head": draft_args.use_domino_head,
        "shift_label": draft_args.shift_label,
        "gru_hidden_dim": draft_args.gru_hidden_dim,
        "residual_rank": draft_args.residual_rank,
        "target_layer_ids": [int(i) for i in layer_ids.split(",")] if layer_ids else None,
        "mask_token_id": draft_args.mask_token_id,
        "draft_vocab_size": draft_args.draft_vocab_size or None,  # 0: the whole vocabulary, as unset
    }
    return {name: value for name, value in fields.items() if value is not None}


def fresh_draft_shape(draft_args: DraftArguments, target) -> dict:
    """`draft_shape`, with the defaults of a fresh draft: block 16, the published ratio of draft to target layers."""
    num_target_layers = target.config.get_text_config().num_hidden_layers
    layers = max(1, round(num_target_layers * PUBLISHED_DRAFT_LAYERS / PUBLISHED_TARGET_LAYERS))
    return {"num_hidden_layers": layers, "block_size": 16, **draft_shape(draft_args)}


def build_draft(draft_args: DraftArguments, target, tokenizer, dataset=None) -> DominoDraftModel:
    """A fresh draft of the flags' shape for `target` (its draft vocabulary the most frequent tokens of `dataset`'s
    responses), or the `--init_from` draft; master weights in fp32 (--bf16 trains under autocast)."""
    shape = draft_shape(draft_args)
    if draft_args.init_from:
        draft = load_draft(draft_args.init_from)
        if draft.config.use_domino_head and shape.get("use_domino_head") is False:
            draft = backbone_only(draft)
        if shape.get("num_hidden_layers", 0) > draft.config.num_hidden_layers:
            draft = with_more_layers(draft, shape["num_hidden_layers"])
        conflicts = [
            f"{name}={value} (the draft has {getattr(draft.config, name)})"
            for name, value in shape.items()
            if getattr(draft.config, name) != value
        ]
        if conflicts:
            raise ValueError(
                f"--init_from {draft_args.init_from}: the draft's shape is fixed, but the flags ask for "
                f"{'; '.join(conflicts)}. Drop those flags, or train a fresh draft without --init_from."
            )
        draft.check_target(target)
        return draft.float()
    shape = fresh_draft_shape(draft_args, target)
    if shape.get("draft_vocab_size") is not None:
        vocab_size = target.get_input_embeddings().weight.shape[0]
        shape["draft_vocab"] = draft_vocabulary(dataset, shape.pop("draft_vocab_size"), vocab_size)
    draft = from_target(target, tokenizer=tokenizer, **shape)
    if draft_args.init_from_target_layers:
        num_target_layers = target.config.get_text_config().num_hidden_layers
        copy_target_layers(draft, target, list(range(num_target_layers - len(draft.layers), num_target_layers)))
    return draft.float()


def read_config_file(path: str) -> dict:
    """The flag values of a `--config` YAML file: a mapping of flag names to values (an empty file: none)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as file:
            values = yaml.safe_load(file)
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--config {path} is not UTF-8 text ({error.reason} at byte {error.start}): save it as UTF-8."
        ) from None
    except yaml.YAMLError as error:  # the line and column it points at
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        reason = getattr(error, "problem", None) or error
        raise ValueError(
            f"--config {path} is not valid YAML ({reason}{at}): fix the file, whose keys are "
            "train's flag names (`learning_rate: 0.0006`)."
        ) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(
            f"--config {path} holds a {type(values).__name__}, not a mapping of flag names to values: "
            "write one `flag_name: value` per line (`learning_rate: 0.0006`)."
        )
    return values


def parse_train_arguments(
    argv: list[str], prog: str = "domino-spec train", description: str | None = None, extra_arguments: tuple = ()
) -> tuple:
    """`(draft_args, training_args, *extra)`: train's flags, and those of each dataclass in `extra_arguments`."""
    description = description or (
        "Train a Domino draft for a target on regenerated data: every transformers TrainingArguments flag works, "
        "--config recipe.yaml takes the same flags (the command line wins), and rerunning resumes."
    )
    argument_types = (DraftArguments, DominoTrainingArguments, *extra_arguments)
    parser = HfArgumentParser(argument_types, prog=prog, description=description)
    parser.add_argument("--config", default=None, help="YAML file of flag values; command-line flags win")
    parser.add_argument("--output", dest="output_dir", default=argparse.SUPPRESS, help="alias of --output_dir")
    # Without a GPU, train on the CPU explicitly: multi-process CPU runs (accelerate launch --cpu) need it.
    parser.set_defaults(use_cpu=not torch.cuda.is_available())
    config_flag = argparse.ArgumentParser(add_help=False)
    config_flag.add_argument("--config", default=None)
    known, _ = config_flag.parse_known_args(argv)
    if known.config:
        values = read_config_file(known.config)
        if "output" in values:  # the alias of output_dir, as on the command line
            values["output_dir"] = values.pop("output")
        if isinstance(values.get("target_layer_ids"), list):
            values["target_layer_ids"] = ",".join(str(layer) for layer in values["target_layer_ids"])
        flags = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - flags)
        if unknown:
            hints = [
                f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, flags, 1)) else key
                for key in unknown
            ]
            raise ValueError(f"{known.config}: unknown keys {', '.join(hints)}; keys are the flag names of `train`.")
        parser.set_defaults(**values)
        for action in parser._actions:  # a value from the file satisfies a required flag
            if action.dest in values:
                action.required = False
    *parsed, _ = parser.parse_args_into_dataclasses(args=argv)
    return tuple(parsed)


def main(argv: list[str]) -> None:
    draft_args, training_args = parse_train_arguments(argv)
    try:
        train(draft_args, training_args)
    finally:  # a live gloo process group aborts the interpreter's exit ("terminate called without an active exception")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def train(draft_args: DraftArguments, training_args: DominoTrainingArguments) -> None:
    if training_args.eval_strategy != "no" and not draft_args.eval_data:
        raise ValueError(
            f"--eval_strategy {training_args.eval_strategy.value} needs held-out data: add --eval_data "
            "(a regenerated .jsonl, as --data)."
        )
    generation = generation_settings(draft_args.data)
    if (generation or {}).get("responses") == "kept" and not training_args.soft_targets:
        raise ValueError(
            f"{draft_args.data} holds the conversations' own answers (generate-data --keep-responses), not the "
            "target's: a draft learns the target from its soft targets over that text. Add --soft_targets K, with "
            "--features from `domino-spec cache-features --soft_targets K`."
        )
    set_seed(training_args.seed)
    target, tokenizer, dataset, eval_dataset = load_target_and_data(draft_args)
    data_summary = {**summarize(dataset), "generation": generation}
    print(json.dumps({"data": data_summary}, indent=2))
    draft = build_draft(draft_args, target, tokenizer, dataset)
    checkpoint = checkpoint_to_resume(training_args)
    if checkpoint is not None:
        check_resumable(checkpoint, draft)
    finished = checkpoint is not None and finished_at(checkpoint, training_args)
    if finished:
        problem = final_draft_problem(training_args.output_dir, checkpoint)
        if problem is None:
            print(
                f"{training_args.output_dir} already holds the draft of a finished run ({checkpoint}); raise "
                "--max_steps to train on, or --restart to start over."
            )
            return
        print(f"{checkpoint} ends the run, but {problem}: saving its draft again", file=sys.stderr)
    feature_store = None
    if draft_args.features:
        feature_store = FeatureStore(draft_args.features)
        feature_store.check(dataset, draft.config.target_layer_ids, target, training_args.soft_targets)
    pad_id = pad_token_id(tokenizer)
    trainer = DominoTrainer(
        model=draft,
        target=target,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        data_collator=DominoDataCollator(pad_id, training_args.num_anchors, feature_store),
        data_summary=data_summary,
    )
    if finished:  # not `train`: resumed in the middle of an epoch, Trainer would train one step more
        trainer.load_finished_run(checkpoint)
    else:
        trainer.train(resume_from_checkpoint=checkpoint)
        stopped_by = trainer.stop_on_signal.received
        if stopped_by is not None:
            print(
                f"{stopped_by.name}: stopped at step {trainer.state.global_step} with a checkpoint in "
                f"{training_args.output_dir}; rerun the same command to resume.",
                file=sys.stderr,
            )
            raise SystemExit(128 + stopped_by.value)
    trainer.save_model(training_args.output_dir)
    print(f"saved the draft to {training_args.output_dir}")
    if eval_dataset is not None and training_args.eval_strategy == "no":
        print(json.dumps({"eval": trainer.evaluate()}, indent=2))


def load_target_and_data(draft_args: DraftArguments):
    """`(target, tokenizer, dataset, eval_dataset)` of `train` and `cache-features`, the data checked against the
    target; `eval_dataset` is None without `--eval_data`. Paths are checked before the target loads."""
    for flag, path in (("--data", draft_args.data), ("--eval_data", draft_args.eval_data)):
        if path and not os.path.exists(path):
            raise FileNotFoundError(f"{flag} {path}: no such file (make one with `domino-spec generate-data`)")
    if draft_args.init_from:
        check_draft_folder(draft_args.init_from, "--init_from")
    target, tokenizer = load_target(draft_args.target)
    dataset = load_checked_data(draft_args.data, target, tokenizer, draft_args.max_length)
    eval_dataset = None
    if draft_args.eval_data:  # without `index`: a feature store holds the training data only
        eval_dataset = load_checked_data(draft_args.eval_data, target, tokenizer, draft_args.max_length)
        eval_dataset = eval_dataset.remove_columns("index")
    return target, tokenizer, dataset, eval_dataset


def load_checked_data(path: str, target, tokenizer, max_length: int):
    """The training examples of a regenerated .jsonl, checked to be tokenized for `target`."""
    check_regenerated_by(path, target, tokenizer)
    dataset = load_training_dataset(path, max_length=max_length)
    check_vocabulary(dataset, target.get_input_embeddings().weight.shape[0], path)
    return dataset
