"""What a Domino drafting round costs next to the target's own decode and verify passes.

Times, at a context of `--context` tokens already in both KV caches (median over `--repeats` after warmup):

- target decode: one target forward of 1 token (plain autoregressive decoding, per token);
- target verify: one target forward of block_size + 1 tokens with hidden states (anchor + drafts);
- draft context update: `extend_context` with the features of block_size + 1 new tokens (the most a round accepts);
- draft backbone: one parallel pass over `[anchor, MASK...]` plus the target's LM head on its hidden states;
- draft head loop: the greedy Domino head over the block (a GRU step and a low-rank map per slot);
- draft round: `draft_block` appending those new features: context update + backbone + head loop.

and derives the speedup a round can give at acceptance length tau (tokens committed per round):
`speedup ~= tau * t_decode / (t_draft_round + t_verify)`, an upper bound that ignores the rest of the loop.

Usage:
    python benchmarks/draft_cost.py --target tiny
    python benchmarks/draft_cost.py --target qwen3-8b-shapes --device cuda --context 2048 --output qwen3_8b.json
    python benchmarks/draft_cost.py --target /path/to/Qwen3-8B --draft-layers 5 --block-size 16

Named targets are built with random weights from their config (`AutoModelForCausalLM.from_config`): timing
depends on shapes, not on weights.
"""

import argparse
import functools
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
    args = parser.parse_args()
    if args.context <= args.block_size:
        parser.error(
            f"--context ({args.context}) must exceed --block-size ({args.block_size}): the verify pass and the "
            "draft's context update reuse its last block_size + 1 tokens"
        )
    return args


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
        "target_decode": time_it(lambda: target_step(next_token), reset=lambda: target_cache.crop(-1)),
        "target_verify": time_it(
            lambda: target_step(verify_ids, output_hidden_states=True),
            reset=lambda: target_cache.crop(-(block_size + 1)),
        ),
    }
    assert target_cache.get_seq_length() == context_ids.shape[1], "a reset missed a crop"
    return timings, prefill


def measure_draft(draft: DominoDraftModel, target, prefill, time_it: Callable) -> dict[str, float]:
    """Context update, backbone, head loop and a whole `draft_block` round, with the prefill's context cached."""
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
        draft_hidden = draft._draft_slots(draft.backbone(block_embeds, block_positions, context))  # [1, S, D]
        return block_embeds, draft_hidden, lm_head(draft_hidden.to(lm_head.weight.dtype)).float()  # [1, S, V]

    def greedy(slot: int, slot_logits: torch.Tensor):
        return slot_logits.argmax(dim=-1), slot_logits

    def crop_new_context():
        draft_cache.crop(block_size + 1)

    block_embeds, draft_hidden, base_logits = backbone()
    timings = {
        "draft_context_update": time_it(
            lambda: draft.extend_context(draft_cache, new_features, new_positions), reset=crop_new_context
        ),
        "draft_backbone": time_it(backbone),
        "draft_head_loop": time_it(
            lambda: draft._head_loop(base_logits, draft_hidden, block_embeds[:, 0], embed_tokens, greedy)
        ),
        "draft_round": time_it(
            lambda: draft.draft_block(
                anchor, anchor_position, draft_cache, embed_tokens, lm_head, new_features, new_positions
            ),
            reset=crop_new_context,
        ),
    }
    assert draft_cache.get_seq_length() == context_length, "a reset missed a crop"
    return timings


@torch.inference_mode()
def measure(target, draft: DominoDraftModel, args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds of each piece of a speculative round, with `args.context` tokens already cached."""
    time_it = functools.partial(median_ms, device=args.device, repeats=args.repeats, warmup=args.warmup)
    generator = torch.Generator().manual_seed(args.seed)
    context_ids = torch.randint(0, draft.config.vocab_size, (1, args.context), generator=generator)
    timings, prefill = measure_target(target, context_ids.to(args.device), args.block_size, time_it)
    return {**timings, **measure_draft(draft, target, prefill, time_it)}


def derive(timings: dict[str, float], max_tau: int) -> tuple[dict[str, float], dict[str, float | None]]:
    """Cost ratios, and the speedup bound per acceptance length (None where tau exceeds what a round can commit)."""
    ratios = {
        "verify_over_decode": timings["target_verify"] / timings["target_decode"],
        "draft_round_over_verify": timings["draft_round"] / timings["target_verify"],
        "head_loop_share_of_draft_round": timings["draft_head_loop"] / timings["draft_round"],
    }
    round_ms = timings["draft_round"] + timings["target_verify"]
    speedup = {str(tau): tau * timings["target_decode"] / round_ms if tau <= max_tau else None for tau in TAUS}
    return ratios, speedup


# ---------------------------------------------------------------------- reporting


def environment(device: str) -> dict[str, str | int]:
    accelerator = torch.cuda.get_device_name(device) if device.startswith("cuda") else "none"
    return {
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "accelerator": accelerator,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def markdown(results: dict) -> str:
    settings, timings = results["settings"], results["timings_ms"]
    lines = [
        f"# Draft cost: {settings['target']}, {settings['draft_layers']} draft layers, block {settings['block_size']}, "
        f"context {settings['context']}, {settings['dtype']} on {settings['device']}",
        "",
        ", ".join(f"{key} {value}" for key, value in results["environment"].items()),
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
        "| tau | speedup |",
        "|---:|---:|",
        *(
            f"| {tau} | {'n/a' if value is None else f'{value:.2f}x'} |"
            for tau, value in results["speedup_bound"].items()
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # on a shared CPU, fewer threads than cores avoids OpenMP spin stalls
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    target = load_target(args.target, DTYPES[args.dtype], args.device)
    draft = DominoDraftModel.from_target(target, num_hidden_layers=args.draft_layers, block_size=args.block_size).eval()
    max_tau = draft.config.num_draft_tokens + 1  # all drafts accepted, plus the target's own token

    timings = measure(target, draft, args)
    ratios, speedup = derive(timings, max_tau)
    head_parameters = sum(p.numel() for n, p in draft.named_parameters() if n.startswith(("prefix_gru", "embed_proj")))
    results = {
        "environment": environment(args.device),
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "model": {
            "target_parameters": target.num_parameters(),
            "draft_parameters": draft.num_parameters(),
            "head_parameters": head_parameters,
            "num_draft_tokens": draft.config.num_draft_tokens,
            "max_tau": max_tau,
        },
        "timings_ms": timings,
        "ratios": ratios,
        "speedup_bound": speedup,
    }
    report = markdown(results)
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    args.output.with_suffix(".md").write_text(report)
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
