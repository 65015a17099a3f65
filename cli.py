"""The `domino-spec` command: generate-data, cache-features, train, draft-vocab, bench, demo, export, card.

    domino-spec generate-data --target DIR --prompts FILE --output FILE
    domino-spec cache-features --target DIR --data FILE --output DIR   (optional: train --features DIR)
    domino-spec train --target DIR --data FILE --output DIR --max-steps N [--draft_vocab_size N]
    domino-spec draft-vocab DIR OUT --data FILE --size N
    domino-spec export --format sglang DIR OUT
    domino-spec card DIR [--push-to-hub REPO]
    domino-spec bench [--target DIR] [--domino DIR] [--eval-sets ...] [--limit N] [--quality [--allow-code-execution]]
                      [--batch-sizes 1,4] [--temperature 0,0.7] [--cold] [--background-load]
    domino-spec demo [--question TEXT] [--tiny]

A mistake (a missing file, bad data, a draft for another target) ends with one line naming it and the fix, status 2;
set DOMINO_SPEC_TRACEBACK=1 to see the traceback. Ctrl-C ends with status 130.

`train` accepts every `transformers.TrainingArguments` flag (parsed with `HfArgumentParser`) and
`--config recipe.yaml`, whose keys are the same flag names; flags on the command line win over the file.

Each command's parser and `main` live beside its code; this module only dispatches, importing the command's module
(and so torch) after `set_omp_wait_policy`. `generate-data` and `cache-features` are here: they join training's data
with generation's engine and CPU kernels.
"""

import argparse
import difflib
import importlib
import os
import sys

# Each command's `main(argv)`, as "module:function" of this package, imported when the command runs.
COMMANDS = {
    "generate-data": ".cli:generate_data",
    "train": ".training.train:main",
    "cache-features": ".cli:cache_features",
    "draft-vocab": ".training.draft_vocab:main",
    "bench": ".generation.bench_command:main",
    "demo": ".generation.demo:main",
    "export": ".training.export:main",
    "card": ".training.model_card:main",
}


def set_omp_wait_policy() -> None:
    """Make OpenMP threads wait passively when the machine is already busy; call before torch starts its threads.

    OpenMP threads wait for work by spinning: on an idle machine that makes a decode step ~20% faster than waiting
    passively, but beside another busy process it takes the CPU from it and a step took 3-4x as long (BENCHMARKS.md).
    What the user set wins.
    """
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ or not hasattr(os, "getloadavg"):
        return
    if os.getloadavg()[0] >= (os.cpu_count() or 1) / 2:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


# ---------------------------------------------------------------------- generate-data


def generate_data_arguments(argv: list[str]) -> argparse.Namespace:
    """The flags of `generate-data`, checked before anything loads."""
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
    parser.add_argument(
        "--keep-responses",
        action="store_true",
        help="keep each conversation's own first answer instead of regenerating it (no decoding: the draft then "
        "trains on the target's soft targets over that text, `cache-features --soft_targets K` and `train "
        "--soft_targets K`, one prefill per conversation); rewrites --output",
    )
    args = parser.parse_args(argv)
    for flag in ("max_new_tokens", "batch_size", "max_prompt_tokens"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: must be at least 1.")
    if args.temperature < 0:
        raise ValueError(f"--temperature {args.temperature}: must be 0 (greedy) or more.")
    if not os.path.exists(args.prompts):
        raise FileNotFoundError(f"--prompts {args.prompts}: no such file or folder")
    return args


def generate_data(argv: list[str]) -> None:
    """`domino-spec generate-data`: regenerate the prompts' responses with the target (training's data, decoded by
    generation's engine; neither package imports the other, so the two meet here)."""
    import functools

    from .generation.engine import speculative_generate
    from .targets import load_target
    from .training.data import kept_responses, load_prompts, regenerate_responses

    args = generate_data_arguments(argv)
    thinking = None if args.thinking is None else args.thinking == "on"
    if args.keep_responses:
        target, tokenizer = load_target(args.target)
        written = kept_responses(
            target,
            tokenizer,
            args.prompts,
            args.output,
            max_new_tokens=args.max_new_tokens,
            thinking=thinking,
            max_prompt_tokens=args.max_prompt_tokens,
            limit=args.limit,
        )
        print(f"wrote {written} conversations with their own answers to {args.output}")
        return
    prompts = load_prompts(args.prompts, limit=args.limit)  # before the target: a bad file fails without the wait
    target, tokenizer = load_target(args.target)
    prepare_for_cpu(target, "batched passes")  # a batch of rows per step: row counts eager nn.Linear is slow at
    existed = os.path.exists(args.output)
    try:
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
    except BaseException:  # a run that wrote nothing leaves no empty --output behind (a resumed one keeps its file)
        if not existed and os.path.isfile(args.output) and os.path.getsize(args.output) == 0:
            os.remove(args.output)
        raise
    print(f"{len(prompts)} unique prompts; wrote {written} new responses to {args.output}")


def cache_features(argv: list[str]) -> None:
    """`domino-spec cache-features`, its target's prefills run with the CPU kernels `optimize_for_cpu` plans (15-20%
    faster at a conversation's rows than eager `nn.Linear` on CPUs measured; the features are the same to fp16)."""
    from .training.cache_features import main

    main(argv, prepare_target=lambda target: prepare_for_cpu(target, "long prefills"))


def prepare_for_cpu(target, passes: str) -> None:
    """Plan the kernels of a CPU `target` for `passes` (`optimize_for_cpu`), saying so; a target elsewhere stays."""
    from .generation.cpu import optimize_for_cpu

    if target.device.type == "cpu":
        print(f"preparing the target for {passes} on this CPU (optimize_for_cpu)", flush=True)
        optimize_for_cpu(target)


# ---------------------------------------------------------------------- entry point


def command_main(name: str):
    """The `main(argv)` of command `name`, its module imported now."""
    module, function = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module, __package__), function)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        close = difflib.get_close_matches(argv[0], COMMANDS, 1)
        print(
            f"domino-spec: unknown command {argv[0]!r}"
            + (f" (did you mean {close[0]}?)" if close else "")
            + f"; commands: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        print(f"commands: {', '.join(COMMANDS)}")
        raise SystemExit(0 if argv else 2)
    set_omp_wait_policy()
    command_main(argv[0])(argv[1:])


def is_mistake(error: Exception) -> bool:
    """Whether `run` reports `error` in one line: a missing file or asset, or a bad value."""
    from .assets import MissingAssetError  # imports torch: not before a command has run

    return isinstance(error, (ValueError, FileNotFoundError, MissingAssetError))


def run() -> None:
    """The console script: `main`, with a mistake (missing file, bad data, a draft for another target) reported on
    one line rather than as a traceback, and Ctrl-C ending quietly with status 130."""
    command = f"domino-spec {sys.argv[1]}" if len(sys.argv) > 1 else "domino-spec"
    try:
        main()
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as error:
        if not is_mistake(error) or os.environ.get("DOMINO_SPEC_TRACEBACK", "").lower() in ("1", "true", "yes"):
            raise
        print(f"{command}: error: {error} (DOMINO_SPEC_TRACEBACK=1 shows where)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    run()
