"""Render the bench's numbers into the documents that show them, from the results JSON alone.

    python benchmarks/render_docs.py            # rewrite the marked regions in place
    python benchmarks/render_docs.py --check    # exit 1, naming each stale document, when one disagrees

Source: `benchmarks/results/bench_smollm2-135m.json` (what `domino-spec bench` writes as `bench_results.json`).
Targets, each a region between `<!-- NAME:start -->` and `<!-- NAME:end -->`:
- README.md `results-table`: the batch-1 greedy warm rows, one line per eval set;
- README.md `shipped-training`: the steps, examples and CPU-hours behind the shipped draft, from its
  `training_summary.json` (every session's totals, which `ship.py --curve` records from the learning curve);
- BENCHMARKS.md `bench-table`: every batch-1 greedy warm row (the model card's renderer), the settings matrix when the
  bench measured several settings (`bench_report.matrix_table`), the cost model and the task scores;
- BENCHMARKS.md `bench-goals`: the goals, met or not, with the numbers behind each;
- README.md and BENCHMARKS.md `settings-matrix`: from `benchmarks/results/settings_matrix_smollm2-135m.json` (a bench
  over batch sizes, sampling and first calls), each drafting method's speedup and tau per setting;
- the shipped checkpoint: its `bench_results.json` (the JSON without the generated texts, as `ship.py` writes it) and
  its model card's acceptance section (`model_card.acceptance_section`, the section's own markers are its headings).
"""

import argparse
import json
import sys
import textwrap
from pathlib import Path

from domino_spec.generation.bench_report import cost_model_table, matrix_table, speedup_matrix
from domino_spec.training.model_card import acceptance_section, is_batch_1_greedy_warm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_smollm2-135m.json"
MATRIX_RESULTS = ROOT / "benchmarks" / "results" / "settings_matrix_smollm2-135m.json"
CHECKPOINT = ROOT / "checkpoints" / "domino-smollm2-135m"
CARD_SECTION = "## Acceptance and speed"
EVAL_SET_NAMES = {
    "mt-bench": "MT-Bench",
    "humaneval": "HumanEval",
    "humaneval-long": "HumanEval-long",
    "gsm-symbolic": "gsm_symbolic",
    "reasoning-held-out": "held-out reasoning",
}
# The README table's columns: (method, heading), in this order, where the bench ran the method.
SUMMARY_METHODS = (
    ("prompt-lookup", "prompt lookup (`generate`)"),
    ("dflash", "DFlash-only draft"),
    ("domino", "**Domino**, native engine"),
    ("domino-hf", "Domino, `target.generate`"),
    ("domino-alone", "Domino, prompt lookup off"),
)
LINE_WIDTH = 118
TAU_GOALS = {"gsm-symbolic": 2.5}  # tau goal per eval set; the others' is TAU_GOAL
TAU_GOAL = 2.0
SPEEDUP_GOAL, SPEEDUP_GOAL_SETS, HEAD_GOAL = 1.5, 2, 1.15  # 1.5x on two sets; Domino's tau 1.15x DFlash-only's


# ---------------------------------------------------------------------- reading the results


def warm_rows(report: dict) -> dict[tuple[str, str], dict]:
    """The batch-1 greedy warm rows by `(eval_set, method)`, in the order measured."""
    return {(row["eval_set"], row["method"]): row for row in report["results"] if is_batch_1_greedy_warm(row)}


def eval_sets(report: dict) -> list[str]:
    return list(dict.fromkeys(eval_set for eval_set, _ in warm_rows(report)))


def method_values(report: dict, method: str, key: str) -> list[float]:
    """`key` of `method`'s warm row in each eval set that has one, in eval-set order."""
    rows = warm_rows(report)
    return [rows[(name, method)][key] for name in eval_sets(report) if (name, method) in rows]


def identical_counts(report: dict) -> tuple[int, int]:
    """(outputs identical to plain decoding, outputs checked) over every row of every setting."""
    checked = [row for row in report["results"] if row.get("identical") is not None]
    return sum(row["identical"] for row in checked), sum(row["prompts"] for row in checked)


def wrap(paragraph: str, indent: str = "") -> str:
    """A paragraph (or a list item, its later lines indented by `indent`) in lines of the documents' width."""
    return textwrap.fill(
        paragraph, width=LINE_WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def _name(eval_set: str) -> str:
    return EVAL_SET_NAMES.get(eval_set, eval_set)


def _x(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}x" for value in values)


def _plain(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


# ---------------------------------------------------------------------- regions


def caption(report: dict) -> str:
    """What the tables measured, from the report's config, machine and versions."""
    config, machine, versions = report["config"], report["machine"], report["versions"]
    prompts = config["prompts"]
    counts = set(prompts.values())
    which = f"the first {counts.pop()} prompts of each set" if len(counts) == 1 else f"prompts per set: {prompts}"
    identical, checked = identical_counts(report)
    python = f"Python {machine['python']}, " if machine.get("python") else ""
    return (
        f"Batch 1, greedy, after a warm-up: {which}, at most {config['max_new_tokens']} new tokens, "
        f"{config['dtype']} target {'prepared by' if config.get('cpu_optimization') else 'without'} "
        "`optimize_for_cpu`, "
        f"{machine['cpu_threads']} threads of an {machine['processor']} {machine['device'].upper()}, "
        f"{python}torch {versions['torch']}, transformers {versions['transformers']}"
        f"{', beside a low-priority CPU-bound process' if config.get('background_load') else ''}. "
        f"{identical} of {checked} outputs identical to plain decoding."
    )


def summary_table(report: dict) -> str:
    """README's table: per eval set, plain decoding's tokens/s and each method's speedup and tau."""
    rows = warm_rows(report)
    methods = [(method, heading) for method, heading in SUMMARY_METHODS if method_values(report, method, "speedup")]
    lines = [
        "| eval set | plain decoding, tokens/s (native, `generate`) | "
        + " | ".join(heading for _, heading in methods)
        + " |",
        "|---|---:|" + "---:|" * len(methods),
    ]
    for name in eval_sets(report):
        plain = ", ".join(
            f"{rows[(name, method)]['tokens_per_s']:.2f}"
            for method in ("plain-native", "plain")
            if (name, method) in rows
        )
        cells = []
        for method, _ in methods:
            row = rows.get((name, method))
            bold = "**" if method == "domino" else ""
            cells.append(
                "-" if row is None else f"{bold}{row['speedup']:.2f}x{bold}, tau {row['mean_acceptance_length']:.2f}"
            )
        lines.append(f"| {_name(name)} | {plain or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_results(report: dict) -> str:
    text = (
        wrap(
            f"{caption(report)} Speedup over plain decoding in the same engine, and tau (tokens per target "
            "pass, rounds that skipped drafting included):"
        )
        + f"\n\n{summary_table(report)}"
    )
    if len(speedup_matrix(report["results"])[1]) > 1:
        text += "\n\nThis bench also measured other settings: their speedups are in BENCHMARKS.md's settings matrix."
    return text


def matrix_section(report: dict) -> str:
    """The settings matrix of a bench over batch sizes, sampling and first calls, with what it measured."""
    config, machine, versions = report["config"], report["machine"], report["versions"]
    counts = set(config["prompts"].values())
    which = f"the first {counts.pop()} prompts of each set" if len(counts) == 1 else f"prompts {config['prompts']}"
    cold_prompts = "each process on the set's next batch" if config.get("cold_batches") == "next" else "its first batch"
    text = wrap(
        f"Each drafting method's speedup over plain decoding in the same engine and setting, and its tau: {which}, "
        f"at most {config['max_new_tokens']} new tokens, {machine['cpu_threads']} threads of an "
        f"{machine['processor']} {machine['device'].upper()}, torch {versions['torch']}, transformers "
        f"{versions['transformers']}. B: prompts per call. Warm: after a warm-up. Cold: a fresh process's first call "
        f"({cold_prompts}), `optimize_for_cpu` and every set-up of the call included, model loading excluded."
        + (
            f" Every batch ran {config['repeats']} times and every first call in "
            f"{config.get('cold_repeats', config['repeats'])} processes per method, in turn, the order reversed every "
            "other time, their times summed."
            if max(config.get("repeats", 1), config.get("cold_repeats", 1)) > 1
            else ""
        )
    )
    return f"{text}\n\n{matrix_table(report['results'])}"


def card_table(results: list[dict]) -> str:
    """The model card's table of `results` (`model_card.acceptance_section`): the docs and the card share it."""
    section = acceptance_section({"results": results})
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def quality_line(quality: dict) -> str:
    """The task scores of `bench --quality`: one score per set when every method scored the same (lossless)."""
    parts = []
    for eval_set, by_method in quality.items():
        scored = {method: scores["score"] for method, scores in by_method.items() if scores["metric"]}
        if not scored:
            continue
        metric = next(scores["metric"] for scores in by_method.values() if scores["metric"])
        if len(set(scored.values())) == 1:
            parts.append(f"{_name(eval_set)} {metric} {next(iter(scored.values())):.3f} for every method")
        else:
            parts.append(f"{_name(eval_set)} {metric} " + ", ".join(f"{m} {s:.3f}" for m, s in scored.items()))
    return ("Task scores (`--quality`): " + "; ".join(parts) + ".") if parts else ""


def benchmarks_table(report: dict) -> str:
    rows = list(warm_rows(report).values())
    parts = [wrap(caption(report)), card_table(rows)]
    if len(speedup_matrix(report["results"])[1]) > 1:
        parts += [
            "Settings matrix: each drafting method's speedup over plain decoding in the same engine and "
            "setting, and its tau:",
            matrix_table(report["results"]),
        ]
    if report.get("cost_model"):
        parts += [
            "Cost model, measured in the same run (the verify pass over k drafts, one per k):",
            cost_model_table(report["cost_model"]),
        ]
    if report.get("quality"):
        parts.append(quality_line(report["quality"]))
    return "\n\n".join(part for part in parts if part)


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def speed_findings(report: dict) -> list[str]:
    """Domino's speedups in the native engine, beside prompt lookup's, `generate`'s and the draft's alone."""
    speedups = method_values(report, "domino", "speedup")
    looked_up = method_values(report, "domino", "looked_up_fraction")
    sets = ", ".join(_name(name) for name in eval_sets(report) if (name, "domino") in warm_rows(report))
    lines = [
        f"- **Faster than plain decoding on every set in the native engine: "
        f"{_met(all(round(s, 2) > 1 for s in speedups))}** ({_x(speedups)} on {sets}); "
        f"{min(looked_up):.0%}-{max(looked_up):.0%} of its rounds verify looked-up tokens."
    ]
    others = (("prompt-lookup", "transformers' prompt lookup"), ("domino-hf", "Domino through `target.generate`"))
    for method, what in others:
        if method_values(report, method, "speedup"):
            lines.append(f"- {what}: {_x(method_values(report, method, 'speedup'))}.")
    if method_values(report, "domino-alone", "speedup"):
        alone = _x(method_values(report, "domino-alone", "speedup"))
        drafts = _plain(method_values(report, "domino-alone", "drafts_per_round"))
        lines.append(
            f"- The draft alone (`domino-alone`, prompt lookup off): {alone}, verifying {drafts} drafts a round."
        )
    return lines


def goal_findings(report: dict) -> list[str]:
    """The goals on speedup, tau, the head's lead and exactness, met or not."""
    names = [name for name in eval_sets(report) if (name, "domino") in warm_rows(report)]
    speedups = method_values(report, "domino", "speedup")
    taus = method_values(report, "domino", "mean_acceptance_length")
    fast = [_name(name) for name, speedup in zip(names, speedups, strict=True) if round(speedup, 2) >= SPEEDUP_GOAL]
    lines = [
        f"- **{SPEEDUP_GOAL}x on {SPEEDUP_GOAL_SETS} sets: {_met(len(fast) >= SPEEDUP_GOAL_SETS)}** "
        f"({SPEEDUP_GOAL}x or more on: {', '.join(fast) or 'none'})."
    ]
    tau_goals = [TAU_GOALS.get(name, TAU_GOAL) for name in names]
    wanted = ", ".join(f"{_name(name)} >= {goal}" for name, goal in zip(names, tau_goals, strict=True))
    met = all(round(tau, 2) >= goal for tau, goal in zip(taus, tau_goals, strict=True))
    lines.append(f"- **tau {wanted}: {_met(met)}** ({_plain(taus)}).")
    dflash = method_values(report, "dflash", "mean_acceptance_length")
    if len(dflash) == len(taus):
        ratios = [tau / other for tau, other in zip(taus, dflash, strict=True)]
        lines.append(
            f"- **Domino's tau >= {HEAD_GOAL}x the DFlash-only draft's: "
            f"{_met(all(round(r, 2) >= HEAD_GOAL for r in ratios))}** ({_x(ratios)})."
        )
    identical, checked = identical_counts(report)
    lines.append(
        f"- **Every output identical to plain decoding: {_met(identical == checked)}** ({identical} of {checked})."
    )
    return lines


def cost_findings(report: dict) -> list[str]:
    """What the Domino draft's cost model says a round must accept to pay off."""
    terms = (report.get("cost_model") or {}).get("domino")
    if not terms:
        return []
    step, verify, round_ms = terms["decode_ms"], terms["verify_ms"], terms["draft_round_ms"]
    drafts, few = len(verify) - 1, min(2, len(verify) - 1)

    def break_even(k: int) -> float:  # the tau at which a drafted round verifying k drafts costs plain decoding's
        return (round_ms + verify[k]) / step

    steps = ", ".join(f"{ms / step:.2f}" for ms in verify[1:])
    lines = [
        f"- The cost model (Domino): a decode step is {step:.1f} ms; verifying 1..{drafts} drafts costs {steps} "
        f"steps; a draft round {round_ms / step:.2f} of a step, a looked-up round nothing. So a drafted round "
        f"pays off at tau {break_even(few):.2f} with {few} drafts and {break_even(drafts):.2f} with {drafts}, and "
        f"{SPEEDUP_GOAL}x needs tau {SPEEDUP_GOAL * break_even(drafts):.2f} at {drafts} drafts."
    ]
    looked = method_values(report, "prompt-lookup", "drafts_per_round")
    if looked:
        limit = report["config"].get("prompt_lookup_num_tokens")
        lines.append(
            f"- transformers' prompt lookup verifies up to {limit} tokens whenever it finds a match: "
            f"{_plain(looked)} a round here."
        )
    return lines


def goals(report: dict) -> str:
    """BENCHMARKS.md's findings: the goals we set ourselves, met or not, each with its numbers (batch-1 greedy warm
    rows), and the cost model behind them."""
    findings = speed_findings(report) + goal_findings(report) + cost_findings(report)
    return "\n".join(wrap(line, indent="  ") for line in findings)


# ---------------------------------------------------------------------- documents


def replace_region(text: str, name: str, body: str, path: Path) -> str:
    """`text` with the region between `<!-- name:start -->` and `<!-- name:end -->` holding `body`."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"{path}: expected one {start} before one {end}")
    head, rest = text.split(start)
    return f"{head}{start}\n{body}\n{end}{rest.split(end, 1)[1]}"


def replace_card_section(text: str, section: str, path: Path) -> str:
    """The card `text` with its acceptance section (to the next `## ` heading) replaced by `section`."""
    if text.count(CARD_SECTION) != 1:
        raise ValueError(f"{path}: expected one {CARD_SECTION!r} section")
    head, rest = text.split(CARD_SECTION)
    following = rest.find("\n\n## ")  # sections are joined by a blank line, the card ends with a newline
    return head + section + ("\n" if following < 0 else rest[following:])


def training_line(summary: dict) -> str:
    """README's sentence on what trained the shipped draft: its training summary, with the totals of every session
    that `ship.py --curve` recorded from its learning curve."""
    data, curve = summary["data"], summary["curve"]
    return wrap(
        f"The shipped Domino draft trained {curve['step']:,} steps ({curve['examples']:,} examples seen) on "
        f"{data['examples']:,} conversations the target regenerated ({data['response_tokens']:,} response tokens): "
        f"{curve['cpu_hours']:.2f} CPU-hours of training on this machine, every session counted (its learning "
        f"curve: `{curve['results']}`)."
    )


def shipped_results(report: dict) -> str:
    """The checkpoint's `bench_results.json`: the report without the generated texts (`ship.py`'s trimming)."""
    return json.dumps({k: v for k, v in report.items() if k not in ("texts", "references")}, indent=1)


def rendered(
    report: dict, root: Path = ROOT, checkpoint: Path = CHECKPOINT, matrix: dict | None = None
) -> dict[Path, str]:
    """Every document's text as the results JSON (and the settings matrix's, where given) says it should read."""
    readme, benchmarks = root / "README.md", root / "BENCHMARKS.md"
    training = json.loads((checkpoint / "training_summary.json").read_text())
    documents = {
        readme: replace_region(
            replace_region(readme.read_text(), "results-table", readme_results(report), readme),
            "shipped-training",
            training_line(training),
            readme,
        ),
        benchmarks: replace_region(
            replace_region(benchmarks.read_text(), "bench-table", benchmarks_table(report), benchmarks),
            "bench-goals",
            goals(report),
            benchmarks,
        ),
    }
    if matrix is not None:
        for path in (readme, benchmarks):
            documents[path] = replace_region(documents[path], "settings-matrix", matrix_section(matrix), path)
    card = checkpoint / "README.md"
    trimmed = json.loads(shipped_results(report))
    documents[card] = replace_card_section(card.read_text(), acceptance_section(trimmed), card)
    documents[checkpoint / "bench_results.json"] = shipped_results(report)
    return documents


def stale(documents: dict[Path, str]) -> list[Path]:
    return [path for path, text in documents.items() if path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="the bench's results JSON")
    parser.add_argument("--matrix-results", type=Path, default=MATRIX_RESULTS, help="the settings matrix's JSON")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a document is stale")
    args = parser.parse_args(argv)
    matrix = json.loads(args.matrix_results.read_text())
    documents = rendered(json.loads(args.results.read_text()), matrix=matrix)
    outdated = stale(documents)
    if args.check:
        for path in outdated:
            print(f"{path.relative_to(ROOT)} disagrees with {args.results.name}: run python benchmarks/render_docs.py")
        return 1 if outdated else 0
    for path in outdated:
        path.write_text(documents[path])
        print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
