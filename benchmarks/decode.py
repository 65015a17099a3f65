"""Decoding benchmark: plain decoding vs Domino through `target.generate(assistant_model=draft)` and the native engine.

Measures tokens/s, mean acceptance length (tau) and speedup over plain decoding for one target and draft, in one
run, on the same prompts. Prints a table and writes JSON and Markdown results with the machine and library versions.

    python benchmarks/decode.py --target tiny-qwen3                       # random tiny target and draft, no download
    python benchmarks/decode.py --target /models/Qwen3-8B --draft /drafts/qwen3-8b-domino \\
        --prompts-file prompts.txt --chat-template --max-new-tokens 256 --dtype bfloat16 --device cuda

Methods (`--methods`): `plain` (the native engine without a draft: the baseline, same loop and timing), `hf-plain`
(`target.generate`), `hf-domino` (`target.generate(assistant_model=draft)`, batch 1) and `native-domino`
(`domino_spec.generation.speculative_generate`, batches of `--batch-size`). Speedup = tokens/s of a method over
tokens/s of `plain`.
"""

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from domino_spec import DominoDraftModel
from domino_spec.generation import left_pad, pooled_position_rates, speculative_generate

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2)
PRESETS = {
    # name: (model class, config class, fields); random weights, built locally
    "tiny-qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(_TINY, head_dim=16)),
    "tiny-llama": (LlamaForCausalLM, LlamaConfig, _TINY),
    "small-qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(vocab_size=4096, hidden_size=512, intermediate_size=1536,
                                                        num_hidden_layers=12, num_attention_heads=8,
                                                        num_key_value_heads=4, head_dim=64)),
}
METHODS = ("plain", "hf-plain", "hf-domino", "native-domino")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class MethodResult:
    method: str
    new_tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0  # target verify passes after the prefills
    matches_plain: bool | None = None  # greedy only: identical sequences to `plain`
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    position_acceptance_rates: list[float | None] | None = None
    sequences: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify round, the prefill's token excluded (tau; 1.0 for plain decoding)."""
        return (self.new_tokens - len(self.sequences)) / self.rounds if self.rounds else float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny-qwen3",
                        help=f"a local model folder or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--draft", default="random",
                        help="a Domino draft folder, or 'random' (DominoDraftModel.from_target)")
    parser.add_argument("--draft-layers", type=int, default=1, help="layers of a random draft")
    parser.add_argument("--block-size", type=int, default=8, help="block size of a random draft")
    parser.add_argument("--prompts-file", help="one prompt per line (needs the target folder's tokenizer)")
    parser.add_argument("--chat-template", action="store_true",
                        help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--num-prompts", type=int, default=4, help="random prompts when no --prompts-file")
    parser.add_argument("--prompt-length", type=int, default=32, help="tokens per random prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1,
                        help="batch size of the native engine (plain, native-domino)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each method on the first prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="benchmarks/results")
    parser.add_argument("--output-name", default=None, help="file stem; default decode-<target>-<timestamp>")
    args = parser.parse_args(argv)
    args.methods = [method.strip() for method in args.methods.split(",") if method.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    # `plain` runs first, listed or not: results[0] is the baseline of every speedup and of `matches_plain`.
    args.methods = ["plain"] + [method for method in args.methods if method != "plain"]
    return args


def load_models(args) -> tuple[torch.nn.Module, DominoDraftModel, object]:
    """Target (preset or folder), its tokenizer (None for presets) and the draft (folder or random)."""
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    torch.manual_seed(args.seed)
    if args.target in PRESETS:
        model_class, config_class, fields = PRESETS[args.target]
        target, tokenizer = model_class(config_class(**fields)), None
    elif Path(args.target).is_dir():
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    else:
        raise SystemExit(f"--target {args.target!r} is neither a local folder nor a preset ({', '.join(PRESETS)})")
    target = target.to(device=device, dtype=dtype).eval()
    if args.draft == "random":
        draft = DominoDraftModel.from_target(target, num_hidden_layers=args.draft_layers, block_size=args.block_size)
    else:
        draft = DominoDraftModel.from_pretrained(args.draft, dtype=dtype)
    draft = draft.to(device=device, dtype=dtype).eval()
    draft.check_target(target)
    return target, draft, tokenizer


def make_prompts(args, target, tokenizer) -> list[torch.Tensor]:
    """1-row prompt tensors: tokenized lines of --prompts-file, or random tokens."""
    if args.prompts_file:
        if tokenizer is None:
            raise SystemExit("--prompts-file needs a target folder with a tokenizer")
        lines = [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
        if args.chat_template:
            lines = [tokenizer.apply_chat_template([{"role": "user", "content": line}], tokenize=False,
                                                   add_generation_prompt=True) for line in lines]
        return [tokenizer(line, return_tensors="pt", add_special_tokens=not args.chat_template).input_ids
                for line in lines]
    generator = torch.Generator().manual_seed(args.seed)
    vocab_size = target.get_input_embeddings().weight.shape[0]
    return [torch.randint(0, vocab_size, (1, args.prompt_length), generator=generator) for _ in range(args.num_prompts)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_native(args, target, draft, prompts, pad_token_id: int, method: str) -> MethodResult:
    """`plain` (draft None) or `native-domino`, in batches of --batch-size."""
    result = MethodResult(method, draft_seconds=0.0, verify_seconds=0.0)
    device = torch.device(args.device)
    accepted = verified = None  # per draft position, summed over batches
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        input_ids, attention_mask = left_pad(batch, pad_token_id)
        _sync(device)
        tick = time.perf_counter()
        output = speculative_generate(
            target, draft, input_ids.to(device), attention_mask.to(device), max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            pad_token_id=pad_token_id,
        )
        _sync(device)
        result.seconds += time.perf_counter() - tick
        result.new_tokens += sum(output.num_new_tokens)
        result.rounds += sum(len(lengths) for lengths in output.acceptance_lengths)
        result.draft_seconds += output.draft_time
        result.verify_seconds += output.verify_time
        accepted = output.position_accepted if accepted is None else accepted + output.position_accepted
        verified = output.position_verified if verified is None else verified + output.position_verified
        width = input_ids.shape[1]
        for row, prompt in enumerate(batch):
            new = output.sequences[row, width : width + output.num_new_tokens[row]]
            result.sequences.append(prompt[0].tolist() + new.tolist())
    if draft is not None and verified is not None:
        result.position_acceptance_rates = pooled_position_rates(accepted.tolist(), verified.tolist())
    return result


def run_hf(args, target, draft, prompts, pad_token_id: int, method: str) -> MethodResult:
    """`hf-plain` (draft None) or `hf-domino`: `target.generate`, one prompt at a time."""
    result = MethodResult(method)
    device = torch.device(args.device)
    calls = []
    handle = target.register_forward_pre_hook(lambda module, inputs: calls.append(1))
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k or 0, top_p=args.top_p or 1.0)
    try:
        for prompt in prompts:
            calls.clear()
            _sync(device)
            tick = time.perf_counter()
            sequences = target.generate(
                prompt.to(device), attention_mask=torch.ones_like(prompt).to(device),
                max_new_tokens=args.max_new_tokens, assistant_model=draft, pad_token_id=pad_token_id,
                **(sampling if args.do_sample else dict(do_sample=False)),
            )
            _sync(device)
            result.seconds += time.perf_counter() - tick
            result.new_tokens += sequences.shape[1] - prompt.shape[1]
            result.rounds += len(calls) - 1  # every forward after the prefill verifies one round
            result.sequences.append(sequences[0].tolist())
    finally:
        handle.remove()
    return result


def run_method(args, method, target, draft, prompts, pad_token_id) -> MethodResult:
    runner = run_native if method in ("plain", "native-domino") else run_hf
    return runner(args, target, draft if method.endswith("domino") else None, prompts, pad_token_id, method)


def environment(args, target, draft) -> dict:
    device = torch.device(args.device)
    return {
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "target": args.target,
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft": args.draft,
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "draft_layers": draft.config.num_hidden_layers,
        "block_size": draft.config.block_size,
    }


def _finite(value: float, digits: int) -> float | None:
    """Rounded, or None for NaN (strict JSON has no NaN)."""
    return None if value != value else round(value, digits)


def summarize(results: list[MethodResult]) -> list[dict]:
    baseline = results[0].tokens_per_second  # `plain`
    rows = []
    for result in results:
        row = {key: value for key, value in asdict(result).items() if key != "sequences"}
        row.update(
            tokens_per_second=_finite(result.tokens_per_second, 2),
            mean_acceptance_length=_finite(result.mean_acceptance_length, 3),
            speedup=_finite(result.tokens_per_second / baseline, 3),
            seconds=round(result.seconds, 4),
        )
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| method | new tokens | seconds | tokens/s | mean tau | speedup | matches plain |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        matches = "" if row["matches_plain"] is None else ("yes" if row["matches_plain"] else "NO")
        tau = "-" if row["mean_acceptance_length"] is None else f"{row['mean_acceptance_length']:.2f}"
        lines.append(f"| {row['method']} | {row['new_tokens']} | {row['seconds']:.3f} | {row['tokens_per_second']} | "
                     f"{tau} | {row['speedup']}x | {matches} |")
    return "\n".join(lines)


def write_results(args, report: dict) -> tuple[Path, Path]:
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_name or f"decode-{Path(args.target).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path, markdown_path = output_dir / f"{stem}.json", output_dir / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    environment_lines = "\n".join(f"- {key}: {value}" for key, value in report["environment"].items())
    settings = ", ".join(f"{key}={value}" for key, value in report["settings"].items())
    markdown_path.write_text(f"# Decoding benchmark\n\n{markdown_table(report['results'])}\n\nSettings: {settings}\n\n"
                             f"Environment:\n{environment_lines}\n")
    return json_path, markdown_path


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    target, draft, tokenizer = load_models(args)
    prompts = make_prompts(args, target, tokenizer)
    pad_token_id = target.generation_config.pad_token_id
    if pad_token_id is None:
        eos = target.generation_config.eos_token_id
        pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    for method in args.methods:
        for _ in range(args.warmup):
            run_method(args, method, target, draft, prompts[:1], pad_token_id)
    results = [run_method(args, method, target, draft, prompts, pad_token_id) for method in args.methods]
    if not args.do_sample:
        for result in results[1:]:
            result.matches_plain = result.sequences == results[0].sequences
    settings = {key: getattr(args, key) for key in ("max_new_tokens", "batch_size", "do_sample", "temperature", "top_k",
                                                    "top_p", "dtype", "device", "seed", "warmup", "prompts_file",
                                                    "chat_template", "prompt_length")}
    settings["num_prompts"] = len(prompts)
    report = {"environment": environment(args, target, draft), "settings": settings, "results": summarize(results)}
    print(markdown_table(report["results"]))
    json_path, markdown_path = write_results(args, report)
    print(f"wrote {json_path} and {markdown_path}")
    return report


if __name__ == "__main__":
    main()
