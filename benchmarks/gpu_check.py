"""GPU check of the draft cost: is a Domino drafting round cheap next to a verify pass?

One command on one GPU (on an H200 it took 44 s, most of it compilation; results in BENCHMARKS.md):

    python benchmarks/gpu_check.py

On a lent device machine, write the results where they come back: `python benchmarks/gpu_check.py --output
$OUT/gpu_check.json`, then copy them to `benchmarks/results/`. A CPU smoke run at tiny shapes (seconds):

    python benchmarks/gpu_check.py --target tiny --device cpu --no-compile --context 64 --block-size 4

With random weights at Qwen3-8B shapes (target: 36 layers, hidden 4096, vocabulary 151936; draft: 5 layers, block 16;
bf16) and `--context` tokens in both KV caches, it times, with `draft_cost.py`'s functions: the target's decode step
and verify passes over the anchor and k drafts for k = 0..16 (`target_verify_k`; `target_verify` is the whole
block, 17 tokens), the draft's context update, backbone, greedy head loop, argmax of the base logits (what a DFlash
draft pays anyway) and whole round, eager and after `compile_drafting(draft)` (the head loop captured in a CUDA
graph), for each head candidate pool in `--head-pools` (`DraftingOptions(candidate_pool=...)`; 0: whole
vocabulary), and for each pool with the fused head step (`fuse_head_step(draft)`: one Triton kernel per
slot; CUDA with Triton only, `--no-fused` skips it). For each fixed tree budget in `--tree-nodes` (the accelerator
setting of `DraftingOptions(tree_nodes=N)`), it times growing the tree from the backbone's block (`draft_tree_N`) and
the target's verify pass over the anchor and the N nodes under the tree mask (`target_verify_tree_N`).

Each compiled or fused variant's tokens of one round are compared with those of the eager, unfused loop with the same
pool from the same state (in bf16, fused arithmetic may flip near-ties of a random-weight draft; drafts are verified,
so this never changes outputs).
It prints the speedup bound tau * t_decode / (t_draft_round + t_verify) at tau = 4, 6, 8, 10 and pass/fail against the
draft-cost targets: head loop <= 5% of a draft round, draft round <= 15% of a verify pass. With `--profile-head` it also
records where each variant's head loop spends its time: the kernels (operators on CPU) of a few calls, by device time,
so a head over its share shows whether the slots or the per-block setup (top-K, gate projection, spreading the pool's
logits) cost. The fused kernel's launch config is autotuned in the warmup runs; the eager picks land in
`fused_launch_configs`. Results (JSON + Markdown, with machine, GPU and versions) are rewritten after every stage, so
a run cut short by a timeout keeps what it measured.
"""

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))  # draft_cost.py sits beside this file
import draft_cost  # noqa: E402

from domino_spec.cache_domino import DominoContextCache  # noqa: E402
from domino_spec.drafting import DraftingOptions  # noqa: E402
from domino_spec.generation import compile_drafting, fuse_head_step  # noqa: E402
from domino_spec.generation import fused_head_step as head_step_triton  # noqa: E402
from domino_spec.generation.engine import DeviceClock  # noqa: E402
from domino_spec.generation.trees import grow_tree, tree_attention_mask, tree_depths  # noqa: E402
from domino_spec.targets import SHAPE_PRESETS, default_device  # noqa: E402
from domino_spec.transformers_compat import cache_keyword, new_dynamic_cache  # noqa: E402

TAUS = (4, 6, 8, 10)
PROFILED_CALLS, PROFILED_KERNELS = 5, 8  # --profile-head: head loop calls profiled, kernels kept per variant
# Draft-cost targets, what a draft near the cost floor meets: ratio name in `draft_cost.derive` -> the most it may be.
TARGETS = {"head_loop_share_of_draft_round": 0.05, "draft_round_over_verify": 0.15}
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "gpu_check.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen3-8b-shapes", help=f"one of {sorted(SHAPE_PRESETS)}, or a folder")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", choices=["auto", *draft_cost.DTYPES], default="auto", help="auto: bf16 on GPU")
    parser.add_argument("--draft-layers", type=int, default=5, help="draft decoder layers (published: 5)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per drafted block (published: 16)")
    parser.add_argument("--context", type=int, default=1024, help="tokens already in the KV caches")
    parser.add_argument("--head-pools", type=int, nargs="+", default=[0, 64], help="candidate_pool values")
    parser.add_argument("--tree-nodes", type=int, nargs="*", default=[16, 32, 64], help="fixed tree budgets to time")
    parser.add_argument(
        "--gate-table-mib",
        type=int,
        default=None,
        help="DraftingOptions.gate_table_max_bytes in MiB (default 0: no table; at Qwen3-8B shapes it takes 890 MiB)",
    )
    parser.add_argument(
        "--no-fused", dest="fused_step", action="store_false", help="skip the fused head step (Triton) variants"
    )
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip compiled drafting")
    parser.add_argument(
        "--profile-head", action="store_true", help="also record each variant's head loop kernels by device time"
    )
    parser.add_argument("--compile-mode", choices=draft_cost.COMPILE_MODES, default="reduce-overhead")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (the median is kept)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (the first also compiles)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="results JSON (+ .md beside it)")
    args = parser.parse_args(argv)
    draft_cost.check_arguments(parser, args)
    return args


def head_variants(args: argparse.Namespace) -> list[tuple[int, bool]]:
    """`(pool, fused)` per head variant: each pool unfused, then each pool fused where the Triton kernel runs."""
    fused = args.fused_step and head_step_triton.kernel_runs_on(torch.device(args.device))
    return [(pool, False) for pool in args.head_pools] + [(pool, True) for pool in args.head_pools if pool and fused]


def drafting_options(args: argparse.Namespace, pool: int = 0) -> DraftingOptions:
    """The `DraftingOptions` of a head variant, with `--gate-table-mib` (fused or not: the draft's `fuse_head_step`)."""
    table = {} if args.gate_table_mib is None else {"gate_table_max_bytes": args.gate_table_mib * 2**20}
    return DraftingOptions(candidate_pool=pool, **table)


def variant_suffix(pool: int, fused: bool, compiled: bool) -> str:
    """Key suffix of a drafting variant in the timings: `""`, `"_compiled"`, `"_pool64"`, `"_pool64_fused_compiled"`."""
    return (f"_pool{pool}" if pool else "") + ("_fused" if fused else "") + ("_compiled" if compiled else "")


def variant_name(suffix: str) -> str:
    return suffix.lstrip("_") or "eager"


class Timer(draft_cost.Timer):
    """`draft_cost.Timer`; with `profile_head`, once it has timed a head loop it also profiles it (`head_kernels`)."""

    def __init__(self, device: str, repeats: int, warmup: int, profile_head: bool):
        super().__init__(device, repeats, warmup)
        self.profile_head, self.head_kernels = profile_head, {}

    def __call__(self, name: str, run, reset=None) -> float:
        ms = super().__call__(name, run, reset)
        if self.profile_head and name.startswith("draft_head_loop"):
            try:  # the timing stands even where the profiler cannot run
                self.head_kernels[variant_name(name.removeprefix("draft_head_loop"))] = kernel_times(run, self.clock)
            except Exception as error:  # noqa: BLE001
                self.log(f"profiling {name} failed: {type(error).__name__}: {error}")
        return ms


def kernel_times(run, clock: DeviceClock) -> list[dict]:
    """The costliest kernels of `run` (on CPU: operators), by self time over `PROFILED_CALLS` calls, per call."""
    on_gpu = clock.cuda
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as profiler:
        for _ in range(PROFILED_CALLS):
            run()
        clock()  # waits for the kernels
    if on_gpu:
        events = [(event, event.self_device_time_total) for event in profiler.key_averages()]
        events = [(event, us) for event, us in events if event.device_type == DeviceType.CUDA and us > 0]
    else:
        events = [(event, event.self_cpu_time_total) for event in profiler.key_averages()]
    events.sort(key=lambda pair: -pair[1])
    return [
        {"name": event.key, "launches": event.count / PROFILED_CALLS, "us": us / PROFILED_CALLS}
        for event, us in events[:PROFILED_KERNELS]
    ]


def assess(timings: dict[str, float], max_tau: int, suffix: str) -> dict:
    """Ratios, speedup bounds and pass/fail against `TARGETS` of one drafting variant."""
    ratios, speedup = draft_cost.derive(timings, max_tau, TAUS, suffix)
    checks = {}
    for name, limit in TARGETS.items():
        value = ratios[f"{name}{suffix}"]
        checks[name] = {"value": value, "target": limit, "pass": value <= limit}
    ratios = {name.removesuffix(suffix) if suffix else name: value for name, value in ratios.items()}
    return {"ratios": ratios, "speedup_bound": speedup, "checks": checks}


@torch.no_grad()  # as draft_cost.measure
def measure(
    target, draft, args: argparse.Namespace, timer: draft_cost.Timer, report, errors: dict, drafted: dict
) -> dict:
    """Target, then every drafting variant; `report(timings)` saves what is measured so far after each stage.

    Each variant's tokens of one round land in `drafted`. A variant that fails (a kernel or a compiler the GPU at hand
    refuses) lands in `errors` under its name and the others still run: one GPU run is too precious to lose them.
    """
    generator = torch.Generator().manual_seed(args.seed)
    context_ids = torch.randint(0, draft.config.vocab_size, (1, args.context), generator=generator)
    num_draft_tokens = draft.config.num_draft_tokens
    timings, prefill = draft_cost.measure_target(target, context_ids.to(args.device), num_draft_tokens, timer)
    report(timings)
    measure_variants(draft, target, prefill, args, timer, report, timings, drafted, errors, compiled=False)
    try:
        timings |= measure_trees(target, draft, context_ids.to(args.device), prefill, args, timer)
    except Exception as error:  # noqa: BLE001 (reported and saved, and the run exits non-zero)
        traceback.print_exc()
        errors["trees"] = f"{type(error).__name__}: {error}"
    report(timings)
    if not args.compile:
        return timings
    timer.log(f"compile_drafting({args.compile_mode!r}): each variant's first call compiles")
    compile_drafting(draft, args.compile_mode)
    # Each variant compiles the head again: past dynamo's recompile limit (8) one would silently run eager under a
    # compiled name. Room for every variant, and a variant that still hits it fails (recorded in `errors`).
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(head_variants(args)))
    try:
        with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
            measure_variants(draft, target, prefill, args, timer, report, timings, drafted, errors, compiled=True)
    finally:
        compile_drafting(draft, None)
    return timings


def measure_variants(
    draft, target, prefill, args, timer, report, timings: dict, drafted: dict, errors: dict, compiled: bool
) -> None:
    """`draft_cost.measure_draft` per head variant; compiled after `compile_drafting` (variants recompile the head)."""
    for pool, fused in head_variants(args):
        # Context update and argmax are the same for every variant: timed with the first that gets through them
        # (the ratios of every variant need the argmax, so a first variant that fails must not lose it).
        shared = "draft_argmax" not in timings
        suffix = variant_suffix(pool, fused, compiled)
        try:
            options = drafting_options(args, pool)
            fuse_head_step(draft, fused)
            timings |= draft_cost.measure_draft(draft, target, prefill, timer, options, suffix, shared, drafted)
        except Exception as error:  # noqa: BLE001 (reported and saved, and the run exits non-zero)
            traceback.print_exc()
            errors[variant_name(suffix)] = f"{type(error).__name__}: {error}"
        finally:
            fuse_head_step(draft, False)
        report(timings)


@torch.no_grad()
def measure_trees(target, draft, context_ids: torch.Tensor, prefill, args: argparse.Namespace, timer: Timer) -> dict:
    """Per budget N in `--tree-nodes`: growing a tree of N drafts from the backbone's block, and the target's verify
    pass over the anchor and the N nodes, each attending to the context and its ancestors only."""
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    features = draft.fuse_target_hidden_states(prefill.hidden_states)  # [1, T, n_layers * D]
    context_length, device = features.shape[1], features.device
    draft_cache = DominoContextCache()
    draft.extend_context(draft_cache, features, torch.arange(context_length, device=device)[None])
    anchor = prefill.logits[:, -1].argmax(dim=-1)  # [1]
    anchor_position = torch.tensor([context_length], device=device)
    block = draft.block_logits(anchor, anchor_position, draft_cache, embed_tokens, lm_head)
    target_cache = new_dynamic_cache(target.config)
    cache_argument = {cache_keyword(target): target_cache}
    target(context_ids, **cache_argument, logits_to_keep=1)
    slot_mask = torch.ones(1, context_length, dtype=torch.long, device=device)
    timings = {}
    for num_nodes in args.tree_nodes:

        def grow(num_nodes: int = num_nodes):
            return grow_tree(draft, block, embed_tokens, num_nodes, max_depth=args.block_size - 1)

        tree = grow()
        verify = {
            "input_ids": torch.cat([anchor[:, None], tree.tokens], dim=-1),
            "attention_mask": tree_attention_mask(tree.parents, slot_mask, target.dtype),
            "position_ids": context_length + tree_depths(tree.parents),
        }
        timings[f"draft_tree_{num_nodes}"] = timer(f"draft_tree_{num_nodes}", grow)
        timings[f"target_verify_tree_{num_nodes}"] = timer(
            f"target_verify_tree_{num_nodes}",
            lambda verify=verify: target(**verify, **cache_argument),
            lambda num_nodes=num_nodes: target_cache.crop(-(num_nodes + 1)),
        )
    return timings


def tree_table(settings: dict, timings: dict) -> list[str]:
    """Fixed-budget trees next to the chain's whole block: drafting and verify times."""
    lines = ["| drafts verified | draft (ms) | verify (ms) |", "|---|---:|---:|"]
    lines.append(
        f"| chain of {settings['block_size'] - 1} | {timings.get('draft_round', float('nan')):.2f} | "
        f"{timings['target_verify']:.2f} |"
    )
    for num_nodes in settings.get("tree_nodes", []):
        if f"target_verify_tree_{num_nodes}" in timings:
            draft_ms = timings.get("draft_backbone", float("nan")) + timings[f"draft_tree_{num_nodes}"]
            lines.append(f"| tree of {num_nodes} | {draft_ms:.2f} | {timings[f'target_verify_tree_{num_nodes}']:.2f} |")
    return lines


def same_tokens_as_eager(drafted: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Per compiled or fused variant: did it draft the tokens the eager, unfused loop with its pool drafted from the
    same state? (Not asked where that loop failed.)"""
    reference = {suffix: suffix.replace("_fused", "").removesuffix("_compiled") for suffix in drafted}
    return {
        variant_name(suffix): torch.equal(tokens, drafted[reference[suffix]])
        for suffix, tokens in drafted.items()
        if reference[suffix] != suffix and reference[suffix] in drafted
    }


def results_of(
    args: argparse.Namespace,
    model: dict,
    timer: Timer,
    timings: dict,
    drafted: dict,
    errors: dict,
    started: float,
) -> dict:
    variants = {}
    for compiled in (False, True):
        for pool, fused in head_variants(args):
            suffix = variant_suffix(pool, fused, compiled)
            if f"draft_round{suffix}" in timings:
                variants[variant_name(suffix)] = assess(timings, model["max_tau"], suffix)
    return {
        "environment": environment(args.device),
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "model": model,
        "targets": TARGETS,
        "timings_ms": timings,
        "variants": variants,
        "same_tokens_as_eager": same_tokens_as_eager(drafted),
        "drafted_tokens": {variant_name(suffix): tokens.tolist() for suffix, tokens in drafted.items()},
        "head_kernels": timer.head_kernels,
        "fused_launch_configs": {key: pick._asdict() for key, pick in head_step_triton.tuned_launch_configs().items()},
        "errors": errors,
        "elapsed_s": time.perf_counter() - started,
    }


def environment(device: str) -> dict:
    env = draft_cost.environment(device)
    if device.startswith("cuda"):
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return env


def markdown(results: dict) -> str:
    settings, timings, variants = results["settings"], results["timings_ms"], results["variants"]
    pools = ", ".join(str(pool) for pool in settings["head_pools"])
    lines = [
        f"# GPU check of the draft cost: {settings['target']}, draft {settings['draft_layers']} layers, block "
        f"{settings['block_size']}, context {settings['context']}, {settings['dtype']} on {settings['device']}",
        "",
        draft_cost.environment_line(results["environment"]),
        "",
        f"Head candidate pools {pools} (0: whole vocabulary); fused: `fuse_head_step(draft)` (one Triton "
        f"kernel per slot); compiled: `compile_drafting(draft, {settings['compile_mode']!r})`; GRU input gate table "
        f"{'used' if results['model']['gru_input_table'] else 'not used (too big)'}. Run took "
        f"{results['elapsed_s']:.0f} s.",
        "",
        *draft_cost.piece_table(timings),
        "",
        "Verify pass over the anchor and k drafts (`target_verify_k`):",
        "",
        *draft_cost.verify_curve_table(timings),
        "",
        "Fixed-budget trees (`DraftingOptions(tree_nodes=N)`): the backbone plus growing the tree (`draft_tree_N`), "
        "and the verify pass over the anchor and N nodes under the tree mask:",
        "",
        *tree_table(settings, timings),
        "",
    ]
    for name, error in results["errors"].items():
        lines += [f"**{name} failed:** `{error}`", ""]
    for name, same in results["same_tokens_as_eager"].items():
        lines += [f"{name}: drafted {'the same tokens as' if same else 'OTHER tokens than'} eager from one state.", ""]
    if variants:
        lines += variant_table(results)
    for name, kernels in results["head_kernels"].items():
        lines += ["", f"Head loop of {name}, costliest kernels per call:", "", "| kernel | launches | us |"]
        lines.append("|---|---:|---:|")
        lines += [f"| `{kernel['name'][:90]}` | {kernel['launches']:g} | {kernel['us']:.1f} |" for kernel in kernels]
    if results["fused_launch_configs"]:
        lines += ["", "Fused head step: launch configs the autotuner picked (eager; torch.compile tunes its own):", ""]
        lines += [f"- {key}: {config}" for key, config in results["fused_launch_configs"].items()]
    return "\n".join(lines) + "\n"


def variant_table(results: dict) -> list[str]:
    """Per drafting variant: round and head loop times, pass/fail against `TARGETS`, speedup bounds."""
    timings = results["timings_ms"]
    limits = {name: f"{100 * limit:.0f}%" for name, limit in TARGETS.items()}
    lines = [
        f"Targets: head loop <= {limits['head_loop_share_of_draft_round']} of a draft round, draft round <= "
        f"{limits['draft_round_over_verify']} of a verify pass. Speedup bound: tau * t_decode / (t_draft_round + "
        f"t_verify), tau <= {results['model']['max_tau']}.",
        "",
        "| variant | draft round ms | head loop ms | head share of round | round / verify | "
        + " | ".join(f"tau {tau}" for tau in TAUS)
        + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(TAUS),
    ]
    for name, variant in results["variants"].items():
        suffix = "" if name == "eager" else f"_{name}"
        checks = variant["checks"]
        cells = [
            f"{timings[f'draft_round{suffix}']:.3f}",
            f"{timings[f'draft_head_loop{suffix}']:.3f}",
            *(verdict(checks[check]) for check in TARGETS),
            *("n/a" if value is None else f"{value:.2f}x" for value in variant["speedup_bound"].values()),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def verdict(check: dict) -> str:
    return f"{100 * check['value']:.1f}% {'PASS' if check['pass'] else 'FAIL'}"


def main(argv: list[str] | None = None) -> dict:
    started = time.perf_counter()
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    timer = Timer(args.device, args.repeats, args.warmup, args.profile_head)
    timer.log(f"building {args.target} ({args.dtype}) and a {args.draft_layers}-layer draft on {args.device}")
    target, draft = draft_cost.build_models(
        args.target, draft_cost.DTYPES[args.dtype], args.device, args.draft_layers, args.block_size
    )
    model = draft_cost.model_summary(target, draft)
    with torch.no_grad():  # with gradients on, the head never uses the table
        embed_tokens, options = target.get_input_embeddings(), drafting_options(args)
        weights = draft.head.weights(embed_tokens, draft.draft_vocab, torch.float32, options)  # block_logits: float32
        model["gru_input_table"] = weights.gate_table is not None

    errors, drafted = {}, {}

    def report(timings: dict) -> tuple[dict, str]:
        results = results_of(args, model, timer, timings, drafted, errors, started)
        text = markdown(results)
        draft_cost.write_results(results, text, args.output)
        return results, text

    results, text = report(measure(target, draft, args, timer, report, errors, drafted))
    print(text)
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")
    return results


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
