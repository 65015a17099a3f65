"""Training throughput of a Domino draft: sequence tokens per second through DominoTrainer.

Runs a few optimizer steps on random sequences (the cost does not depend on the tokens) with the target's features
computed online, and again with features precomputed into a FeatureStore (the target pass moved out of the step),
and with the store for each draft vocabulary size of `--draft-vocab-sizes` (the loss's logits cover only those
tokens). Prints a table and writes JSON + Markdown.

    python benchmarks/train_throughput.py --target tiny
    python benchmarks/train_throughput.py --target smollm2-135m --draft-layers 1 --block-size 8 --num-anchors 32 \
        --length 384 --steps 6

`--target` is what `targets.load_target` takes (a local model folder, an asset name or a shape preset), loaded in
float32 on the device the Trainer uses.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
import transformers

from domino_spec.draft_building import from_target
from domino_spec.generation.engine import DeviceClock
from domino_spec.targets import SHAPE_PRESETS, default_device, load_target
from domino_spec.training.collator import DominoDataCollator
from domino_spec.training.features import FeatureStore
from domino_spec.training.trainer import DominoTrainer, DominoTrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))  # draft_cost.py sits beside this file
import draft_cost  # noqa: E402


def random_dataset(vocab_size: int, count: int, length: int, prompt_length: int, seed: int) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(seed)
    rows = [
        {
            "input_ids": torch.randint(0, vocab_size, (length,), generator=generator).tolist(),
            "loss_mask": [0] * prompt_length + [1] * (length - prompt_length),
            "index": index,
        }
        for index in range(count)
    ]
    return datasets.Dataset.from_list(rows)


def time_training(target, dataset, args, feature_store: FeatureStore | None, draft_vocab_size: int = 0) -> float:
    """Seconds per optimizer step, after one untimed warmup step; a draft vocabulary of its first ids, when sized."""
    torch.manual_seed(args.seed)
    draft_vocab = torch.arange(draft_vocab_size) if draft_vocab_size else None
    draft = from_target(
        target, num_hidden_layers=args.draft_layers, block_size=args.block_size, draft_vocab=draft_vocab
    )
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = DominoTrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps + 1,
            num_anchors=args.num_anchors,
            save_strategy="no",
            report_to="none",
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
            logging_steps=10**6,
        )
        collator = DominoDataCollator(pad_token_id=0, num_anchors=args.num_anchors, feature_store=feature_store)
        trainer = DominoTrainer(draft, target, training_args, train_dataset=dataset, data_collator=collator)
        step_starts = []
        trainer.add_callback(_StepClock(step_starts, DeviceClock(trainer.args.device)))
        trainer.train()
    return (step_starts[-1] - step_starts[0]) / (len(step_starts) - 1)


class _StepClock(transformers.TrainerCallback):
    def __init__(self, times: list[float], clock: DeviceClock):
        self.times, self.clock = times, clock  # on a GPU a step returns before its kernels finish: the clock waits

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(self.clock())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target", default="tiny", help=f"a local model folder, an asset, or one of {sorted(SHAPE_PRESETS)}"
    )
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-anchors", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument(
        "--draft-vocab-sizes",
        type=int,
        nargs="*",
        default=[],
        help="also time the feature-store steps with these draft vocabulary sizes",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("train_throughput.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = default_device()  # where the Trainer runs
    target, _ = load_target(args.target, dtype=torch.float32, device=device)
    vocab_size = target.get_input_embeddings().weight.shape[0]
    dataset = random_dataset(vocab_size, args.batch_size * (args.steps + 1), args.length, args.length // 4, args.seed)
    tokens_per_step = args.batch_size * args.length

    online = time_training(target, dataset, args, None)
    with tempfile.TemporaryDirectory() as store_dir:
        layer_ids = from_target(target, num_hidden_layers=args.draft_layers).config.target_layer_ids
        start = time.perf_counter()
        store = FeatureStore.build(target, dataset, layer_ids, store_dir)
        feature_seconds = (time.perf_counter() - start) / len(dataset)
        stored = time_training(target, dataset, args, store)
        by_vocab = {size: time_training(target, dataset, args, store, size) for size in args.draft_vocab_sizes}
    rows = {
        "online features": {"seconds_per_step": online, "tokens_per_s": tokens_per_step / online},
        "feature store": {"seconds_per_step": stored, "tokens_per_s": tokens_per_step / stored},
        **{
            f"feature store, draft vocabulary {size}": {
                "seconds_per_step": seconds,
                "tokens_per_s": tokens_per_step / seconds,
            }
            for size, seconds in by_vocab.items()
        },
        "feature store build (per sequence)": {
            "seconds_per_step": feature_seconds,
            "tokens_per_s": args.length / feature_seconds,
        },
    }
    environment = draft_cost.environment(device)
    lines = [
        f"# Training throughput: {args.target}, {args.draft_layers} draft layer(s), block {args.block_size}, "
        f"{args.num_anchors} anchors, batch {args.batch_size} x {args.length} tokens",
        "",
        draft_cost.environment_line(environment),
        "",
        "| mode | seconds per step | sequence tokens/s |",
        "|---|---:|---:|",
        *(f"| {mode} | {row['seconds_per_step']:.3f} | {row['tokens_per_s']:.1f} |" for mode, row in rows.items()),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    settings = vars(args) | {"output": str(args.output)}
    draft_cost.write_results({"settings": settings, "environment": environment, "results": rows}, report, args.output)
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
