"""Regeneration throughput: the target answering training prompts, as `domino-spec generate-data` does it (the native
engine without a draft, each row leaving the batch at its EOS) against transformers' `generate` (which decodes every
row until the batch's longest answer ends), on the same batches, interleaved.

Takes `--prompts` prompts from the middle of the file's length order (a typical batch, not the shortest ones),
batches them by length as regeneration does, and times both ways on each batch in turn, the target prepared by
`optimize_for_cpu` on a CPU as `generate-data` prepares it. Prints a table and writes JSON + Markdown.

    python benchmarks/regeneration_throughput.py --target smollm2-135m --prompts-file runs/smollm2/prompts.jsonl
"""

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from domino_spec.generation.cpu import optimize_for_cpu
from domino_spec.generation.engine import speculative_generate
from domino_spec.targets import eos_token_ids, left_pad, load_target, pad_token_id, prompt_token_ids
from domino_spec.training.data import load_prompts, regenerate_responses

sys.path.insert(0, str(Path(__file__).resolve().parent))  # draft_cost.py sits beside this file
import draft_cost  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="a local model folder or an asset")
    parser.add_argument("--prompts-file", required=True, help="prompts as `generate-data --prompts` takes them")
    parser.add_argument("--prompts", type=int, default=96, help="prompts timed")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", type=Path, default=Path("regeneration_throughput.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target)
    if target.device.type == "cpu":
        optimize_for_cpu(target)
    prompts = sorted(load_prompts(args.prompts_file), key=lambda p: len(prompt_token_ids(tokenizer, p.messages, None)))
    middle = (len(prompts) - args.prompts) // 2
    prompts = prompts[max(0, middle) : max(0, middle) + args.prompts]
    eos, pad = eos_token_ids(target, tokenizer), pad_token_id(tokenizer)
    plain_decoding = functools.partial(speculative_generate, draft=None)  # as generate-data decodes

    seconds = {"transformers generate": 0.0, "native engine": 0.0}
    tokens, identical = 0, 0
    with tempfile.TemporaryDirectory() as folder:
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start : start + args.batch_size]
            input_ids, attention_mask = left_pad([prompt_token_ids(tokenizer, p.messages, None) for p in batch], pad)
            tick = time.perf_counter()
            sequences = target.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            )
            seconds["transformers generate"] += time.perf_counter() - tick
            path = f"{folder}/batch{start}.jsonl"
            tick = time.perf_counter()
            regenerate_responses(target, tokenizer, batch, path, plain_decoding, args.max_new_tokens, len(batch))
            seconds["native engine"] += time.perf_counter() - tick
            responses = {record["id"]: record["response_ids"] for record in map(json.loads, open(path))}
            for prompt, row in zip(batch, sequences[:, input_ids.shape[1] :].tolist()):
                ends = [index + 1 for index, token in enumerate(row) if token in eos]
                answer = row[: ends[0]] if ends else row
                tokens += len(answer)
                identical += int(responses[prompt.id] == answer)

    baseline = seconds["transformers generate"]
    rows = {
        method: {
            "seconds": value,
            "tokens_per_s": tokens / value,
            "prompts_per_s": len(prompts) / value,
            "speedup": baseline / value,
        }
        for method, value in seconds.items()
    }
    environment = draft_cost.environment(str(target.device))
    lines = [
        f"# Regeneration throughput: {args.target}, {len(prompts)} prompts, batch {args.batch_size}, at most "
        f"{args.max_new_tokens} new tokens, greedy",
        "",
        draft_cost.environment_line(environment),
        "",
        f"{tokens} response tokens (mean {tokens / len(prompts):.0f}); {identical} of {len(prompts)} responses "
        "identical between the two.",
        "",
        "| method | seconds | response tokens/s | prompts/s | speedup |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {method} | {row['seconds']:.1f} | {row['tokens_per_s']:.1f} | {row['prompts_per_s']:.3f} | "
            f"{row['speedup']:.2f}x |"
            for method, row in rows.items()
        ),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    results = {
        "settings": vars(args) | {"output": str(args.output)},
        "environment": environment,
        "results": rows,
        "response_tokens": tokens,
        "identical": identical,
    }
    draft_cost.write_results(results, report, args.output)
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
