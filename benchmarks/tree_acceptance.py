"""How many tokens a verify pass commits with trees against chains: the draft's acceptance, no timing.

    python benchmarks/tree_acceptance.py --output benchmarks/results/tree_acceptance_smollm2-135m.json
    python benchmarks/tree_acceptance.py --temperature 0.7 --top-p 0.9 --output tree_acceptance_sampled.json

Greedy decoding (or, with `--temperature`, sampling from one seeded generator per prompt) of a draft (`--draft`, the
shipped one by default) in the native engine, per evaluation set (the bench's, and held-out reasoning prompts:
reasoning-gym tasks no draft trained on), in four ways:
- `chain`: every round verifies the whole block (`draft_length="full"`, prompt lookup off), the draft alone;
- `tree N`: a tree of N nodes instead (`tree_nodes=N`), for each N in `--tree-nodes`;
- `chain + lookup` and `tree N + lookup`: the same with prompt lookup, under costs that make every round draft and
  every node verified, so the counts do not depend on this machine's timings.

Each variant's tau (tokens committed per verify pass), nodes verified per round, and the rounds whose accepted path
left the draft's likeliest branch or took a looked-up node, and, greedy, whether its outputs equal the chain's (every
variant is greedy decoding, so they must). Writes JSON and Markdown. Timing and speed: `domino-spec bench --methods
domino,domino-tree`.
"""

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from domino_spec import DraftCosts, DraftingOptions
from domino_spec.generation.bench import tokenized_prompts
from domino_spec.generation.engine import speculative_generate
from domino_spec.generation.eval_sets import EVAL_SETS, HELD_OUT_EVAL_SETS, eval_prompts
from domino_spec.published_format import load_draft
from domino_spec.targets import eos_token_ids, load_target

ROOT = Path(__file__).resolve().parents[1]
# Every round drafts (drafting costs nothing next to a plain step) and every node is verified (a flat verify cost).
FLAT_COSTS = DraftCosts(verify_seconds=(1.0,) * 65, draft_seconds=0.01)


def variants(tree_nodes: list[int]) -> dict[str, DraftingOptions]:
    chains = {"chain": DraftingOptions(draft_length="full", prompt_lookup=0, tree_nodes=0)}
    trees = {f"tree {n}": DraftingOptions(draft_length="full", prompt_lookup=0, tree_nodes=n) for n in tree_nodes}
    looked_up = {
        f"{name} + lookup": DraftingOptions(
            draft_length="cost", draft_costs=FLAT_COSTS, prompt_lookup=3, tree_nodes=options.tree_nodes
        )
        for name, options in (chains | trees).items()
    }
    return chains | trees | looked_up


def measure(
    target,
    draft,
    prompts: list[list[int]],
    options: DraftingOptions,
    max_new_tokens: int,
    eos,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int = 0,
) -> dict:
    committed = rounds = nodes = branch_wins = lookup_wins = 0
    outputs = []
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {}
    for index, prompt in enumerate(prompts):
        output = speculative_generate(
            target,
            draft,
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            options=options,
            generator=torch.Generator().manual_seed(seed + index),
            **sampling,
        )
        lengths = output.acceptance_lengths[0]
        committed, rounds = committed + sum(lengths), rounds + len(lengths)
        nodes += output.drafts_verified
        branch_wins, lookup_wins = branch_wins + output.branch_wins, lookup_wins + output.lookup_wins
        outputs.append(output.sequences[0, len(prompt) :].tolist())
    return {
        "tau": round(committed / rounds, 3),
        "nodes_per_round": round(nodes / rounds, 2),
        "rounds": rounds,
        "branch_wins": branch_wins,
        "lookup_wins": lookup_wins,
        "outputs": outputs,
    }


def draft_folder(path: str) -> str:
    """`path` relative to the repository where it lies in it (the shipped draft: `checkpoints/...`)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path


def markdown(report: dict) -> str:
    settings = report["settings"]
    names = list(next(iter(report["results"].values())))
    decoding = "greedy" if float(settings["temperature"]) == 0 else f"temperature {settings['temperature']}"
    decoding += "" if settings["top_p"] == "None" else f", top-p {settings['top_p']}"
    lines = [
        f"# Trees against chains: tau of the draft in `{draft_folder(settings['draft'])}` ({settings['target']}), "
        f"{decoding}, the first "
        f"{settings['limit']} prompts of each set, at most {settings['max_new_tokens']} new tokens",
        "",
        f"torch {report['versions']['torch']}, transformers {report['versions']['transformers']}. Each cell: tau "
        "(tokens per verify pass), its ratio to the chain's of the same prompt lookup setting, nodes verified per "
        "round; rounds whose accepted path left the draft's likeliest branch / took a looked-up node.",
        "",
        "| eval set | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for eval_set, results in report["results"].items():
        cells = []
        for name in names:
            result = results[name]
            chain = results["chain + lookup" if name.endswith("+ lookup") else "chain"]
            ratio = result["tau"] / chain["tau"]
            same = "" if result["identical_to_chain"] in (True, None) else ", OUTPUTS DIFFER"
            cells.append(
                f"{result['tau']:.2f} ({ratio:.2f}x), {result['nodes_per_round']:.1f} nodes; "
                f"{result['branch_wins']} / {result['lookup_wins']}{same}"
            )
        lines.append(f"| {eval_set} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=str(ROOT / "checkpoints" / "domino-smollm2-135m"))
    parser.add_argument("--eval-sets", default=",".join(EVAL_SETS + HELD_OUT_EVAL_SETS))
    parser.add_argument("--limit", type=int, default=8, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--tree-nodes", default="8,16", help="comma-separated tree budgets")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sample at this temperature")
    parser.add_argument("--top-p", type=float, default=None, help="with --temperature: nucleus sampling")
    parser.add_argument("--seed", type=int, default=0, help="with --temperature: prompt i samples with seed + i")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "tree_acceptance.json")
    args = parser.parse_args(argv)

    target, tokenizer = load_target(args.target)
    draft = load_draft(args.draft, dtype=target.dtype).eval()
    eos = eos_token_ids(target, tokenizer)
    eval_sets = [name for name in args.eval_sets.split(",") if name]
    prompts = {name: eval_prompts(name, args.limit) for name in eval_sets}
    prompt_ids = tokenized_prompts(tokenizer, prompts)
    report = {
        "settings": {key: str(value) for key, value in vars(args).items()},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "results": {},
    }
    all_variants = variants([int(n) for n in args.tree_nodes.split(",") if n])
    with tqdm(total=len(eval_sets) * len(all_variants), desc="variants") as progress:
        for eval_set in eval_sets:
            results = {}
            for name, options in all_variants.items():
                results[name] = measure(
                    target,
                    draft,
                    prompt_ids[eval_set],
                    options,
                    args.max_new_tokens,
                    eos,
                    args.temperature,
                    args.top_p,
                    args.seed,
                )
                progress.update()
            greedy = args.temperature == 0  # sampled outputs differ with the tokens each round draws
            for result in results.values():
                result["identical_to_chain"] = result["outputs"] == results["chain"]["outputs"] if greedy else None
            report["results"][eval_set] = results
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(report, indent=1))  # what is measured so far survives an interruption
    text = markdown(report)
    args.output.with_suffix(".md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
