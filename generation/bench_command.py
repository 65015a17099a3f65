"""`domino-spec bench`: the command line of the benchmark harness (`bench.py`).

    domino-spec bench [--target DIR] [--domino DIR] [--eval-sets ...] [--limit N] [--quality [--allow-code-execution]]
"""

import argparse

from ..drafting import DRAFT_LENGTHS, DraftingOptions
from ..modeling_domino import DominoDraftModel
from ..published_format import check_draft_folder, draft_config
from ..targets import load_target
from .bench import DRAFT_OF, METHODS, run_bench, write_results
from .cpu import optimize_for_cpu
from .demo import SHIPPED_DRAFT
from .eval_sets import EVAL_SETS, eval_prompts


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="domino-spec bench", description="Evaluation sets x decoding methods, greedy.")
    parser.add_argument("--target", default="smollm2-135m", help="target model folder or asset name")
    parser.add_argument("--domino", default=None, help="Domino draft folder (default: the shipped SmolLM2 draft)")
    parser.add_argument("--dflash", default=None, help="DFlash-only draft folder (head off), for the dflash method")
    parser.add_argument("--eval-sets", default=",".join(EVAL_SETS), help=f"comma-separated from {EVAL_SETS}")
    parser.add_argument(
        "--methods", default=",".join(name for name in METHODS if name != "plain-eager"),
        help=f"comma-separated from {', '.join(METHODS)}; the plain decodings a method is measured against (plain, "
        "plain-native for the native engine's methods, plain-eager on a prepared CPU target) are added when missing",
    )  # fmt: skip
    parser.add_argument(
        "--no-cpu-optimization", action="store_true",
        help="time eager nn.Linear on CPU instead of preparing the target and drafts with optimize_for_cpu",
    )  # fmt: skip
    parser.add_argument(
        "--draft-length", choices=DRAFT_LENGTHS, default="auto",
        help="drafts verified per round: cost (as many as pay, the cost model measured here), full (every draft), "
        "auto (cost on CPU, full elsewhere)",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-lookup", type=int, default=DraftingOptions.prompt_lookup, metavar="N",
        help="with a cost-aware draft length, verify the tokens that followed an earlier occurrence of the last N "
        "tokens (or fewer) instead of drafting, in rounds where that pays; 0: every round drafts",
    )  # fmt: skip
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each set (quick runs)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--quality", action="store_true", help="also score every method's outputs with evaluate")
    parser.add_argument(
        "--allow-code-execution", action="store_true",
        help="let --quality score HumanEval by running the model-written programs here, sandboxed (README: what the "
        "sandbox isolates; it is not a security boundary). HF_ALLOW_CODE_EVAL=1 allows it too",
    )  # fmt: skip
    parser.add_argument("--output", default="runs/bench", help="folder for bench_results.{json,md} and the figure")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_arguments(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    eval_sets = [name for name in args.eval_sets.split(",") if name]
    if args.quality:  # before any model loads or decodes
        from .quality import require_code_execution

        require_code_execution(args.allow_code_execution, eval_sets)
    needed = {DRAFT_OF[method] for method in methods if method in DRAFT_OF}
    folders = {name: folder for name, folder in (("domino", args.domino or SHIPPED_DRAFT), ("dflash", args.dflash))
               if folder and name in needed}  # fmt: skip
    for name, folder in folders.items():
        check_draft_folder(folder, f"--{name}")
    if "dflash" in folders and draft_config(folders["dflash"])[0].use_domino_head:
        raise ValueError(f"--dflash {args.dflash} has a Domino head: the dflash method measures a backbone-only draft "
                         "(train one with --use_domino_head false).")  # fmt: skip
    target, tokenizer = load_target(args.target)
    drafts = {name: DominoDraftModel.from_pretrained(folder, dtype=target.dtype).to(target.device).eval()
              for name, folder in folders.items()}  # fmt: skip
    for draft in drafts.values():
        draft.drafting_options = DraftingOptions(draft_length=args.draft_length, prompt_lookup=args.prompt_lookup)
    optimization = None
    if target.device.type == "cpu" and not args.no_cpu_optimization:
        print("preparing the target and drafts for multi-token passes on this CPU (optimize_for_cpu)", flush=True)
        optimization = optimize_for_cpu(target, *drafts.values())
    prompts = {name: eval_prompts(name, args.limit) for name in eval_sets}
    report = run_bench(target, tokenizer, drafts, prompts, methods, args.max_new_tokens, optimization=optimization)
    if args.quality:
        from .quality import score_report

        report["quality"] = score_report(report, allow_code_execution=args.allow_code_execution)
    paths = write_results(report, args.output)
    with open(paths["results.md"], encoding="utf-8") as file:
        print(file.read())
    print("wrote " + ", ".join(paths.values()))
