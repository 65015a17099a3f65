"""`domino-spec bench`: evaluation sets x decoding methods in one run, greedy, every output checked against plain.

Methods:
  plain          target.generate(do_sample=False): the reference of every output check, the speedup baseline of
                 transformers' paths
  plain-eager    target.generate on the target as loaded, without `optimize_for_cpu`: what a user gets today
  plain-native   the target alone in the native engine: the speedup baseline of the native engine's methods
  prompt-lookup  transformers' prompt-lookup decoding (no draft model)
  dflash         the DFlash-only draft (head off) in the native engine
  domino-hf      Domino through target.generate(assistant_model=draft)
  domino         Domino in the native engine

On CPU the target and the drafts are prepared with `optimize_for_cpu` first (every method but plain-eager runs on
them), so each speedup is reported twice: over plain decoding in the same engine and preparation (`speedup`), and
over eager `target.generate` (`speedup_over_eager`).

Acceptance length tau = tokens committed per target verify pass, over the passes that follow the prefill (Domino's
prefill only yields the first token; prompt lookup drafts already at the prefill, so all its passes count). The
native engine reports its rounds; for transformers' paths the target's forward calls are counted, and the drafts
each verified (its input length but the anchor).
"""

import contextlib
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import zip_longest

import torch
import transformers
from tqdm.auto import tqdm

from ..targets import eos_token_ids, prompt_token_ids
from ..drafting import learned_costs
from .cpu import CPUOptimization
from .engine import DeviceClock, pooled_position_rates, speculative_generate

# What each method decodes with, as results and model cards name it.
METHODS = {
    "plain": "the target alone, `target.generate`",
    "plain-eager": "the target alone, `target.generate`, without `optimize_for_cpu`",
    "plain-native": "the target alone in the native engine, the baseline of the native engine's methods",
    "prompt-lookup": "transformers' prompt lookup decoding",
    "dflash": "a backbone-only (DFlash) draft",
    "domino-hf": "the Domino draft through `target.generate(assistant_model=draft)`",
    "domino": "the Domino draft in the native engine",
    "domino-alone": "the Domino draft in the native engine with prompt lookup off: every round drafted",
}
NATIVE_METHODS = ("plain-native", "dflash", "domino", "domino-alone")  # speculative_generate, against plain-native
# the --dflash / --domino draft each uses
DRAFT_OF = {"dflash": "dflash", "domino": "domino", "domino-hf": "domino", "domino-alone": "domino"}
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens
WARMUP_TOKENS = 16  # an untimed decode per method before the timed ones


@dataclass
class MethodRun:
    """Totals of one method on one evaluation set."""

    seconds: float = 0.0
    new_tokens: int = 0
    verified_tokens: int = 0  # tokens committed by verify passes (tau's numerator)
    verify_passes: int = 0
    drafts_verified: int = 0  # drafts the verify passes read (with the cost-aware length, fewer than the block's)
    looked_up_rounds: int | None = None  # native engine: verify passes of looked-up tokens (prompt lookup)
    round_lengths: list[int] = field(default_factory=list)  # native engine: tokens committed per round
    position_accepted: list[int] = field(default_factory=list)  # native engine: rounds accepting the k-th draft
    position_verified: list[int] = field(default_factory=list)  # and rounds verifying one, per draft position
    identical: int = 0
    prompts: int = 0
    texts: list[str] = field(default_factory=list)

    def add_position_counts(self, accepted: list[int], verified: list[int]) -> None:
        self.position_accepted = [a + b for a, b in zip_longest(self.position_accepted, accepted, fillvalue=0)]
        self.position_verified = [a + b for a, b in zip_longest(self.position_verified, verified, fillvalue=0)]

    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds else None

    def speedup(self, baseline: "MethodRun") -> float | None:
        """Tokens/s over `baseline`'s. Throughput, not time: a method whose outputs differ may decode more or fewer
        tokens."""
        tokens_per_s, baseline_tokens_per_s = self.tokens_per_s(), baseline.tokens_per_s()
        return round(tokens_per_s / baseline_tokens_per_s, 3) if tokens_per_s and baseline_tokens_per_s else None

    def summary(self, baseline: "MethodRun", eager: "MethodRun") -> dict:
        """Totals, tau and the speedups over `baseline` (plain decoding in the same engine) and `eager` (eager
        `target.generate`)."""
        tau = self.verified_tokens / self.verify_passes if self.verify_passes else float("nan")
        tokens_per_s = self.tokens_per_s()
        return {
            "prompts": self.prompts,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(tokens_per_s, 3) if tokens_per_s else None,
            "speedup": self.speedup(baseline),
            "speedup_over_eager": self.speedup(eager),
            "mean_acceptance_length": round(tau, 3),
            "verified_tokens": self.verified_tokens,  # tau = verified_tokens / verify_passes
            "verify_passes": self.verify_passes,
            "drafts_per_round": round(self.drafts_verified / self.verify_passes, 3) if self.verify_passes else None,
            "looked_up_fraction": (round(self.looked_up_rounds / self.verify_passes, 3)
                                   if self.verify_passes and self.looked_up_rounds is not None else None),  # fmt: skip
            "position_acceptance": pooled_position_rates(self.position_accepted, self.position_verified),
            "acceptance_histogram": {str(n): self.round_lengths.count(n) for n in sorted(set(self.round_lengths))},
            "identical": self.identical,
            "identical_fraction": self.identical / self.prompts if self.prompts else None,
        }


class ForwardCounter:
    """Records a model's forward calls, each a prefill or a verify pass, by the tokens each reads."""

    def __init__(self, model: torch.nn.Module):
        self.lengths: list[int] = []
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(input_ids.shape[-1])

    def close(self) -> None:
        self._handle.remove()


def decode(method: str, target, drafts: dict, input_ids, max_new_tokens: int, eos: list[int], run: MethodRun,
           optimization: CPUOptimization | None = None) -> list[int]:  # fmt: skip
    """Decode one prompt (batch 1) with `method`, adding its time and acceptance to `run`; returns the new tokens.
    `optimization` is suspended for `plain-eager`."""
    clock = DeviceClock(input_ids.device)  # a GPU decode is timed to its last kernel
    if method in NATIVE_METHODS:
        start = clock()
        draft = drafts[DRAFT_OF[method]] if method in DRAFT_OF else None
        options = replace(draft.drafting_options, prompt_lookup=0) if method == "domino-alone" else None
        output = speculative_generate(target, draft, input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                      options=options)  # fmt: skip
        run.seconds += clock() - start
        tokens = output.sequences[0, input_ids.shape[1] :].tolist()[: output.num_new_tokens[0]]
        run.round_lengths += output.acceptance_lengths[0]
        run.add_position_counts(output.position_accepted.tolist(), output.position_verified.tolist())
        run.verified_tokens += sum(output.acceptance_lengths[0])
        run.verify_passes += len(output.acceptance_lengths[0])
        run.drafts_verified += output.drafts_verified
        run.looked_up_rounds = (run.looked_up_rounds or 0) + output.looked_up_rounds
        return tokens
    extra = {
        "plain": {},
        "plain-eager": {},
        "prompt-lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS},
        "domino-hf": {"assistant_model": drafts.get(DRAFT_OF["domino-hf"])},
    }[method]
    eager = optimization.suspended() if method == "plain-eager" and optimization else contextlib.nullcontext()
    counter = ForwardCounter(target)
    with eager:
        start = clock()
        sequences = target.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **extra,
        )
        run.seconds += clock() - start
    counter.close()
    tokens = sequences[0, input_ids.shape[1] :].tolist()
    prefill_counts = method != "prompt-lookup"
    verify_lengths = counter.lengths[1:]  # after the prefill, each pass reads the anchor and the drafts
    run.verify_passes += len(counter.lengths) - int(prefill_counts)
    run.verified_tokens += len(tokens) - int(prefill_counts)
    run.drafts_verified += sum(length - 1 for length in verify_lengths)
    return tokens


def with_baselines(methods: Sequence[str], prepared: bool = False) -> list[str]:
    """`methods` with the plain decodings they are measured against, added where missing: `plain` (the reference
    of every output check and the speedup baseline of transformers' paths), for the native engine's methods
    `plain-native`, and on a `prepared` (`optimize_for_cpu`) target `plain-eager`."""
    needed = ["plain"] + (["plain-native"] if set(methods) & set(NATIVE_METHODS) else [])
    needed += ["plain-eager"] if prepared else []
    return [*(baseline for baseline in needed if baseline not in methods), *methods]


def run_bench(
    target,
    tokenizer,
    drafts: dict,
    prompts: dict[str, list[dict]],
    methods: Sequence[str] = tuple(METHODS),
    max_new_tokens: int = 256,
    thinking: bool | None = None,
    optimization: CPUOptimization | None = None,
) -> dict:
    """Every method on every prompt (`{eval_set: eval_prompts(eval_set)}`), with the baselines they need added
    (`with_baselines`), on the target and drafts `optimization` prepared, if any; returns what `write_results`
    writes, with the cost model of each draft as its batch-1 rounds learned it in this run (`drafting.learned_costs`)."""
    missing = [m for m in methods if m in DRAFT_OF and drafts.get(DRAFT_OF[m]) is None]
    if missing:
        raise ValueError(f"methods {missing} need a draft: pass --domino DIR and/or --dflash DIR, or drop them")
    methods = with_baselines(methods, prepared=optimization is not None)
    eos = eos_token_ids(target, tokenizer)
    eval_sets = list(prompts)
    runs = {name: {method: MethodRun() for method in methods} for name in eval_sets}

    def prompt_ids(item: dict) -> torch.Tensor:
        return torch.tensor([prompt_token_ids(tokenizer, item["messages"], thinking)], device=target.device)

    warmup_ids = prompt_ids(next(item for items in prompts.values() for item in items))
    for method in methods:  # untimed: no method pays the one-off costs of a first call (allocations, kernel choice)
        decode(method, target, drafts, warmup_ids, WARMUP_TOKENS, eos, MethodRun(), optimization)
    progress = tqdm(total=sum(len(p) for p in prompts.values()) * len(methods), desc="bench", unit="decode")
    for name, items in prompts.items():
        for item in items:
            input_ids = prompt_ids(item)
            reference = None
            for method in sorted(methods, key=lambda name: name != "plain"):  # plain first: it is the reference
                run = runs[name][method]
                tokens = decode(method, target, drafts, input_ids, max_new_tokens, eos, run, optimization)
                reference = tokens if method == "plain" else reference
                run.prompts += 1
                run.new_tokens += len(tokens)
                run.identical += int(tokens == reference)
                run.texts.append(tokenizer.decode(tokens, skip_special_tokens=True))
                progress.update(1)
    progress.close()
    results = []
    for name in eval_sets:
        for method in methods:
            # Each engine against its own plain decoding: the native loop and generate's differ in overhead.
            baseline = runs[name]["plain-native" if method in NATIVE_METHODS else "plain"]
            eager = runs[name]["plain-eager" if optimization is not None else "plain"]
            results.append({"eval_set": name, "method": method, **runs[name][method].summary(baseline, eager)})
    return {
        "results": results,
        "cost_model": {name: cost_model(target, draft) for name, draft in drafts.items() if draft is not None},
        "config": {"prompts": {n: len(p) for n, p in prompts.items()}, "max_new_tokens": max_new_tokens,
                   "methods": list(methods), "method_descriptions": {m: METHODS[m] for m in methods}, "greedy": True,
                   "target": target.name_or_path,
                   "drafts": {name: draft.name_or_path for name, draft in drafts.items() if draft is not None},
                   "dtype": str(target.dtype).removeprefix("torch."),
                   "cpu_optimization": optimization is not None,
                   "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS, "warmup_tokens": WARMUP_TOKENS},
        "machine": machine_description(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "texts": {name: {m: runs[name][m].texts for m in methods} for name in eval_sets},
        "references": {name: [item["reference"] for item in prompts[name]] for name in eval_sets},
    }


def cost_model(target, draft) -> dict:
    """The terms of a batch-1 round's cost, in milliseconds, as the cost-aware draft length learned and weighed them
    by the end of this run: the decode step (a pass over one token), a verify pass over the anchor and k drafts
    (k = 0..S; counts never verified are the prior's guess), a drafting round."""
    costs = learned_costs(target, draft)(1).costs()
    return {
        "decode_ms": round(1000 * costs.verify_seconds[0], 3),
        "verify_ms": [round(1000 * seconds, 3) for seconds in costs.verify_seconds],
        "draft_round_ms": round(1000 * costs.draft_seconds, 3),
        "draft_length": draft.drafting_options.draft_length,
    }


def machine_description() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------- results


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| eval set | method | tau (mean acceptance) | drafts verified per round | rounds looked up | tokens/s "
        "| speedup (same engine) | speedup over eager generate | identical to plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        identical = f"{row['identical']}/{row['prompts']}"
        drafts = "-" if row["drafts_per_round"] is None else f"{row['drafts_per_round']:.2f}"
        looked_up = "-" if row.get("looked_up_fraction") is None else f"{row['looked_up_fraction']:.0%}"
        lines.append(
            f"| {row['eval_set']} | {row['method']} | {row['mean_acceptance_length']:.2f} | {drafts} | {looked_up} | "
            f"{row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | {row['speedup_over_eager']:.2f}x | {identical} |"
        )
    return "\n".join(lines)


def cost_model_table(cost_model: dict) -> str:
    """The cost model of each draft (`cost_model`): decode step, verify of k drafts, drafting round."""
    lines = ["| draft | decode step ms | verify ms, k = 0..S drafts | draft round ms |", "|---|---:|---|---:|"]
    for name, terms in cost_model.items():
        verify = ", ".join(f"{ms:.1f}" for ms in terms["verify_ms"])
        lines.append(f"| {name} | {terms['decode_ms']:.1f} | {verify} | {terms['draft_round_ms']:.1f} |")
    return "\n".join(lines)


def quality_table(quality: dict) -> str:
    """`report["quality"]` (`quality.score_report`) as markdown: plain's and the drafts' scores side by side, which
    must agree for lossless decoding. Open-ended sets (MT-Bench) have no metric and show "-"."""
    lines = ["| eval set | method | metric | score | outputs |", "|---|---|---|---|---|"]
    for eval_set, scores_by_method in quality.items():
        for method, scores in scores_by_method.items():
            score = "-" if scores["score"] is None else f"{scores['score']:.3f}"
            lines.append(f"| {eval_set} | {method} | {scores['metric'] or '-'} | {score} | {scores['count']} |")
    return "\n".join(lines)


def plot_acceptance(results: list[dict], path: str) -> None:
    """Acceptance-length histogram and per-position acceptance curve per method, one row of panels per eval set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eval_sets = sorted({row["eval_set"] for row in results}, key=[r["eval_set"] for r in results].index)
    figure, axes = plt.subplots(len(eval_sets), 2, figsize=(11, 3.4 * len(eval_sets)), squeeze=False)
    for row_axes, name in zip(axes, eval_sets):
        for row in (r for r in results if r["eval_set"] == name and r["acceptance_histogram"]):
            histogram = {int(k): v for k, v in row["acceptance_histogram"].items()}
            total = sum(histogram.values())
            lengths = sorted(histogram)
            row_axes[0].plot(lengths, [histogram[n] / total for n in lengths], marker="o", label=row["method"])
            rates = [float("nan") if rate is None else rate for rate in row["position_acceptance"]]
            row_axes[1].plot(range(1, len(rates) + 1), rates, marker="o", label=row["method"])
        row_axes[0].set(title=f"{name}: tokens committed per round", xlabel="acceptance length", ylabel="fraction")
        row_axes[1].set(title=f"{name}: k-th draft accepted", xlabel="k", ylabel="fraction of rounds", ylim=(0, 1))
        for axis in row_axes:
            axis.grid(alpha=0.3)
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_results(report: dict, output_dir: str) -> dict[str, str]:
    """`bench_results.json`, `bench_results.md` (with a quality table after `bench --quality`) and
    `bench_acceptance.png` in `output_dir`; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = {name: os.path.join(output_dir, f"bench_{name}") for name in ("results.json", "results.md", "acceptance.png")}
    with open(paths["results.json"], "w", encoding="utf-8") as file:
        json.dump(report, file, indent=1)
    header = (
        f"Greedy, {report['config']['dtype']}, max_new_tokens={report['config']['max_new_tokens']}, prompts per set: "
        f"{report['config']['prompts']}, "
        f"{'with' if report['config'].get('cpu_optimization') else 'without'} `optimize_for_cpu`. "
        f"Machine: {report['machine']['processor']}, {report['machine']['cpu_threads']} threads, "
        f"{report['machine']['device']}; torch {report['versions']['torch']}, "
        f"transformers {report['versions']['transformers']}.\n\n"
    )
    with open(paths["results.md"], "w", encoding="utf-8") as file:
        file.write(header + markdown_table(report["results"]) + "\n")
        if report.get("cost_model"):
            file.write("\nCost model, measured in the same run:\n\n" + cost_model_table(report["cost_model"]) + "\n")
        if report.get("quality"):  # `bench --quality`
            file.write("\nQuality of the decoded outputs:\n\n" + quality_table(report["quality"]) + "\n")
    plot_acceptance(report["results"], paths["acceptance.png"])
    return paths
