"""How OpenMP's wait policy and thread count change a target's decode step and verify pass, alone and beside a busy
process: what `domino-spec` sets by default (it waits passively when the machine is already busy).

Each setting runs in fresh processes (OpenMP reads its environment once): first alone, then two at once (each the
other's busy neighbour), `--rounds` times in turn. Each process times, after a prefill of `--context` tokens, a
one-token step and a `--verify-tokens`-token pass, `--repeats` times, and reports the median. Prints a table and writes
JSON + Markdown.

    python benchmarks/threads.py --target smollm2-135m --output benchmarks/results/threads_smollm2-135m.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {  # name -> environment
    "spin (OpenMP's default)": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}


def measure(target: str, context: int, verify_tokens: int, repeats: int) -> dict[str, float]:
    """In this process: median milliseconds of a one-token step and of a `verify_tokens` pass."""
    import torch

    from domino_spec.generation import optimize_for_cpu
    from domino_spec.targets import load_target
    from domino_spec.transformers_compat import cache_keyword, new_dynamic_cache

    model, _ = load_target(target, device="cpu")
    optimize_for_cpu(model)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache, keyword = new_dynamic_cache(model.config), cache_keyword(model)
    times = {1: [], verify_tokens: []}
    with torch.no_grad():
        model(ids, use_cache=True, logits_to_keep=1, **{keyword: cache})
        for _ in range(repeats + 1):
            for tokens, runs in times.items():
                start = time.perf_counter()
                model(ids[:, :tokens], use_cache=True, output_hidden_states=True, **{keyword: cache})
                runs.append(1000 * (time.perf_counter() - start))
                cache.crop(-tokens)
    return {f"{tokens}_token_ms": statistics.median(runs[1:]) for tokens, runs in times.items()}


def run_processes(args: argparse.Namespace, environment: dict, count: int) -> list[dict]:
    """`count` processes of `measure` at once under `environment`; their results."""
    command = [
        sys.executable,
        __file__,
        "--measure",
        "--target",
        args.target,
        "--context",
        str(args.context),
        "--verify-tokens",
        str(args.verify_tokens),
        "--repeats",
        str(args.repeats),
    ]
    processes = [
        subprocess.Popen(command, env={**os.environ, **environment}, stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    return [json.loads(process.communicate()[0].strip().splitlines()[-1]) for process in processes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="what targets.load_target takes")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--verify-tokens", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="times each setting runs, in turn with the others")
    parser.add_argument("--output", type=Path, default=Path("threads.json"))
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one measuring process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.target, args.context, args.verify_tokens, args.repeats)))
        return
    samples = {name: {"alone": [], "beside a busy process": []} for name in SETTINGS}
    for _ in range(args.rounds):
        for name, environment in SETTINGS.items():
            samples[name]["alone"] += run_processes(args, environment, 1)
            samples[name]["beside a busy process"] += run_processes(args, environment, 2)
    keys = ("1_token_ms", f"{args.verify_tokens}_token_ms")
    results = {
        name: {
            mode: {key: round(statistics.median(run[key] for run in runs), 1) for key in keys}
            for mode, runs in modes.items()
        }
        for name, modes in samples.items()
    }
    lines = [
        f"# OpenMP settings: {args.target}, context {args.context}, median of {args.rounds} processes x "
        f"{args.repeats} passes",
        "",
        f"cpus: {os.cpu_count()}",
        "",
        "| setting | alone: 1 token ms | alone: verify ms | beside a busy process: 1 token ms | verify ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, modes in results.items():
        alone, busy = modes["alone"], modes["beside a busy process"]
        lines.append(f"| {name} | {alone[keys[0]]} | {alone[keys[1]]} | {busy[keys[0]]} | {busy[keys[1]]} |")
    report = "\n".join(lines) + "\n"
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"settings": vars(args) | {"output": str(args.output)}, "results": results}, indent=2) + "\n"
    )
    args.output.with_suffix(".md").write_text(report)
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
