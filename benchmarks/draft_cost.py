"""What a Domino drafting round costs next to the target's own decode and verify passes.

Times, at a context of `--context` tokens already in both KV caches (median over `--repeats` after warmup):

- target decode: one target forward of 1 token (plain autoregressive decoding, per token);
- target verify: one target forward of block_size + 1 tokens with hidden states (anchor + drafts);
- draft context update: `extend_context` with the features of block_size + 1 new tokens (the most a round accepts);
- draft backbone: one parallel pass over `[anchor, MASK...]` plus the target's LM head on its hidden states;
- draft head loop: the greedy Domino head over the block (a GRU step and a low-rank map per slot), as
  `draft_block` runs it for greedy drafting;
- draft argmax: plain argmax of the base logits, the selection a DFlash draft (no head) pays anyway;
- draft round: `draft_block` appending those new features: context update + backbone + head loop.

With `--compile`, the backbone, head loop and round are timed again after `draft.compile_drafting()` (keys
`*_compiled`; on CUDA with the default mode the head loop runs as one captured CUDA graph).

It derives the speedup a round can give at acceptance length tau (tokens committed per round):
`speedup ~= tau * t_decode / (t_draft_round + t_verify)`, an upper bound that ignores the rest of the loop.

Usage:
    python benchmarks/draft_cost.py --target tiny
    python benchmarks/draft_cost.py --target qwen3-8b-shapes --device cuda --context 2048 --compile --output 8b.json
    python benchmarks/draft_cost.py --target /path/to/Qwen3-8B --draft-layers 5 --block-size 16

Named targets are built with random weights from their config (`AutoModelForCausalLM.from_config`): timing
depends on shapes, not on weights.
"""

import argparse
import inspect
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from domino_spec import DominoContextCache, DominoDraftModel
from domino_spec.head_step_triton import triton

# Layer shapes of real targets (random weights): `<name>-shapes` times what the named model would cost.
PRESETS = {
    "tiny": dict(
        model_type="qwen3", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ),
    "qwen3-0.6b-shapes": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0, tie_word_embeddings=True,
    ),
    "qwen3-4b-shapes": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0, tie_word_embeddings=True,
    ),
    "qwen3-8b-shapes": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0, tie_word_embeddings=False,
    ),
}  # fmt: skip
TAUS = (2, 3, 4, 6, 8)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # compile_drafting's


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny", help=f"a local HF model folder, or one of {sorted(PRESETS)}")
    parser.add_argument("--draft-layers", type=int, default=5, help="draft decoder layers (published: 5)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per drafted block (published: 16)")
    parser.add_argument("--context", type=int, default=1024, help="tokens already in the KV caches")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bfloat16 on GPU, else float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per measurement (the median is kept)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before each measurement")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("draft_cost.json"), help="results JSON (+ .md beside it)")
    parser.add_argument("--compile", action="store_true", help="also time drafting after draft.compile_drafting()")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="reduce-overhead")
    parser.add_argument("--head-pool", type=int, default=0, help="config.head_candidate_pool (0: whole vocabulary)")
    args = parser.parse_args()
    check_arguments(parser, args)
    return args


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Argument checks shared with `gpu_check.py`."""
    if args.context <= args.block_size:
        parser.error(
            f"--context ({args.context}) must exceed --block-size ({args.block_size}): the verify pass and the "
            "draft's context update reuse its last block_size + 1 tokens"
        )


# ---------------------------------------------------------------------- models


def load_target(name: str, dtype: torch.dtype, device: str) -> transformers.PreTrainedModel:
    """A local model folder, or a named preset built with random weights directly on `device`."""
    if os.path.isdir(name):
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
    if name not in PRESETS:
        raise ValueError(f"--target {name!r} is neither a local model folder nor one of {sorted(PRESETS)}")
    fields = dict(PRESETS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), max_position_embeddings=40960, **fields)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def cache_keyword(model: transformers.PreTrainedModel) -> str:
    """The forward's KV-cache argument: `cache` from transformers 5.24 (which deprecates `past_key_values`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_ms(
    run: Callable[[], object], device: str, repeats: int, warmup: int, reset: Callable[[], None] | None = None
) -> float:
    """Median wall time of `run()` in milliseconds; `reset()` (untimed) restores the caches `run` grew."""
    times = []
    for index in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
        if reset is not None:
            reset()
    return 1000 * statistics.median(times)


class Timer:
    """`timer(name, run, reset=None)`: `median_ms` of `run`, printed as it comes (long GPU runs show progress).

    The first warmup call also pays any compilation, so it is reported apart as `first call`.
    """

    def __init__(self, device: str, repeats: int, warmup: int, verbose: bool = True):
        self.device, self.repeats, self.warmup, self.verbose = device, repeats, max(warmup, 1), verbose
        self.started = time.perf_counter()

    def log(self, message: str) -> None:
        if self.verbose:
            print(f"[{time.perf_counter() - self.started:7.1f}s] {message}", flush=True)

    def __call__(self, name: str, run: Callable[[], object], reset: Callable[[], None] | None = None) -> float:
        first = median_ms(run, self.device, repeats=1, warmup=0, reset=reset)
        ms = median_ms(run, self.device, self.repeats, self.warmup - 1, reset)
        self.log(f"{name}: {ms:.3f} ms (first call {first:.1f} ms)")
        return ms


# ---------------------------------------------------------------------- measurements


def measure_target(target, context_ids: torch.Tensor, block_size: int, time_it: Callable) -> tuple[dict, tuple]:
    """Decode (1 token) and verify (block_size + 1 tokens) on a prefilled cache; also returns the prefill output."""
    # Prefill once, then time steps on top of the cache, cropping what each step appended.
    target_cache = DynamicCache(config=target.config)
    cache_argument = {cache_keyword(target): target_cache}

    def target_step(input_ids: torch.Tensor, **kwargs):
        return target(input_ids, **cache_argument, **kwargs)

    prefill = target_step(context_ids, output_hidden_states=True, logits_to_keep=1)  # no [T, V] logits
    next_token = prefill.logits[:, -1:].argmax(dim=-1)  # [1, 1]
    verify_ids = context_ids[:, -(block_size + 1) :]  # any block_size + 1 tokens cost the same
    timings = {
        # crop(-n) drops the last n positions (a positive n is an absolute length before 5.18, an error after).
        "target_decode": time_it("target_decode", lambda: target_step(next_token), lambda: target_cache.crop(-1)),
        "target_verify": time_it(
            "target_verify",
            lambda: target_step(verify_ids, output_hidden_states=True),
            lambda: target_cache.crop(-(block_size + 1)),
        ),
    }
    assert target_cache.get_seq_length() == context_ids.shape[1], "a reset missed a crop"
    return timings, prefill


def measure_draft(
    draft: DominoDraftModel,
    target,
    prefill,
    time_it: Callable,
    suffix: str = "",
    shared: bool = True,
    drafted: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Backbone, head loop and a whole `draft_block` round, with the prefill's context cached.

    Backbone and head loop go through what `draft_block` runs (compiled after `draft.compile_drafting()`); `suffix`
    names the variant in the keys (e.g. `draft_head_loop_compiled`). With `shared`, also the pieces no variant
    changes: the context update and argmax of the base logits. With `drafted`, the tokens of one round land in it
    under `suffix`, to compare variants that must draft the same tokens.
    """
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    features = draft.fuse_target_hidden_states(prefill.hidden_states)  # [1, T, n_layers * D]
    context_length, block_size, device = features.shape[1], draft.config.block_size, features.device
    draft_cache = DominoContextCache()
    positions = torch.arange(context_length, device=device)[None]
    draft.extend_context(draft_cache, features, positions)
    context = list(zip(draft_cache.keys, draft_cache.values))
    # A round's accepted tokens; their values and positions do not change the cost.
    new_features = features[:, -(block_size + 1) :]
    new_positions = context_length + torch.arange(block_size + 1, device=device)[None]
    anchor = prefill.logits[:, -1].argmax(dim=-1)  # [1]: the target's next token, right after the context
    anchor_position = torch.tensor([context_length], device=device)
    block_ids = torch.full((1, block_size), draft.config.mask_token_id, device=device)
    block_ids[:, 0] = anchor
    block_positions = anchor_position[:, None] + torch.arange(block_size, device=device)

    def backbone():
        """One parallel pass over the block, then the target's LM head: the base logits of every slot."""
        block_embeds = embed_tokens(block_ids)
        hidden = draft._drafting_backbone()(block_embeds, block_positions, context)
        draft_hidden = draft._draft_slots(hidden)  # [1, S, D]
        return block_embeds, draft_hidden, lm_head(draft_hidden.to(lm_head.weight.dtype)).float()  # [1, S, V]

    def draft_round():
        return draft.draft_block(anchor, anchor_position, draft_cache, embed_tokens, lm_head, new_features, new_positions)

    def crop_new_context():
        draft_cache.crop(-(block_size + 1))

    block_embeds, draft_hidden, base_logits = backbone()
    timings = {}
    if shared:
        timings["draft_context_update"] = time_it(
            "draft_context_update",
            lambda: draft.extend_context(draft_cache, new_features, new_positions),
            crop_new_context,
        )
        timings["draft_argmax"] = time_it("draft_argmax", lambda: base_logits.argmax(dim=-1))
    timings |= {
        f"draft_backbone{suffix}": time_it(f"draft_backbone{suffix}", backbone),
        f"draft_head_loop{suffix}": time_it(
            f"draft_head_loop{suffix}",
            lambda: draft._greedy_head(base_logits, draft_hidden, block_embeds[:, 0], embed_tokens),
        ),
        f"draft_round{suffix}": time_it(f"draft_round{suffix}", draft_round, crop_new_context),
    }
    if drafted is not None:
        drafted[suffix] = draft_round().tokens.cpu()
        crop_new_context()
    assert draft_cache.get_seq_length() == context_length, "a reset missed a crop"
    return timings


def measure_compiled(draft: DominoDraftModel, target, prefill, time_it: Callable, mode: str) -> dict[str, float]:
    """`measure_draft` after `draft.compile_drafting(mode)` (keys `*_compiled`); leaves the draft eager again."""
    draft.compile_drafting(mode)
    try:
        return measure_draft(draft, target, prefill, time_it, suffix="_compiled", shared=False)
    finally:
        draft.compile_drafting(None)


@torch.no_grad()  # what draft_block runs under (not inference_mode, which CUDA-graph capture handles less well)
def measure(
    target, draft: DominoDraftModel, args: argparse.Namespace, time_it: Callable | None = None
) -> dict[str, float]:
    """Milliseconds of each piece of a speculative round, with `args.context` tokens already cached."""
    time_it = time_it or Timer(args.device, args.repeats, args.warmup, verbose=False)
    generator = torch.Generator().manual_seed(args.seed)
    context_ids = torch.randint(0, draft.config.vocab_size, (1, args.context), generator=generator)
    timings, prefill = measure_target(target, context_ids.to(args.device), args.block_size, time_it)
    timings |= measure_draft(draft, target, prefill, time_it)
    if args.compile:
        timings |= measure_compiled(draft, target, prefill, time_it, args.compile_mode)
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
    target_name: str, dtype: torch.dtype, device: str, draft_layers: int, block_size: int, head_pool: int = 0
) -> tuple[transformers.PreTrainedModel, DominoDraftModel]:
    """The target (`load_target`) and a random draft matched to it, both built directly on `device`."""
    target = load_target(target_name, dtype, device)
    with torch.device(device):  # initialising ~1B draft parameters on the CPU would take longer than the GPU run
        draft = DominoDraftModel.from_target(
            target, num_hidden_layers=draft_layers, block_size=block_size, head_candidate_pool=head_pool
        )
    return target, draft.eval()


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


def markdown(results: dict) -> str:
    settings, timings = results["settings"], results["timings_ms"]
    lines = [
        f"# Draft cost: {settings['target']}, {settings['draft_layers']} draft layers, block {settings['block_size']}, "
        f"context {settings['context']}, {settings['dtype']} on {settings['device']}",
        "",
        environment_line(results["environment"]),
        "",
        "| piece | median ms |",
        "|---|---:|",
        *(f"| {name} | {ms:.3f} |" for name, ms in timings.items()),
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
    head_parameters = sum(p.numel() for n, p in draft.named_parameters() if n.startswith(("prefix_gru", "embed_proj")))
    return {
        "target_parameters": target.num_parameters(),
        "draft_parameters": draft.num_parameters(),
        "head_parameters": head_parameters,
        "num_draft_tokens": draft.config.num_draft_tokens,
        "max_tau": draft.config.num_draft_tokens + 1,  # all drafts accepted, plus the target's own token
    }


def write_results(results: dict, report: str, output: Path) -> None:
    """`output` (JSON) and the Markdown `report` beside it (`.md`)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    output.with_suffix(".md").write_text(report)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # on a shared CPU, fewer threads than cores avoids OpenMP spin stalls
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    target, draft = build_models(
        args.target, DTYPES[args.dtype], args.device, args.draft_layers, args.block_size, args.head_pool
    )
    model = model_summary(target, draft)

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
        "timings_ms": timings,
        "ratios": ratios,
        **speedups,
    }
    report = markdown(results)
    print(report)
    write_results(results, report, args.output)
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
