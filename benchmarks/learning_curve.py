"""Learning curves of draft recipes: held-out acceptance against training examples and CPU-hours.

Each variant (flags of `domino-spec train` on top of `--config`) trains once, with a checkpoint every `--eval-every`
steps; every checkpoint is then scored twice:

- acceptance proxy: the training loss's metrics on held-out regenerated data (`eval_acceptance_final`: 1 + the run
  of leading slots whose argmax is the target's token, from `DominoTrainer.evaluate`, anchors fixed by the seed);
- tau: the mean acceptance length of the real engine (`speculative_generate`, greedy, every draft verified) on the
  first `--tau-prompts` prompts of each bench set, `--tau-tokens` new tokens each.

The x axes are the training examples seen and the CPU-hours the training process spent to reach the checkpoint (its
wall time, read from the checkpoint's files, times its torch threads; a rerun that resumes an interrupted training
does not count the time since the checkpoint it resumes from), plus, with `--label-cpu-hours`, what labelling
the variant's data cost (regenerated responses against cheaper labels, at equal cost). Every variant reads the same
data in the same order with the same seed (a variant's own `--data` flag replaces it). `--parallel` trains the
variants at once, the cores split between them: on a small CPU a step's small matrices gain little from a second
thread, so this draws more curves per hour. Rerunning skips the training and scoring already done. Prints a table
and writes the results (JSON), a Markdown table and a figure beside `--output`.

A curve goes on across sessions: with `--continues` the results of the session whose drafts a variant starts from
(`--init_from` in its flags), that variant's steps, examples and CPU-hours count on from the last point of its
curve there, and its figure and table show every earlier session's points first; a variant trained from scratch
counts from zero.

    python benchmarks/learning_curve.py --config recipes/smollm2-135m/train.yaml --data runs/smollm2/data.jsonl \\
        --features runs/smollm2/features --eval-data runs/smollm2/held_out.jsonl --steps 3000 --eval-every 500 \\
        --variant "shipped=" --variant "vocab8k=--draft_vocab_size 8192" --runs runs/curves \\
        --output runs/curves/learning_curve.json
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from domino_spec import DraftingOptions
from domino_spec.generation import speculative_generate
from domino_spec.generation.eval_sets import EVAL_SETS, eval_prompts
from domino_spec.published_format import load_draft
from domino_spec.targets import eos_token_ids, load_target, pad_token_id, prompt_token_ids
from domino_spec.training.collator import DominoDataCollator
from domino_spec.training.train import load_checked_data, parse_train_arguments
from domino_spec.training.trainer import DominoTrainer

STARTED = "started.json"  # in a variant's run folder: when its training began and resumed, to time its checkpoints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the recipe YAML every variant starts from")
    parser.add_argument("--data", required=True, help="regenerated training data (.jsonl)")
    parser.add_argument("--features", default=None, help="a feature store of --data (domino-spec cache-features)")
    parser.add_argument("--eval-data", required=True, help="held-out regenerated data (.jsonl) for the proxy")
    parser.add_argument(
        "--variant",
        action="append",
        required=True,
        metavar="NAME=FLAGS",
        help="a curve: its name and the train flags it adds (repeatable)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        required=True,
        help="training steps of every variant (one with its own --max_steps flag takes those)",
    )
    parser.add_argument("--eval-every", type=int, required=True, help="steps between scored checkpoints")
    parser.add_argument("--tau-prompts", type=int, default=3, help="prompts of each bench set for tau")
    parser.add_argument("--tau-tokens", type=int, default=128, help="new tokens per prompt for tau")
    parser.add_argument("--runs", default="runs/curves", help="folder of the variants' training runs")
    parser.add_argument(
        "--score-only",
        action="store_true",
        help="score the checkpoints the variants' runs hold, training nothing (an unfinished run)",
    )
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="train every variant at once, on an equal share of the cores each, then score them",
    )
    parser.add_argument("--output", type=Path, required=True, help="results JSON (.md and .png beside it)")
    parser.add_argument(
        "--continues",
        type=Path,
        default=None,
        help="the results JSON of the session the --init_from variants go on from",
    )
    parser.add_argument(
        "--continues-curve",
        action="append",
        default=[],
        metavar="NAME=CURVE",
        help="the curve in --continues that variant NAME goes on from, where its draft is another curve's (a "
        "DFlash-only twin started from the Domino draft's backbone: dflash=domino; repeatable)",
    )
    parser.add_argument(
        "--label-cpu-hours",
        action="append",
        default=[],
        metavar="NAME=HOURS",
        help="CPU-hours spent labelling the variant's data (regenerating it, a soft-target pass), counted into its "
        "CPU-hours from step 0, so variants compare at equal cost (repeatable)",
    )
    args = parser.parse_args(argv)
    args.variant = dict(variant.split("=", 1) for variant in args.variant)
    try:
        args.label_cpu_hours = {name: float(hours) for name, hours in (v.split("=", 1) for v in args.label_cpu_hours)}
    except ValueError:
        parser.error("--label-cpu-hours takes NAME=HOURS, e.g. regenerated=1.16")
    if unknown := set(args.label_cpu_hours) - set(args.variant):
        parser.error(f"--label-cpu-hours names no --variant: {', '.join(sorted(unknown))}")
    args.continues_curve = dict(pair.split("=", 1) for pair in args.continues_curve)
    if unknown := set(args.continues_curve) - set(args.variant):
        parser.error(f"--continues-curve names no --variant: {', '.join(sorted(unknown))}")
    return args


def train_flags(args: argparse.Namespace, name: str) -> list[str]:
    flags = ["--config", args.config, "--data", args.data, "--output", os.path.join(args.runs, name)]
    flags += ["--max_steps", str(args.steps), "--save_steps", str(args.eval_every), "--save_total_limit", "100"]
    flags += ["--features", args.features] if args.features else []
    return flags + shlex.split(args.variant[name])


def warm_started(flags: str) -> bool:
    """Whether a variant's train flags start it from an earlier draft (`--init_from`)."""
    return any(flag.split("=")[0] in ("--init_from", "--init-from") for flag in shlex.split(flags))


def starts(args: argparse.Namespace) -> dict[str, dict]:
    """The point each warm-started variant goes on from: the last of its curve in `--continues`, whose step,
    examples and CPU-hours are the totals behind the draft it starts from."""
    if args.continues is None:
        return {}
    previous = json.loads(args.continues.read_text())
    scoring = ("eval_data", "tau_prompts", "tau_tokens")  # a start point scored otherwise is not on the same curve
    if changed := [key for key in scoring if previous.get("recipe", {}).get(key) != recipe(args)[key]]:
        raise SystemExit(f"--continues {args.continues} was scored with another {', '.join(changed)}: pass the same")
    found = {}
    for name, flags in args.variant.items():
        if not warm_started(flags):
            continue
        curve = args.continues_curve.get(name, name)
        if not previous["curves"].get(curve):
            raise SystemExit(
                f"--continues {args.continues} has no curve {curve!r} for the variant {name} to go on from: pass "
                f"--continues-curve {name}=CURVE, the curve of the draft it starts from"
            )
        found[name] = max(previous["curves"][curve].values(), key=lambda point: point["step"])
    return found


def counted_from(start: dict | None, step: int, examples: int, hours: float) -> dict:
    """A checkpoint's step, examples and CPU-hours counted on from `start` (None: from zero)."""
    start = start or {"step": 0, "examples": 0, "cpu_hours": 0.0}
    return {
        "step": start["step"] + step,
        "examples": start["examples"] + examples,
        "cpu_hours": round(start["cpu_hours"] + hours, 3),
    }


def start_training(args: argparse.Namespace, name: str, threads: int) -> subprocess.Popen:
    """Run (or resume) the variant's training in its own process on `threads` threads, noting when it began."""
    folder = Path(args.runs) / name
    folder.mkdir(parents=True, exist_ok=True)
    note_start(folder, threads)
    command = [sys.executable, "-m", "domino_spec.cli", "train", *train_flags(args, name)]
    print(f"+ OMP_NUM_THREADS={threads} " + shlex.join(command), flush=True)
    return subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def wait(process: subprocess.Popen) -> None:
    if process.wait() != 0:
        raise SystemExit(f"training failed (status {process.returncode}): {shlex.join(process.args)}")


def note_start(folder: Path, threads: int) -> None:
    """Note in `folder` when its training began, or, where it saved checkpoints already, when it resumed from the
    last: the time between that checkpoint and now (a session's end, the next one's start) trained nothing it kept."""
    started = folder / STARTED
    saved = saved_checkpoints(folder)
    if not started.exists():
        started.write_text(json.dumps({"time": time.time(), "threads": threads}))
    elif saved:
        record = json.loads(started.read_text())
        resume = {"time": time.time(), "from": saved_at(saved[-1])}
        started.write_text(json.dumps(record | {"resumes": record.get("resumes", []) + [resume]}))


def saved_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints in `folder` that a save finished (a kill mid-save leaves no trainer state), by step."""
    found = [path for path in folder.glob("checkpoint-*") if path.name.removeprefix("checkpoint-").isdigit()]
    found = [path for path in found if (path / "trainer_state.json").exists()]
    return sorted(found, key=lambda path: int(path.name.removeprefix("checkpoint-")))


def saved_at(checkpoint: Path) -> float:
    return (checkpoint / "trainer_state.json").stat().st_mtime


def cpu_hours(args: argparse.Namespace, name: str, checkpoint: Path) -> float:
    """Wall hours from the training's start to the save of `checkpoint`, less each stretch from a checkpoint to the
    run resuming from it, times the threads the training ran on. Pauses of a running training (SIGSTOP) count."""
    started = json.loads((Path(args.runs) / name / STARTED).read_text())
    end = saved_at(checkpoint)
    idle = sum(resume["time"] - resume["from"] for resume in started.get("resumes", []) if resume["time"] < end)
    return (end - started["time"] - idle) * started["threads"] / 3600


@torch.no_grad()
def tau(draft, target, prompts: list[torch.Tensor], eos: list[int], max_new_tokens: int) -> float:
    """Tokens committed per verify pass of the native engine, greedy, every draft verified."""
    options = DraftingOptions(draft_length="full")
    rounds = []
    for input_ids in prompts:
        output = speculative_generate(
            target, draft, input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos, options=options
        )
        rounds += output.acceptance_lengths[0]
    return sum(rounds) / len(rounds)


def proxy(args: argparse.Namespace, name: str, draft, target, tokenizer, eval_dataset) -> dict:
    """`DominoTrainer.evaluate` of the checkpoint on the held-out data: the training loss's metrics."""
    _, training_args = parse_train_arguments(train_flags(args, name) + ["--report_to", "none"])
    collator = DominoDataCollator(pad_token_id(tokenizer), training_args.num_anchors)
    trainer = DominoTrainer(
        model=draft, target=target, args=training_args, eval_dataset=eval_dataset, data_collator=collator
    )
    metrics = trainer.evaluate()
    return {
        key.removeprefix("eval_"): round(value, 4)
        for key, value in metrics.items()
        if key in ("eval_loss", "eval_acceptance_base", "eval_acceptance_final")
    }


def score(args: argparse.Namespace, results: dict, name: str) -> None:
    """Score every checkpoint of the variant `name` not scored yet, writing the results after each."""
    target, tokenizer = load_target(parse_train_arguments(train_flags(args, name))[0].target)
    eval_dataset = load_checked_data(args.eval_data, target, tokenizer, max_length=1024).remove_columns("index")
    eos = eos_token_ids(target, tokenizer)
    prompts = [
        torch.tensor([prompt_token_ids(tokenizer, item["messages"])], device=target.device)
        for set_name in EVAL_SETS
        for item in eval_prompts(set_name, args.tau_prompts)
    ]
    points = results["curves"].setdefault(name, {})
    start = results.get("starts", {}).get(name)
    labelling = results.get("label_cpu_hours", {}).get(name, 0.0)
    for checkpoint in saved_checkpoints(Path(args.runs) / name):
        if checkpoint.name in points:
            continue
        draft = load_draft(checkpoint, dtype=target.dtype).to(target.device).eval()
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        examples = state["global_step"] * state["train_batch_size"]
        points[checkpoint.name] = {
            **counted_from(start, state["global_step"], examples, labelling + cpu_hours(args, name, checkpoint)),
            "epoch": round(state["epoch"], 3),  # of this run's data
            **proxy(args, name, draft, target, tokenizer, eval_dataset),
            "tau": round(tau(draft, target, prompts, eos, args.tau_tokens), 3),
        }
        print(f"{name} {checkpoint.name}: {points[checkpoint.name]}", flush=True)
        write(args.output, results)


def curve(results: dict, name: str) -> list[dict]:
    """The points of variant `name` by step, after every earlier session's it went on from (`--continues`, followed
    back through each session's own) where those results are at hand, else after the point it went on from."""
    points = sorted(results["curves"][name].values(), key=lambda point: point["step"])
    start = results.get("starts", {}).get(name)
    if start is None:
        return points
    previous = Path(results.get("recipe", {}).get("continues", ""))
    if previous.is_file() and name in (earlier := json.loads(previous.read_text())).get("curves", {}):
        return curve(earlier, name) + points
    return [start] + points


def markdown(results: dict) -> str:
    lines = [
        "| variant | step | examples | epoch | CPU-hours | eval loss | proxy (base) | proxy (final) | tau |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in results["curves"]:
        for point in curve(results, name):
            lines.append(
                f"| {name} | {point['step']} | {point['examples']} | {point['epoch']} | {point['cpu_hours']} | "
                f"{point['loss']} | {point['acceptance_base']} | {point['acceptance_final']} | "
                f"{point['tau']} |"
            )
    flags = "\n".join(f"- {name}: `{flags or '(the recipe)'}`" for name, flags in results["variants"].items())
    if results.get("label_cpu_hours"):
        labelled = ", ".join(f"{name} {hours}" for name, hours in results["label_cpu_hours"].items())
        flags += f"\n\nCPU-hours include those spent labelling each variant's data: {labelled}."
    if results.get("starts"):
        flags += (
            f"\n\nSteps, examples and CPU-hours count on from `{results['recipe']['continues']}`, whose last "
            f"point starts the curves of {', '.join(results['starts'])}."
        )
    return f"# Learning curves\n\n{results['settings']}\n\n{flags}\n\n" + "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name in results["curves"]:
        points = curve(results, name)
        axes[0].plot([p["examples"] for p in points], [p["tau"] for p in points], marker="o", label=name)
        axes[1].plot([p["cpu_hours"] for p in points], [p["tau"] for p in points], marker="o", label=name)
        axes[2].plot([p["examples"] for p in points], [p["acceptance_final"] for p in points], marker="o", label=name)
    axes[0].set(xlabel="training examples seen", ylabel="tau (bench prompts, greedy)")
    labelled = " and labelling" if results.get("label_cpu_hours") else ""
    axes[1].set(xlabel=f"CPU-hours of training{labelled}", ylabel="tau (bench prompts, greedy)")
    axes[2].set(xlabel="training examples seen", ylabel="held-out acceptance proxy (final logits)")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(output: Path, results: dict) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1) + "\n")
    output.with_suffix(".md").write_text(markdown(results))
    plot(results, output.with_suffix(".png"))


def recipe(args: argparse.Namespace) -> dict:
    """What the scores depend on, besides each variant's flags (the scoring interval only picks the checkpoints)."""
    continues = {"continues": str(args.continues)} if args.continues else {}  # absent: earlier results still load
    return {
        "config": args.config,
        "data": args.data,
        "eval_data": args.eval_data,
        "steps": args.steps,
        "tau_prompts": args.tau_prompts,
        "tau_tokens": args.tau_tokens,
        **continues,
    }


def load_results(args: argparse.Namespace) -> dict:
    """The results `--output` holds, to add to, or fresh ones; refuses those of another recipe, data or variant
    flags, whose scores would otherwise stand for this run's."""
    if not args.output.exists():
        return {"curves": {}, "variants": {}}
    results = json.loads(args.output.read_text())
    previous = results.get("recipe")
    changed = [name for name, flags in args.variant.items() if results["variants"].get(name, flags) != flags]
    if previous != recipe(args) or changed:
        what = f"variants {', '.join(changed)} with other flags" if changed else f"another recipe ({previous})"
        raise SystemExit(f"--output {args.output} holds the curves of {what}: pass another --output, or delete it")
    return results


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results = load_results(args)
    results["variants"].update(args.variant)
    results["recipe"] = recipe(args)
    results["starts"] = starts(args)
    results["label_cpu_hours"] = args.label_cpu_hours
    results["settings"] = (
        f"Recipe `{args.config}`, data `{args.data}` (held out: `{args.eval_data}`), {args.steps} steps; tau on the "
        f"first {args.tau_prompts} prompts of each bench set, {args.tau_tokens} tokens. Machine: "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        f"{' shared by the variants trained at once' if args.parallel else ''}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}."
    )
    cores = torch.get_num_threads()
    train_all_first = args.parallel and not args.score_only
    if train_all_first:
        processes = [start_training(args, name, max(1, cores // len(args.variant))) for name in args.variant]
        for process in processes:
            wait(process)
    for name in args.variant:  # one at a time, each scored as it finishes: the first curves come early
        if not (train_all_first or args.score_only):
            wait(start_training(args, name, cores))
        score(args, results, name)
    write(args.output, results)
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
