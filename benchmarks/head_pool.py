"""Acceptance with the head's candidate pool: does restricting each slot's logit residual to its K best base tokens
(`DraftingOptions(candidate_pool=K)`) change what a trained draft proposes?

    python benchmarks/head_pool.py                                   # the shipped SmolLM2 draft, pools 0 8 32 64
    python benchmarks/head_pool.py --target DIR --draft DIR --pools 0 16 --limit 10

Greedy decoding with the native engine, the same prompts (the bench's eval sets) for every pool; pool 0 is the whole
vocabulary. Every round verifies the whole block (`draft_length="full"`), so tau measures what each pool proposes,
not how many drafts a cost model chose to verify. The pool is lossless, since the target verifies every draft: the
script checks that every pool's outputs equal pool 0's. Prints the mean acceptance length per eval set and pool, and
writes JSON + Markdown with the machine and versions. What the pool saves in time is `draft_cost.py --head-pool K`
(BENCHMARKS.md).
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from domino_spec import DominoDraftModel
from domino_spec.drafting import DraftingOptions
from domino_spec.generation import speculative_generate
from domino_spec.published_format import load_draft

sys.path.insert(0, str(Path(__file__).resolve().parent))  # draft_cost.py sits beside this file
import draft_cost  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "head_pool_smollm2-135m.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="asset name or local model folder")
    parser.add_argument("--draft", default=None, help="draft folder (default: the shipped SmolLM2 draft)")
    parser.add_argument("--pools", type=int, nargs="+", default=[0, 8, 32, 64], help="candidate_pool values")
    parser.add_argument("--eval-sets", default="mt-bench,humaneval,gsm-symbolic")
    parser.add_argument("--limit", type=int, default=5, help="first N prompts of each eval set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="results JSON (+ .md beside it)")
    args = parser.parse_args(argv)
    if 0 not in args.pools:
        parser.error("--pools must include 0 (the whole vocabulary): it is the reference of the output check")
    return args


@torch.no_grad()
def pool_acceptance(
    target, draft: DominoDraftModel, prompts: dict[str, list[torch.Tensor]], pools: list[int], max_new_tokens: int
) -> list[dict]:
    """Per eval set and pool: mean acceptance length, acceptance per draft position, and the output check."""
    rows = []
    with tqdm(total=sum(map(len, prompts.values())) * len(pools), desc="pools", unit="decode") as progress:
        for name, prompt_ids in prompts.items():
            reference = None
            for pool in sorted(pools):  # 0 first: the reference
                options = DraftingOptions(candidate_pool=pool, draft_length="full")
                lengths, outputs = [], []
                for input_ids in prompt_ids:
                    output = speculative_generate(
                        target, draft, input_ids, max_new_tokens=max_new_tokens, options=options
                    )
                    lengths += output.acceptance_lengths[0]
                    outputs.append(output.sequences)
                    progress.update(1)
                reference = reference or outputs
                rows.append(
                    {
                        "eval_set": name,
                        "pool": pool,
                        "mean_acceptance_length": sum(lengths) / len(lengths),
                        "rounds": len(lengths),
                        "identical_to_pool_0": all(map(torch.equal, outputs, reference)),
                    }
                )
    return rows


def markdown(results: dict) -> str:
    pools = sorted({row["pool"] for row in results["rows"]})
    sets = list(dict.fromkeys(row["eval_set"] for row in results["rows"]))
    tau = {(row["eval_set"], row["pool"]): row["mean_acceptance_length"] for row in results["rows"]}
    lines = [
        f"# Head candidate pool: acceptance of {results['draft']} on {results['target']}",
        "",
        f"Greedy, native engine, {results['limit']} prompts per set, max_new_tokens {results['max_new_tokens']}; "
        + draft_cost.environment_line(results["environment"]),
        "",
        "Mean acceptance length (tau) per pool (0: whole vocabulary); every pool's outputs equal pool 0's: "
        f"{all(row['identical_to_pool_0'] for row in results['rows'])}.",
        "",
        "| eval set | " + " | ".join(f"pool {pool}" for pool in pools) + " |",
        "|---|" + "---:|" * len(pools),
        *(f"| {name} | " + " | ".join(f"{tau[name, pool]:.3f}" for pool in pools) + " |" for name in sets),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    from domino_spec.generation.demo import SHIPPED_DRAFT
    from domino_spec.generation.eval_sets import eval_prompts
    from domino_spec.targets import load_target, prompt_token_ids

    args = parse_args(argv)
    target, tokenizer = load_target(args.target)
    draft_dir = args.draft or SHIPPED_DRAFT
    draft = load_draft(draft_dir, dtype=target.dtype).to(target.device).eval()
    prompts = {
        name: [
            torch.tensor([prompt_token_ids(tokenizer, item["messages"])], device=target.device)
            for item in eval_prompts(name, args.limit)
        ]
        for name in args.eval_sets.split(",")
    }
    results = {
        "target": args.target,
        "draft": os.path.relpath(draft_dir),
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "dtype": str(target.dtype).removeprefix("torch."),  # target's, and the draft's (loaded in it)
        "environment": draft_cost.environment(str(target.device)),
        "rows": pool_acceptance(target, draft, prompts, args.pools, args.max_new_tokens),
    }
    text = markdown(results)
    draft_cost.write_results(results, text, args.output)
    print(text)
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")
    return results


if __name__ == "__main__":
    main()
