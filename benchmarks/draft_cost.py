"""What a Domino drafting round costs next to the target's own decode and verify passes.

Times, at a context of `--context` tokens already in both KV caches (median over `--repeats` after warmup), the terms
of the cost model (S = the block's drafts, `num_draft_tokens`):

- target decode: one target forward of 1 token (plain autoregressive decoding, per token);
- target verify of k: one target forward of the anchor and k drafts with hidden states, for every k = 0..S
  (`target_verify_k`, the cost curve a cost-aware draft length weighs); `target_verify` is the whole block, k = S;
- draft context update: `extend_context` with the features of S + 1 new tokens (the most a round commits);
- draft backbone: `block_logits`, one parallel pass over `[anchor, MASK...]` plus the target's LM head;
- draft head loop: the Domino head's greedy slot loop over the block (`draft_from_block` on the backbone's output: a
  GRU step and a low-rank map per slot), with `--head-pool` as `DraftingOptions(candidate_pool=...)`;
- draft argmax: plain argmax of the base logits, the selection a DFlash draft (no head) pays anyway;
- draft round: `draft_block` appending those new features: context update + backbone + head loop.

On CPU, target and draft first go through `optimize_for_cpu` (every `nn.Linear` runs the fastest of three weight
layouts per row count), as a speculative decode on CPU should; `--no-cpu-optimization` times eager `nn.Linear`.
With `--compile`, the backbone, head loop and round are timed again after `compile_drafting(draft)` (keys
`*_compiled`; on CUDA with the default mode the head loop runs as one captured CUDA graph).

It derives the speedup a round can give at acceptance length tau (tokens committed per round):
`speedup ~= tau * t_decode / (t_draft_round + t_verify)`, an upper bound that ignores the rest of the loop.

Usage:
    python benchmarks/draft_cost.py --target tiny
    python benchmarks/draft_cost.py --target qwen3-8b-shapes --device cuda --context 2048 --compile --output 8b.json
    python benchmarks/draft_cost.py --target /path/to/Qwen3-8B --draft-layers 5 --block-size 16

`--target` is what `targets.load_target` takes: a local model folder, an asset name, or a shape preset (random
weights of a real model's shapes, built where they run: timing depends on shapes, not on weights).
"""

import argparse
import json
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from domino_spec import DominoContextCache, DominoDraftModel
from domino_spec.draft_building import from_target
from domino_spec.drafting import DraftingOptions
from domino_spec.generation.compiled_drafting import COMPILE_MODES, compile_drafting
from domino_spec.generation.cpu import CPUOptimization, optimize_for_cpu
from domino_spec.generation.engine import DeviceClock
from domino_spec.generation.fused_head_step import triton
from domino_spec.targets import (
    SHAPE_PRESETS,
    default_device,
    default_dtype,
    load_target,
)
from domino_spec.transformers_compat import cache_keyword, new_dynamic_cache

TAUS = (2, 3, 4, 6, 8)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target", default="tiny", help=f"a local model folder, an asset, or one of {sorted(SHAPE_PRESETS)}"
    )
    parser.add_argument("--draft-layers", type=int, default=5, help="draft decoder layers (published: 5)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per drafted block (published: 16)")
    parser.add_argument("--context", type=int, default=1024, help="tokens already in the KV caches")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bfloat16 on GPU, else fp32")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per measurement (the median is kept)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before each measurement")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("draft_cost.json"), help="results JSON (+ .md beside it)")
    parser.add_argument("--compile", action="store_true", help="also time drafting after compile_drafting(draft)")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="reduce-overhead")
    parser.add_argument("--head-pool", type=int, default=0, help="DraftingOptions.candidate_pool (0: whole vocabulary)")
    parser.add_argument("--draft-vocab-size", type=int, default=0, help="a draft vocabulary of N tokens (0: none)")
    parser.add_argument(
        "--no-cpu-optimization",
        dest="cpu_optimization",
        action="store_false",
        help="on CPU, time eager nn.Linear instead of preparing both models with optimize_for_cpu",
    )
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    args.cpu_optimization = args.cpu_optimization and args.device == "cpu"  # what the results record: applied or not
    return args


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Argument checks shared with `gpu_check.py`; resolves `--dtype auto` to the dtype `load_target` would pick."""
    if args.context <= args.block_size:
        parser.error(
            f"--context ({args.context}) must exceed --block-size ({args.block_size}): the verify passes and the "
            "draft's context update reuse its last tokens"
        )
    if args.dtype == "auto":
        args.dtype = str(default_dtype(args.device)).removeprefix("torch.")


# ---------------------------------------------------------------------- timing


def median_ms(
    run: Callable[[], object], clock: DeviceClock, repeats: int, warmup: int, reset: Callable[[], None] | None = None
) -> float:
    """Median wall time of `run()` in milliseconds; `reset()` (untimed) restores the caches `run` grew."""
    times = []
    for index in range(warmup + repeats):
        start = clock()
        run()
        if index >= warmup:
            times.append(clock() - start)
        if reset is not None:
            reset()
    return 1000 * statistics.median(times)


class Timer:
    """`timer(name, run, reset=None)`: `median_ms` of `run`, printed as it comes (long GPU runs show progress).

    The first warmup call also pays any compilation, so it is reported apart as `first call`.
    """

    def __init__(self, device: str, repeats: int, warmup: int, verbose: bool = True):
        self.clock = DeviceClock(torch.device(device))
        self.repeats, self.warmup, self.verbose = repeats, max(warmup, 1), verbose
        self.started = self.clock()

    def log(self, message: str) -> None:
        if self.verbose:
            print(f"[{self.clock() - self.started:7.1f}s] {message}", flush=True)

    def __call__(self, name: str, run: Callable[[], object], reset: Callable[[], None] | None = None) -> float:
        first = median_ms(run, self.clock, repeats=1, warmup=0, reset=reset)
        ms = median_ms(run, self.clock, self.repeats, self.warmup - 1, reset)
        self.log(f"{name}: {ms:.3f} ms (first call {first:.1f} ms)")
        return ms


# ---------------------------------------------------------------------- measurements


def measure_target(
    target, context_ids: torch.Tensor, num_draft_tokens: int, time_it: Callable
) -> tuple[dict, transformers.utils.ModelOutput]:
    """Decode (1 token) and verify passes over the anchor and k drafts for k = 0..`num_draft_tokens`, on a prefilled
    cache: `target_decode`, the curve `target_verify_k` (a list over k) and `target_verify` (its last entry, the
    whole block). Also returns the prefill output."""
    # Prefill once, then time steps on top of the cache, cropping what each step appended.
    target_cache = new_dynamic_cache(target.config)
    cache_argument = {cache_keyword(target): target_cache}

    def target_step(input_ids: torch.Tensor, **kwargs):
        return target(input_ids, **cache_argument, **kwargs)

    def verify_ms(num_drafts: int) -> float:
        verify_ids = context_ids[:, -(num_drafts + 1) :]  # any tokens cost the same
        return time_it(
            f"target_verify_k{num_drafts}",
            lambda: target_step(verify_ids, output_hidden_states=True),
            lambda: target_cache.crop(-(num_drafts + 1)),  # crop(-n) drops the last n positions
        )

    prefill = target_step(context_ids, output_hidden_states=True, logits_to_keep=1)  # no [T, V] logits
    next_token = prefill.logits[:, -1:].argmax(dim=-1)  # [1, 1]
    decode = time_it("target_decode", lambda: target_step(next_token), lambda: target_cache.crop(-1))
    timings = {"target_decode": decode}
    timings["target_verify_k"] = [verify_ms(num_drafts) for num_drafts in range(num_draft_tokens + 1)]
    timings["target_verify"] = timings["target_verify_k"][-1]
    assert target_cache.get_seq_length() == context_ids.shape[1], "a reset missed a crop"
    return timings, prefill


def measure_draft(
    draft: DominoDraftModel,
    target,
    prefill,
    time_it: Callable,
    options: DraftingOptions = DraftingOptions(),
    suffix: str = "",
    shared: bool = True,
    drafted: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Backbone (`block_logits`), head loop (`draft_from_block`) and a whole `draft_block` round under `options`,
    with the prefill's context cached.

    All three run what `draft_block` runs (compiled after `compile_drafting(draft)`); `suffix` names the variant in
    the keys (e.g. `draft_head_loop_compiled`). With `shared`, also the pieces no variant changes: the context update
    and argmax of the base logits. With `drafted`, the tokens of one round land in it under `suffix`, to compare
    variants that must draft the same tokens.
    """
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    features = draft.fuse_target_hidden_states(prefill.hidden_states)  # [1, T, n_layers * D]
    context_length, committed, device = features.shape[1], draft.config.num_draft_tokens + 1, features.device
    draft_cache = DominoContextCache()
    draft.extend_context(draft_cache, features, torch.arange(context_length, device=device)[None])
    # A round's committed tokens; their values and positions do not change the cost.
    new_features = features[:, -committed:]
    new_positions = context_length + torch.arange(committed, device=device)[None]
    anchor = prefill.logits[:, -1].argmax(dim=-1)  # [1]: the target's next token, right after the context
    anchor_position = torch.tensor([context_length], device=device)

    def backbone():
        return draft.block_logits(anchor, anchor_position, draft_cache, embed_tokens, lm_head)

    def draft_round():
        return draft.draft_block(
            anchor, anchor_position, draft_cache, embed_tokens, lm_head, new_features, new_positions, options=options
        )

    def crop_new_context():
        draft_cache.crop(-committed)

    block = backbone()
    timings = {}
    if shared:
        timings["draft_context_update"] = time_it(
            "draft_context_update",
            lambda: draft.extend_context(draft_cache, new_features, new_positions),
            crop_new_context,
        )
        timings["draft_argmax"] = time_it("draft_argmax", lambda: block.base_logits.argmax(dim=-1))
    timings |= {
        f"draft_backbone{suffix}": time_it(f"draft_backbone{suffix}", backbone),
        f"draft_head_loop{suffix}": time_it(
            f"draft_head_loop{suffix}",
            lambda: draft.draft_from_block(block, embed_tokens, options=options),
        ),
        f"draft_round{suffix}": time_it(f"draft_round{suffix}", draft_round, crop_new_context),
    }
    if drafted is not None:
        drafted[suffix] = draft_round().tokens.cpu()
        crop_new_context()
    assert draft_cache.get_seq_length() == context_length, "a reset missed a crop"
    return timings


def measure_compiled(
    draft: DominoDraftModel, target, prefill, time_it: Callable, mode: str, options: DraftingOptions
) -> dict[str, float]:
    """`measure_draft` after `compile_drafting(draft, mode)` (keys `*_compiled`); leaves the draft eager again."""
    compile_drafting(draft, mode)
    try:
        return measure_draft(draft, target, prefill, time_it, options, suffix="_compiled", shared=False)
    finally:
        compile_drafting(draft, None)


@torch.no_grad()  # what draft_block runs under (not inference_mode, which CUDA-graph capture handles less well)
def measure(target, draft: DominoDraftModel, args: argparse.Namespace, time_it: Callable | None = None) -> dict:
    """Milliseconds of each piece of a speculative round, with `args.context` tokens already cached (floats, and the
    verify curve `target_verify_k`, a list)."""
    time_it = time_it or Timer(args.device, args.repeats, args.warmup, verbose=False)
    generator = torch.Generator().manual_seed(args.seed)
    context_ids = torch.randint(0, draft.config.vocab_size, (1, args.context), generator=generator)
    options = DraftingOptions(candidate_pool=args.head_pool)
    timings, prefill = measure_target(target, context_ids.to(args.device), draft.config.num_draft_tokens, time_it)
    timings |= measure_draft(draft, target, prefill, time_it, options)
    if args.compile:
        timings |= measure_compiled(draft, target, prefill, time_it, args.compile_mode, options)
    return timings


def derive(
    timings: dict[str, float], max_tau: int, taus: tuple[int, ...] = TAUS, suffix: str = ""
) -> tuple[dict[str, float], dict[str, float | None]]:
    """Cost ratios, and the speedup bound per acceptance length (None where tau exceeds what a round can commit).

    `suffix` picks a variant of the draft timings (`"_compiled"`); the target's are shared.
    """
    head, draft_round = timings[f"draft_head_loop{suffix}"], timings[f"draft_round{suffix}"]
    argmax = timings["draft_argmax"]
    ratios = {
        "verify_over_decode": timings["target_verify"] / timings["target_decode"],
        f"draft_round_over_verify{suffix}": draft_round / timings["target_verify"],
        f"head_loop_share_of_draft_round{suffix}": head / draft_round,
        # What the head adds over a DFlash draft, which picks argmax of the same base logits anyway.
        f"head_loop_over_argmax{suffix}": head / argmax,
        f"head_overhead_share_of_draft_round{suffix}": (head - argmax) / draft_round,
    }
    round_ms = draft_round + timings["target_verify"]
    speedup = {str(tau): tau * timings["target_decode"] / round_ms if tau <= max_tau else None for tau in taus}
    return ratios, speedup


def build_models(
    target_name: str, dtype: torch.dtype, device: str, draft_layers: int, block_size: int, draft_vocab_size: int = 0
) -> tuple[transformers.PreTrainedModel, DominoDraftModel]:
    """The target (`targets.load_target`) and a random draft matched to it, both built directly on `device`; with a
    draft vocabulary of its first `draft_vocab_size` ids (which ids does not change the cost)."""
    target, _ = load_target(target_name, dtype, device)
    draft_vocab = torch.arange(draft_vocab_size) if draft_vocab_size else None
    with torch.device(device):  # initialising ~1B draft parameters on the CPU would take longer than the GPU run
        draft = from_target(target, num_hidden_layers=draft_layers, block_size=block_size, draft_vocab=draft_vocab)
    return target, draft.eval()


def cpu_optimization_summary(optimization: CPUOptimization | None) -> dict | None:
    """What `optimize_for_cpu` chose, for the results: the extra memory, and per weight shape the layout per row
    count (None: eager `nn.Linear`)."""
    if optimization is None:
        return None
    plans = {
        f"{out}x{inp} {str(dtype).removeprefix('torch.')}{' +bias' if bias else ''}": plan
        for (out, inp, dtype, bias), plan in optimization.plans.items()
    }
    return {"extra_mib": round(optimization.extra_bytes / 2**20, 1), "plans": plans}


# ---------------------------------------------------------------------- reporting


def environment_line(environment: dict) -> str:
    """The machine and versions as the one Markdown line under a results title."""
    return ", ".join(f"{key} {value}" for key, value in environment.items())


def environment(device: str) -> dict[str, str | int]:
    accelerator = torch.cuda.get_device_name(device) if device.startswith("cuda") else "none"
    return {
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "accelerator": accelerator,
        "cuda": torch.version.cuda or "none",
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        # Triton writes the kernels of compiled drafting on CUDA, and the fused head step
        "triton": triton.__version__ if triton is not None else "none",
    }


def speedup_table(results: dict) -> list[str]:
    """Markdown rows of the speedup bounds, one column per variant (`speedup_bound`, `speedup_bound_compiled`)."""
    columns = {key: results[key] for key in results if key.startswith("speedup_bound")}
    names = [key.removeprefix("speedup_bound").lstrip("_") or "eager" for key in columns]
    header = "| tau | " + " | ".join(f"speedup ({name})" if len(names) > 1 else "speedup" for name in names) + " |"
    rows = []
    for tau in results["speedup_bound"]:
        cells = ("n/a" if column[tau] is None else f"{column[tau]:.2f}x" for column in columns.values())
        rows.append(f"| {tau} | " + " | ".join(cells) + " |")
    return [header, "|---:|" + "---:|" * len(columns), *rows]


def piece_table(timings: dict) -> list[str]:
    """Markdown rows of the timed pieces (the verify curve has a table of its own, `verify_curve_table`)."""
    rows = (f"| {name} | {ms:.3f} |" for name, ms in timings.items() if name != "target_verify_k")
    return ["| piece | median ms |", "|---|---:|", *rows]


def verify_curve_table(timings: dict) -> list[str]:
    """Markdown rows of the verify cost per number of drafts k, also in decode steps."""
    decode = timings["target_decode"]
    rows = (f"| {k} | {ms:.3f} | {ms / decode:.2f} |" for k, ms in enumerate(timings["target_verify_k"]))
    return ["| drafts k | verify ms | / decode |", "|---:|---:|---:|", *rows]


def linear_layers_line(settings: dict) -> str:
    if settings["device"] != "cpu":
        return "Linear layers: eager `nn.Linear` (`optimize_for_cpu` is for CPUs)."
    if settings["cpu_optimization"]:
        return "Linear layers: `optimize_for_cpu` (the fastest of three weight layouts per row count)."
    return "Linear layers: eager `nn.Linear` (`--no-cpu-optimization`)."


def markdown(results: dict) -> str:
    settings, timings = results["settings"], results["timings_ms"]
    lines = [
        f"# Draft cost: {settings['target']}, {settings['draft_layers']} draft layers, block {settings['block_size']}, "
        f"context {settings['context']}, {settings['dtype']} on {settings['device']}",
        "",
        environment_line(results["environment"]),
        "",
        linear_layers_line(settings),
        "",
        *piece_table(timings),
        "",
        "Verify pass over the anchor and k drafts (`target_verify_k`):",
        "",
        *verify_curve_table(timings),
        "",
        "| ratio | value |",
        "|---|---:|",
        *(f"| {name} | {value:.3f} |" for name, value in results["ratios"].items()),
        "",
        f"Speedup bound tau * t_decode / (t_draft_round + t_verify), tau <= {results['model']['max_tau']}:",
        "",
        *speedup_table(results),
    ]
    return "\n".join(lines) + "\n"


def model_summary(target, draft: DominoDraftModel) -> dict[str, int]:
    return {
        "target_parameters": target.num_parameters(),
        "draft_parameters": draft.num_parameters(),
        "head_parameters": sum(p.numel() for p in draft.head.parameters()) if draft.head is not None else 0,
        "num_draft_tokens": draft.config.num_draft_tokens,
        "max_tau": draft.config.num_draft_tokens + 1,  # all drafts accepted, plus the target's own token
    }


def write_results(results: dict, report: str, output: Path) -> None:
    """`output` (JSON) and the Markdown `report` beside it (`.md`)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    output.with_suffix(".md").write_text(report)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # on a shared CPU, fewer threads than cores avoids OpenMP spin stalls
    target, draft = build_models(
        args.target, DTYPES[args.dtype], args.device, args.draft_layers, args.block_size, args.draft_vocab_size
    )
    model = model_summary(target, draft)
    optimization = optimize_for_cpu(target, draft) if args.cpu_optimization else None

    timings = measure(target, draft, args, Timer(args.device, args.repeats, args.warmup))
    ratios, speedup = derive(timings, model["max_tau"])
    speedups = {"speedup_bound": speedup}
    if args.compile:
        compiled_ratios, speedups["speedup_bound_compiled"] = derive(timings, model["max_tau"], suffix="_compiled")
        ratios |= compiled_ratios
    results = {
        "environment": environment(args.device),
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "model": model,
        "cpu_optimization": cpu_optimization_summary(optimization),
        "timings_ms": timings,
        "ratios": ratios,
        **speedups,
    }
    report = markdown(results)
    print(report)
    write_results(results, report, args.output)
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")
    return results


if __name__ == "__main__":
    main()
