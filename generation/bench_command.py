"""`domino-spec bench`: the command line of the benchmark harness (`bench.py`).

    domino-spec bench [--target DIR] [--domino DIR] [--eval-sets ...] [--limit N] [--quality [--allow-code-execution]]
                      [--batch-sizes 1,4,12] [--temperature 0,0.7 [--top-p P] [--top-k K] [--seed S]] [--cold]
                      [--background-load] [--repeats N] [--cold-repeats N]

The settings matrix: every batch size x every temperature (0: greedy), each cell a speedup over plain decoding in
the same engine and setting, with tau; `--cold` adds each method's first call in a fresh process beside the warm
runs, and `--background-load` runs the whole bench beside a low-priority CPU-bound process.
"""

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from ..cost_aware import save_learned_costs
from ..drafting import DRAFT_LENGTHS, DraftingOptions
from ..published_format import check_draft_folder, draft_config, load_draft
from ..targets import eos_token_ids, load_target
from .bench import DRAFT_OF, METHODS, NATIVE_METHODS, Setting, run_bench, tokenized_prompts
from .bench_report import write_results
from .cold_start import cold_results
from .cpu import optimize_for_cpu
from .demo import SHIPPED_DRAFT
from .eval_sets import ALL_EVAL_SETS, EVAL_SETS, eval_prompts


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="domino-spec bench", description="Evaluation sets x decoding methods x settings (batch size, sampling)."
    )
    parser.add_argument("--target", default="smollm2-135m", help="target model folder or asset name")
    parser.add_argument("--domino", default=None, help="Domino draft folder (default: the shipped SmolLM2 draft)")
    parser.add_argument("--dflash", default=None, help="DFlash-only draft folder (head off), for the dflash method")
    parser.add_argument("--eval-sets", default=",".join(EVAL_SETS), help=f"comma-separated from {ALL_EVAL_SETS}")
    parser.add_argument(
        "--methods",
        default=",".join(name for name in METHODS if name != "plain-eager"),
        help=f"comma-separated from {', '.join(METHODS)}; the plain decodings a method is measured against (plain, "
        "plain-native for the native engine's methods, plain-eager on a prepared CPU target) are added when missing",
    )
    parser.add_argument(
        "--no-cpu-optimization",
        action="store_true",
        help="time eager nn.Linear on CPU instead of preparing the target and drafts with optimize_for_cpu",
    )
    parser.add_argument(
        "--draft-length",
        choices=DRAFT_LENGTHS,
        default="auto",
        help="drafts verified per round: cost (as many as pay, by the costs learned from the run's own rounds), "
        "full (every draft), auto (cost on CPU, full elsewhere)",
    )
    parser.add_argument(
        "--prompt-lookup",
        type=int,
        default=DraftingOptions.prompt_lookup,
        metavar="N",
        help="with a cost-aware draft length, verify the tokens that followed an earlier occurrence of the last N "
        "tokens (or fewer) instead of drafting, in rounds where that pays; 0: every round drafts",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each set (quick runs)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--quality", action="store_true", help="also score every method's outputs with evaluate")
    parser.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="let --quality score HumanEval by running the model-written programs here, sandboxed (README: what the "
        "sandbox isolates; it is not a security boundary). HF_ALLOW_CODE_EVAL=1 allows it too",
    )
    parser.add_argument(
        "--batch-sizes",
        default="1",
        metavar="B,...",
        help="comma-separated prompts per call: the native engine's methods decode the prompts in left-padded "
        "batches of each size, against plain-native at that size (transformers' methods run at batch 1 only)",
    )
    parser.add_argument(
        "--temperature",
        default="0",
        metavar="T,...",
        help="comma-separated sampling temperatures, 0 for greedy: each is a setting (sampled outputs are not "
        "compared; transformers' methods run greedy only)",
    )
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling of the sampled settings")
    parser.add_argument("--top-k", type=int, default=None, help="top-k sampling of the sampled settings")
    parser.add_argument("--seed", type=int, default=0, help="seed of each sampled method's generator")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="also time each method's first call in a fresh process (one per method, setting, eval set and cold "
        "repeat, each repeat on the set's next batch): model loading excluded, optimize_for_cpu (with the kernel "
        "plans the warm run cached on disk) and the first call's set-up included",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="decode every batch N times per method (and with --cold, start N fresh processes per method), in turn, "
        "the order reversed every other time: more samples of each cell where one call is short next to the "
        "machine's noise (a wide batch is a single call per set)",
    )
    parser.add_argument(
        "--cold-repeats",
        type=int,
        default=None,
        metavar="N",
        help="with --cold, start N fresh processes per method (default: --repeats): a process's speed varies more "
        "than a call's within one process",
    )
    parser.add_argument(
        "--background-load",
        action="store_true",
        help="run the whole bench beside a low-priority (nice 19) CPU-bound process, as on a machine in use",
    )
    parser.add_argument("--output", default="runs/bench", help="folder for bench_results.{json,md} and the figures")
    return parser.parse_args(argv)


def comma_separated(flag: str, text: str, kind: type, minimum: float) -> list:
    """The values of a comma-separated flag, each at least `minimum`; `ValueError` naming the flag otherwise."""
    try:
        values = [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise ValueError(
            f"{flag} {text}: expected comma-separated {kind.__name__}s of at least {minimum:g}, e.g. "
            f"{flag} {'1,4,12' if kind is int else '0,0.7'}."
        )
    return list(dict.fromkeys(values))


def settings_of(args: argparse.Namespace) -> list[Setting]:
    """The settings matrix of the flags, checked before anything loads: every temperature x every batch size."""
    batch_sizes = comma_separated("--batch-sizes", args.batch_sizes, int, 1)
    temperatures = comma_separated("--temperature", args.temperature, float, 0)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p}: must be in (0, 1].")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k {args.top_k}: must be at least 1.")
    if (args.top_p is not None or args.top_k is not None) and max(temperatures) == 0:
        raise ValueError("--top-p and --top-k apply to sampling: add a sampling temperature, e.g. --temperature 0,0.7.")
    for flag, value in (
        ("--max-new-tokens", args.max_new_tokens),
        ("--limit", args.limit),
        ("--repeats", args.repeats),
        ("--cold-repeats", args.cold_repeats),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1.")
    return [
        Setting(batch_size, temperature, args.top_p, args.top_k, args.seed)
        for temperature in temperatures
        for batch_size in batch_sizes
    ]


# A CPU-bound loop at the lowest priority that ends with the bench: it spins while its parent lives, looking every
# million iterations (tens of ms), so a bench killed without cleaning up leaves none behind.
BUSY_LOOP = (
    "import os, sys\nos.nice(19)\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n"
    "    for _ in range(1_000_000):\n        pass\n"
)


@contextlib.contextmanager
def background_load(enabled: bool = True) -> Iterator[subprocess.Popen | None]:
    """A low-priority (nice 19) CPU-bound process for the duration of the block, stopped however the block ends."""
    if not enabled:
        yield None
        return
    process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def main(argv: list[str]) -> None:
    args = parse_arguments(argv)
    settings = settings_of(args)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    eval_sets = [name for name in args.eval_sets.split(",") if name]
    if args.quality:  # before any model loads or decodes
        from .quality import require_code_execution

        require_code_execution(args.allow_code_execution, eval_sets)
    needed = {DRAFT_OF[method] for method in methods if method in DRAFT_OF}
    folders = {
        name: folder
        for name, folder in (("domino", args.domino or SHIPPED_DRAFT), ("dflash", args.dflash))
        if folder and name in needed
    }
    for name, folder in folders.items():
        check_draft_folder(folder, f"--{name}")
    if "dflash" in folders and draft_config(folders["dflash"])[0].use_domino_head:
        raise ValueError(
            f"--dflash {args.dflash} has a Domino head: the dflash method measures a backbone-only draft "
            "(train one with --use_domino_head false)."
        )
    skipped = [method for method in methods if method not in NATIVE_METHODS]
    if skipped and not any(setting.batch_size == 1 and setting.greedy for setting in settings):
        print(
            f"{', '.join(skipped)}: transformers' methods run at batch 1, greedy only, which these settings leave out",
            flush=True,
        )
    prompts = {name: eval_prompts(name, args.limit) for name in eval_sets}
    widest = max(setting.batch_size for setting in settings)
    for name, items in prompts.items():
        if len(items) < widest:
            raise ValueError(
                f"--batch-sizes {widest}: {name} has {len(items)} prompts"
                f"{f' (--limit {args.limit})' if args.limit else ''}, so its batch would hold {len(items)} rows; pass "
                f"--limit {widest} or more, or a smaller batch size."
            )
    with background_load(args.background_load):
        report = bench_report(args, settings, methods, folders, prompts)
    if args.quality:
        from .quality import score_report

        report["quality"] = score_report(report, allow_code_execution=args.allow_code_execution)
    paths = write_results(report, args.output)
    with open(paths["results.md"], encoding="utf-8") as file:
        print(file.read())
    print("wrote " + ", ".join(paths.values()))


def bench_report(
    args: argparse.Namespace,
    settings: list[Setting],
    methods: list[str],
    folders: dict[str, str],
    prompts: dict[str, list[dict]],
) -> dict:
    """Load the models, run the bench in every setting (and, with `--cold`, every first call in a fresh process);
    the report, every row with its settings as columns."""
    target, tokenizer = load_target(args.target)
    drafts = {name: load_draft(folder, dtype=target.dtype).to(target.device).eval() for name, folder in folders.items()}
    drafting_options = DraftingOptions(draft_length=args.draft_length, prompt_lookup=args.prompt_lookup)
    for draft in drafts.values():
        draft.drafting_options = drafting_options
    optimization = None
    if target.device.type == "cpu" and not args.no_cpu_optimization:
        print("preparing the target and drafts for multi-token passes on this CPU (optimize_for_cpu)", flush=True)
        optimization = optimize_for_cpu(target, *drafts.values())
    report = run_bench(
        target,
        tokenizer,
        drafts,
        prompts,
        methods,
        args.max_new_tokens,
        optimization=optimization,
        settings=settings,
        repeats=args.repeats,
    )
    cold_repeats = args.repeats if args.cold_repeats is None else args.cold_repeats
    if args.cold:
        save_learned_costs()  # the costs the cold processes start from: what the warm run learned
        measured = report["config"]["methods"]  # with the baselines run_bench added
        prompt_ids = tokenized_prompts(tokenizer, prompts)
        report["results"] += cold_results(
            args.target,
            folders,
            drafting_options,
            prompt_ids,
            measured,
            settings,
            args.max_new_tokens,
            eos_token_ids(target, tokenizer),
            prepared=optimization is not None,
            repeats=cold_repeats,
        )
    for row in report["results"]:
        row["background_load"] = args.background_load
    report["config"].update(cold=args.cold, cold_repeats=cold_repeats, background_load=args.background_load)
    if args.cold:
        report["config"]["cold_batches"] = "next"  # each cold repeat on the set's next batch (`first_call_prompts`)
    return report
