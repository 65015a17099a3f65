"""Ship a trained draft: bf16 safetensors, config, model code and model card in `checkpoints/domino-smollm2-135m`.

python recipes/smollm2-135m/ship.py runs/smollm2/domino checkpoints/domino-smollm2-135m [--bench FILE]
"""

import argparse
import json
import os
import shutil
import tempfile

import torch

from domino_spec import modeling_domino
from domino_spec.assets import TARGETS
from domino_spec.published_format import load_draft
from domino_spec.training.model_card import TRAINING_SUMMARY
from domino_spec.training.model_card import main as write_card

MAX_BYTES = 30 * 2**20  # the repository's budget for an embedded checkpoint


def link_code_files(folder: str) -> None:
    """Replace the model code `save_pretrained` copied into `folder` by symbolic links to the repository's root files:
    the shipped checkpoint runs the code of the checkout it is in, and git holds no second copy of it."""
    root = os.path.dirname(os.path.abspath(modeling_domino.__file__))
    for name in os.listdir(folder):
        if name.endswith(".py"):
            os.remove(os.path.join(folder, name))
            os.symlink(os.path.relpath(os.path.join(root, name), os.path.abspath(folder)), os.path.join(folder, name))


def record_curve(folder: str, curve_path: str, variant: str) -> None:
    """Add the last point of `variant`'s curve in `curve_path` (steps, examples and CPU-hours counted across sessions)
    to the training summary in `folder`, for its model card."""
    with open(curve_path, encoding="utf-8") as file:
        points = json.load(file)["curves"].get(variant)
    if not points:
        raise SystemExit(f"{curve_path} has no curve {variant!r}: name the trained folder like its variant")
    last = max(points.values(), key=lambda point: point["step"])
    path = os.path.join(folder, TRAINING_SUMMARY)
    summary = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            summary = json.load(file)
    summary["curve"] = {key: last[key] for key in ("step", "examples", "cpu_hours")} | {"results": curve_path}
    with open(path, "w", encoding="utf-8") as file:
        json.dump(summary, file, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trained", help="the folder `domino-spec train` wrote")
    parser.add_argument("output", help="the shipped checkpoint folder (replaced)")
    parser.add_argument("--bench", default=None, help="bench_results.json to show on the card")
    parser.add_argument(
        "--curve",
        default=None,
        help="the learning curve JSON (benchmarks/learning_curve.py) that trained it: the card states the steps, "
        "examples and CPU-hours of every session, from the last point of the curve named like the trained folder",
    )
    args = parser.parse_args()
    draft = load_draft(args.trained, dtype=torch.bfloat16)
    draft.config.target_model_name = TARGETS["smollm2-135m"].hub_id  # the card's base_model
    shutil.rmtree(args.output, ignore_errors=True)
    draft.save_pretrained(args.output)
    link_code_files(args.output)
    summary = os.path.join(args.trained, TRAINING_SUMMARY)
    if os.path.exists(summary):
        shutil.copy(summary, args.output)
    if args.curve:
        record_curve(args.output, args.curve, os.path.basename(os.path.normpath(args.trained)))
    card_args = [args.output, "--datasets", "anon8231489123/ShareGPT_Vicuna_unfiltered"]
    if args.bench:  # the table and its context, without the generated texts
        with open(args.bench, encoding="utf-8") as file:
            bench = {k: v for k, v in json.load(file).items() if k not in ("texts", "references")}
        trimmed = os.path.join(tempfile.mkdtemp(), "bench_results.json")
        with open(trimmed, "w", encoding="utf-8") as file:
            json.dump(bench, file, indent=1)
        card_args += ["--bench", trimmed]
    write_card(card_args)
    weights = os.path.getsize(os.path.join(args.output, "model.safetensors"))
    if weights > MAX_BYTES:
        mib = weights / 2**20
        raise SystemExit(f"{args.output}/model.safetensors is {mib:.1f} MiB, over the {MAX_BYTES // 2**20} MiB budget")
    print(f"shipped {args.trained} -> {args.output} ({weights / 2**20:.1f} MiB bf16)")


if __name__ == "__main__":
    main()
