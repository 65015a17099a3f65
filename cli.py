"""The `domino-spec` command: generate-data, cache-features, train, draft-vocab, bench, demo, export, card.

    domino-spec generate-data --target DIR --prompts FILE --output FILE
    domino-spec cache-features --target DIR --data FILE --output DIR   (optional: train --features DIR)
    domino-spec train --target DIR --data FILE --output DIR --max-steps N [--draft_vocab_size N]
    domino-spec draft-vocab DIR OUT --data FILE --size N
    domino-spec export --format sglang DIR OUT
    domino-spec card DIR [--push-to-hub REPO]
    domino-spec bench [--target DIR] [--domino DIR] [--eval-sets ...] [--limit N] [--quality [--allow-code-execution]]
    domino-spec demo [--question TEXT] [--tiny]

A mistake (a missing file, bad data, a draft for another target) ends with one line naming it and the fix, status 2;
set DOMINO_SPEC_TRACEBACK=1 to see the traceback. Ctrl-C ends with status 130.

`train` accepts every `transformers.TrainingArguments` flag (parsed with `HfArgumentParser`) and
`--config recipe.yaml`, whose keys are the same flag names; flags on the command line win over the file.
"""

import os

# OpenMP threads wait for work by spinning: on an idle machine that makes a decode step ~20% faster than waiting
# passively, but beside another busy process it takes the CPU from it and a step took 3-4x as long (BENCHMARKS.md).
# So wait passively when the machine is already busy; set before torch starts its threads; what the user set wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ and hasattr(os, "getloadavg"):
    if os.getloadavg()[0] >= (os.cpu_count() or 1) / 2:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import argparse  # noqa: E402
import difflib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import HfArgumentParser, set_seed  # noqa: E402

from .assets import MissingAssetError
from .configuration_domino import DominoConfig
from .drafting import DRAFT_LENGTHS, DraftingOptions
from .modeling_domino import DominoDraftModel
from .targets import load_target, pad_token_id
from .training.checkpoints import check_resumable, checkpoint_to_resume, final_draft_problem, finished_at
from .training.export import main as export_main
from .training.model_card import check_draft_folder, draft_config
from .training.model_card import main as card_main
from .training.trainer import DominoTrainingArguments

# The published Qwen3-8B draft has 5 layers for a 36-layer target; `train` scales this to other targets.
PUBLISHED_DRAFT_LAYERS, PUBLISHED_TARGET_LAYERS = 5, 36


# ---------------------------------------------------------------------- generate-data


def generate_data(argv: list[str]) -> None:
    from .generation.cpu import optimize_for_cpu
    from .generation.engine import speculative_generate
    from .training.data import load_prompts, regenerate_responses

    parser = argparse.ArgumentParser(
        prog="domino-spec generate-data",
        description="Regenerate responses to prompts with the target (resumable: rerun to continue).",
    )
    parser.add_argument("--target", required=True, help="target model folder or asset name")
    parser.add_argument("--prompts", required=True, help=".jsonl (prompt/messages), ShareGPT .json, or datasets folder")
    parser.add_argument("--output", required=True, help="output .jsonl; appended to, finished ids are skipped")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--thinking", choices=["on", "off"], default=None, help="Qwen3 chat-template thinking mode")
    parser.add_argument("--limit", type=int, default=None, help="use the first N unique prompts")
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not os.path.exists(args.prompts):
        raise FileNotFoundError(f"--prompts {args.prompts}: no such file or folder")
    prompts = load_prompts(args.prompts, limit=args.limit)  # before the target: a bad file fails without the wait
    target, tokenizer = load_target(args.target)
    if target.device.type == "cpu":  # a batch of rows per step: row counts eager nn.Linear is slow at
        print("preparing the target for batched passes on this CPU (optimize_for_cpu)", flush=True)
        optimize_for_cpu(target)
    thinking = None if args.thinking is None else args.thinking == "on"
    written = regenerate_responses(
        target,
        tokenizer,
        prompts,
        args.output,
        functools.partial(speculative_generate, draft=None),  # plain decoding, a row leaving the batch at its EOS
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        thinking=thinking,
        max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed,
    )
    print(f"{len(prompts)} unique prompts; wrote {written} new responses to {args.output}")


# ---------------------------------------------------------------------- train


@dataclass
class DraftArguments:
    """What to train: the target, the data and the draft's shape."""

    target: str = field(metadata={"help": "Target model folder or asset name."})
    data: str = field(metadata={"help": "Regenerated .jsonl from `domino-spec generate-data`."})
    draft_layers: int | None = field(
        default=None, metadata={"help": "Draft decoder layers (default: the published 5-for-36 ratio)."}
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
    init_from: str | None = field(default=None, metadata={"help": "Start from this draft folder instead of random."})
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
    from .training.data import draft_vocabulary

    shape = draft_shape(draft_args)
    if draft_args.init_from:
        draft = DominoDraftModel.from_pretrained(draft_args.init_from)
        conflicts = [f"{name}={value} (the draft has {getattr(draft.config, name)})"
                     for name, value in shape.items() if getattr(draft.config, name) != value]  # fmt: skip
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
    draft = DominoDraftModel.from_target(target, tokenizer=tokenizer, **shape)
    if draft_args.init_from_target_layers:
        num_target_layers = target.config.get_text_config().num_hidden_layers
        draft.copy_target_layers(target, list(range(num_target_layers - len(draft.layers), num_target_layers)))
    return draft.float()


def parse_train_arguments(
    argv: list[str], prog: str = "domino-spec train", description: str | None = None
) -> tuple[DraftArguments, DominoTrainingArguments]:
    description = description or (
        "Train a Domino draft for a target on regenerated data: every transformers TrainingArguments flag works, "
        "--config recipe.yaml takes the same flags (the command line wins), and rerunning resumes."
    )
    parser = HfArgumentParser((DraftArguments, DominoTrainingArguments), prog=prog, description=description)
    parser.add_argument("--config", default=None, help="YAML file of flag values; command-line flags win")
    parser.add_argument("--output", dest="output_dir", default=argparse.SUPPRESS, help="alias of --output_dir")
    # Without a GPU, train on the CPU explicitly: multi-process CPU runs (accelerate launch --cpu) need it.
    parser.set_defaults(use_cpu=not torch.cuda.is_available())
    config_flag = argparse.ArgumentParser(add_help=False)
    config_flag.add_argument("--config", default=None)
    known, _ = config_flag.parse_known_args(argv)
    if known.config:
        if not os.path.isfile(known.config):
            raise FileNotFoundError(f"--config {known.config}: no such file")
        with open(known.config, encoding="utf-8") as file:
            values = yaml.safe_load(file) or {}
        if "output" in values:  # the alias of output_dir, as on the command line
            values["output_dir"] = values.pop("output")
        if isinstance(values.get("target_layer_ids"), list):
            values["target_layer_ids"] = ",".join(str(layer) for layer in values["target_layer_ids"])
        flags = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - flags)
        if unknown:
            hints = [f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, flags, 1)) else key
                     for key in unknown]  # fmt: skip
            raise ValueError(f"{known.config}: unknown keys {', '.join(hints)}; keys are the flag names of `train`.")
        parser.set_defaults(**values)
        for action in parser._actions:  # a value from the file satisfies a required flag
            if action.dest in values:
                action.required = False
    draft_args, training_args, _ = parser.parse_args_into_dataclasses(args=argv)
    return draft_args, training_args


def train(argv: list[str]) -> None:
    from .training.collator import DominoDataCollator
    from .training.data import generation_settings, summarize
    from .training.features import FeatureStore
    from .training.trainer import DominoTrainer

    draft_args, training_args = parse_train_arguments(argv)
    if training_args.eval_strategy != "no" and not draft_args.eval_data:
        raise ValueError(f"--eval_strategy {training_args.eval_strategy.value} needs held-out data: add --eval_data "
                         "(a regenerated .jsonl, as --data).")  # fmt: skip
    set_seed(training_args.seed)
    target, tokenizer, dataset, eval_dataset = load_target_and_data(draft_args)
    data_summary = {**summarize(dataset), "generation": generation_settings(draft_args.data)}
    print(json.dumps({"data": data_summary}, indent=2))
    draft = build_draft(draft_args, target, tokenizer, dataset)
    checkpoint = checkpoint_to_resume(training_args)
    if checkpoint is not None:
        check_resumable(checkpoint, draft)
    finished = checkpoint is not None and finished_at(checkpoint, training_args)
    if finished:
        problem = final_draft_problem(training_args.output_dir, checkpoint)
        if problem is None:
            print(f"{training_args.output_dir} already holds the draft of a finished run ({checkpoint}); raise "
                  "--max_steps to train on, or --restart to start over.")  # fmt: skip
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
            print(f"{stopped_by.name}: stopped at step {trainer.state.global_step} with a checkpoint in "
                  f"{training_args.output_dir}; rerun the same command to resume.", file=sys.stderr)  # fmt: skip
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
    from .training.data import check_regenerated_by, check_vocabulary, load_training_dataset

    check_regenerated_by(path, target, tokenizer)
    dataset = load_training_dataset(path, max_length=max_length)
    check_vocabulary(dataset, target.get_input_embeddings().weight.shape[0], path)
    return dataset


def draft_vocab(argv: list[str]) -> None:
    """Give an existing draft a draft vocabulary: the most frequent tokens of regenerated data's responses."""
    from .training.data import draft_vocabulary, load_training_dataset

    parser = argparse.ArgumentParser(
        prog="domino-spec draft-vocab",
        description="Write a copy of a draft that proposes only the N most frequent tokens of regenerated data: "
        "the backbone as it is, the head's residual rows of those tokens (cheaper drafting; outputs unchanged).",
    )
    parser.add_argument("draft_dir", metavar="DIR", help="a draft folder")
    parser.add_argument("output_dir", metavar="OUT", help="folder to write the new draft to")
    parser.add_argument("--data", required=True, help="regenerated .jsonl (domino-spec generate-data) to count")
    parser.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary, e.g. 8192")
    args = parser.parse_args(argv)
    check_draft_folder(args.draft_dir)
    if not os.path.isfile(args.data):
        raise FileNotFoundError(f"--data {args.data}: no such file (make one with `domino-spec generate-data`)")
    draft = DominoDraftModel.from_pretrained(args.draft_dir)
    dataset = load_training_dataset(args.data)
    token_ids = draft_vocabulary(dataset, args.size, draft.config.vocab_size)
    draft.with_draft_vocab(token_ids).save_pretrained(args.output_dir)
    print(f"wrote a draft of {args.size} draft tokens (of {draft.config.vocab_size}) to {args.output_dir}")


def cache_features(argv: list[str]) -> None:
    """Compute the target features of a training set once, for `train --features DIR` (resumable).

    Takes the same flags and `--config` as `train` (the draft's tapped layers decide what is stored); `--output` is
    the store's folder.
    """
    from .training.features import FeatureStore

    draft_args, training_args = parse_train_arguments(
        argv, prog="domino-spec cache-features", description=(
            "Compute the target features of a training set once, for `train --features DIR`; takes train's flags "
            "(the draft's shape decides the tapped layers), --output is the store's folder; rerun to resume."
        )
    )  # fmt: skip
    target, tokenizer, dataset, _ = load_target_and_data(draft_args)
    if draft_args.init_from:
        layer_ids = DominoConfig.from_pretrained(draft_args.init_from).target_layer_ids
    else:  # the config alone: no draft weights to build
        shape = fresh_draft_shape(draft_args, target)
        layer_ids = DominoDraftModel.config_for_target(target, tokenizer=tokenizer, **shape).target_layer_ids
    store = FeatureStore.build(target, dataset, layer_ids, training_args.output_dir, training_args.soft_targets)
    soft_targets = f", soft targets of {store.top_k} tokens" if store.top_k else ""
    print(f"features of {len(store)} examples (target layers {layer_ids}{soft_targets}) in {training_args.output_dir}")


# ---------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "generate-data": generate_data,
        "train": train,
        "cache-features": cache_features,
        "draft-vocab": draft_vocab,
        "bench": bench,
        "demo": demo,
        "export": export_main,
        "card": card_main,
    }
    if argv and argv[0] not in commands and argv[0] not in ("-h", "--help"):
        close = difflib.get_close_matches(argv[0], commands, 1)
        print(f"domino-spec: unknown command {argv[0]!r}" + (f" (did you mean {close[0]}?)" if close else "")
              + f"; commands: {', '.join(commands)}", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    if not argv or argv[0] not in commands:
        print(__doc__)
        print(f"commands: {', '.join(commands)}")
        raise SystemExit(0 if argv else 2)
    commands[argv[0]](argv[1:])


def run() -> None:
    """The console script: `main`, with a mistake (missing file, bad data, a draft for another target) reported on
    one line rather than as a traceback, and Ctrl-C ending quietly with status 130."""
    command = f"domino-spec {sys.argv[1]}" if len(sys.argv) > 1 else "domino-spec"
    try:
        main()
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except (ValueError, FileNotFoundError, MissingAssetError) as error:
        if os.environ.get("DOMINO_SPEC_TRACEBACK", "").lower() in ("1", "true", "yes"):
            raise
        print(f"{command}: error: {error} (DOMINO_SPEC_TRACEBACK=1 shows where)", file=sys.stderr)
        raise SystemExit(2) from None


def demo(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="domino-spec demo", description="Stream a chat answer from SmolLM2-135M with the shipped Domino draft."
    )
    parser.add_argument("--question", default=None, help="the user turn (default: a GSM8K-style question)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="random tiny models instead: needs no assets")
    args = parser.parse_args(argv)
    from .generation import demo as demos

    if args.tiny:
        demos.run_tiny_demo()
    else:
        demos.run_demo(question=args.question or demos.DEFAULT_QUESTION, max_new_tokens=args.max_new_tokens)


def bench(argv: list[str]) -> None:
    from .generation.bench import DRAFT_OF, METHODS, run_bench, write_results
    from .generation.cpu import optimize_for_cpu
    from .generation.eval_sets import EVAL_SETS, eval_prompts

    parser = argparse.ArgumentParser(prog="domino-spec bench", description="Evaluation sets x decoding methods, greedy.")
    parser.add_argument("--target", default="smollm2-135m", help="target model folder or asset name")
    parser.add_argument("--domino", default=None, help="Domino draft folder (default: the shipped SmolLM2 draft)")
    parser.add_argument("--dflash", default=None, help="DFlash-only draft folder (head off), for the dflash method")
    parser.add_argument("--eval-sets", default=",".join(EVAL_SETS), help=f"comma-separated from {EVAL_SETS}")
    parser.add_argument(
        "--methods", default=",".join(name for name in METHODS if name != "plain-eager"),
        help=f"comma-separated from {', '.join(METHODS)}; the plain decodings a method is measured against (plain, "
        "plain-native for the native engine's methods, plain-eager on a prepared CPU target) are added when missing",
    )  # fmt: skip
    parser.add_argument(
        "--no-cpu-optimization", action="store_true",
        help="time eager nn.Linear on CPU instead of preparing the target and drafts with optimize_for_cpu",
    )  # fmt: skip
    parser.add_argument(
        "--draft-length", choices=DRAFT_LENGTHS, default="auto",
        help="drafts verified per round: cost (as many as pay, the cost model measured here), full (every draft), "
        "auto (cost on CPU, full elsewhere)",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-lookup", type=int, default=DraftingOptions.prompt_lookup, metavar="N",
        help="with a cost-aware draft length, verify the tokens that followed an earlier occurrence of the last N "
        "tokens (or fewer) instead of drafting, in rounds where that pays; 0: every round drafts",
    )  # fmt: skip
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each set (quick runs)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--quality", action="store_true", help="also score every method's outputs with evaluate")
    parser.add_argument(
        "--allow-code-execution", action="store_true",
        help="let --quality score HumanEval by running the model-written programs here, sandboxed (README: what the "
        "sandbox isolates; it is not a security boundary). HF_ALLOW_CODE_EVAL=1 allows it too",
    )  # fmt: skip
    parser.add_argument("--output", default="runs/bench", help="folder for bench_results.{json,md} and the figure")
    args = parser.parse_args(argv)
    from .generation.demo import SHIPPED_DRAFT

    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    eval_sets = [name for name in args.eval_sets.split(",") if name]
    if args.quality:  # before any model loads or decodes
        from .generation.quality import require_code_execution

        require_code_execution(args.allow_code_execution, eval_sets)
    needed = {DRAFT_OF[method] for method in methods if method in DRAFT_OF}
    folders = {name: folder for name, folder in (("domino", args.domino or SHIPPED_DRAFT), ("dflash", args.dflash))
               if folder and name in needed}  # fmt: skip
    for name, folder in folders.items():
        check_draft_folder(folder, f"--{name}")
    if "dflash" in folders and draft_config(folders["dflash"])[0].use_domino_head:
        raise ValueError(f"--dflash {args.dflash} has a Domino head: the dflash method measures a backbone-only draft "
                         "(train one with --use_domino_head false).")  # fmt: skip
    target, tokenizer = load_target(args.target)
    drafts = {name: DominoDraftModel.from_pretrained(folder, dtype=target.dtype).to(target.device).eval()
              for name, folder in folders.items()}  # fmt: skip
    for draft in drafts.values():
        draft.drafting_options = DraftingOptions(draft_length=args.draft_length, prompt_lookup=args.prompt_lookup)
    optimization = None
    if target.device.type == "cpu" and not args.no_cpu_optimization:
        print("preparing the target and drafts for multi-token passes on this CPU (optimize_for_cpu)", flush=True)
        optimization = optimize_for_cpu(target, *drafts.values())
    prompts = {name: eval_prompts(name, args.limit) for name in eval_sets}
    report = run_bench(target, tokenizer, drafts, prompts, methods, args.max_new_tokens, optimization=optimization)
    if args.quality:
        from .generation.quality import score_report

        report["quality"] = score_report(report, allow_code_execution=args.allow_code_execution)
    paths = write_results(report, args.output)
    with open(paths["results.md"], encoding="utf-8") as file:
        print(file.read())
    print("wrote " + ", ".join(paths.values()))


if __name__ == "__main__":
    run()
