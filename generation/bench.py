"""`domino-spec bench`: evaluation sets x decoding methods x settings in one run, every greedy output checked against
plain decoding.

Methods:
  plain          target.generate(do_sample=False): the reference of every output check, the speedup baseline of
                 transformers' paths
  plain-eager    target.generate on the target as loaded, without `optimize_for_cpu`: what a user gets today
  plain-native   the target alone in the native engine: the speedup baseline of the native engine's methods
  prompt-lookup  transformers' prompt-lookup decoding (no draft model)
  dflash         the DFlash-only draft (head off) in the native engine
  domino-hf      Domino through target.generate(assistant_model=draft)
  domino         Domino in the native engine, its defaults (on CPU, greedy rounds verify trees)
  domino-chain   Domino in the native engine, chains only
  domino-tree    Domino in the native engine, trees of up to 16 nodes on any device

On CPU the target and the drafts are prepared with `optimize_for_cpu` first (every method but plain-eager runs on
them), so each speedup is reported twice: over plain decoding in the same engine and preparation (`speedup`), and
over eager `target.generate` (`speedup_over_eager`).

Settings (`Setting`): the batch size and the sampling parameters. The native engine's methods decode the prompts
in left-padded batches of B and are measured against plain-native at the same B; a greedy row must equal
plain-native's (at batch 1, plain's). Sampled outputs are not compared (`identical` is None). transformers' paths
(plain, plain-eager, prompt-lookup, domino-hf) run in the batch-1 greedy setting only.

Acceptance length tau = tokens committed per target verify pass, over the passes that follow the prefill (Domino's
prefill only yields the first token; prompt lookup drafts already at the prefill, so all its passes count). The
native engine reports its rounds; for transformers' paths the target's forward calls are counted, and the drafts
each verified (its input length but the anchor).
"""

import contextlib
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import zip_longest

import torch
import transformers
from tqdm.auto import tqdm

from ..cost_aware import learned_costs
from ..drafting import AUTO_TREE_NODES
from ..targets import eos_token_ids, left_pad, prompt_token_ids
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
    "domino": "the Domino draft in the native engine, its defaults (on CPU, greedy rounds verify trees)",
    "domino-chain": "the Domino draft in the native engine, every round verifying a chain (`DraftingOptions("
    "tree_nodes=0)`)",
    "domino-alone": "the Domino draft in the native engine with prompt lookup off: every round drafted",
    "domino-tree": "the Domino draft in the native engine, each round verifying a tree of drafts with the "
    "looked-up tokens as one more branch (`DraftingOptions(tree_nodes=16)`, on any device)",
}
# speculative_generate, against plain-native
NATIVE_METHODS = ("plain-native", "dflash", "domino", "domino-chain", "domino-alone", "domino-tree")
# the --dflash / --domino draft each uses
DRAFT_OF = {
    "dflash": "dflash",
    "domino": "domino",
    "domino-hf": "domino",
    "domino-chain": "domino",
    "domino-alone": "domino",
    "domino-tree": "domino",
}
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens
WARMUP_TOKENS = 16  # an untimed decode per method before the timed ones


@dataclass(frozen=True)
class Setting:
    """How the prompts are decoded: a column of the bench's matrix."""

    batch_size: int = 1  # prompts per speculative_generate call (native engine only beyond 1)
    temperature: float = 0.0  # 0: greedy
    top_p: float | None = None  # sampling only; None: no nucleus cut
    top_k: int | None = None  # sampling only; None: no top-k cut
    seed: int = 0  # of the sampling generator, per method and setting

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def columns(self) -> dict:
        """The setting as the columns of a results row."""
        sampled = not self.greedy
        return {
            "batch_size": self.batch_size,
            "do_sample": sampled,
            "temperature": self.temperature,
            "top_p": self.top_p if sampled else None,
            "top_k": self.top_k if sampled else None,
            "seed": self.seed if sampled else None,
        }

    @classmethod
    def of_row(cls, row: dict) -> "Setting":
        """The setting of a results row (rows written before settings were columns: batch 1 greedy)."""
        return cls(
            row.get("batch_size", 1),
            row.get("temperature", 0.0),
            row.get("top_p"),
            row.get("top_k"),
            row.get("seed") or 0,
        )

    def label(self) -> str:
        """Short name of the setting, for tables and figures: "B=4, greedy", "B=1, T=0.7, top-p 0.9"."""
        parts = [f"B={self.batch_size}", "greedy" if self.greedy else f"T={self.temperature:g}"]
        if not self.greedy and self.top_p is not None:
            parts.append(f"top-p {self.top_p:g}")
        if not self.greedy and self.top_k is not None:
            parts.append(f"top-k {self.top_k}")
        return ", ".join(parts)

    def methods(self, methods: Sequence[str]) -> list[str]:
        """The `methods` this setting measures: all at batch 1 greedy, else the native engine's."""
        if self.batch_size == 1 and self.greedy:
            return list(methods)
        return [method for method in methods if method in NATIVE_METHODS]


@dataclass
class MethodRun:
    """Totals of one method on one evaluation set."""

    seconds: float = 0.0
    prefill_seconds: float | None = None  # native engine: the prompts' pass, within `seconds`
    new_tokens: int = 0
    verified_tokens: int = 0  # tokens committed by verify passes (tau's numerator)
    verify_passes: int = 0  # per row: a batched pass counts once for each row it serves
    rounds: int = 0  # verify passes, a batched one once
    drafts_verified: int = 0  # drafts the rounds read (with the cost-aware length, fewer than the block's)
    looked_up_rounds: int | None = None  # native engine: rounds of looked-up tokens (prompt lookup)
    tree_rounds: int = 0  # native engine: rounds that verified a tree, and rows of them whose accepted path left
    branch_wins: int = 0  # the draft's likeliest branch, or took a node only the looked-up branch proposed
    lookup_wins: int = 0
    round_lengths: list[int] = field(default_factory=list)  # native engine: tokens committed per round
    position_accepted: list[int] = field(default_factory=list)  # native engine: rounds accepting the k-th draft
    position_verified: list[int] = field(default_factory=list)  # and rounds verifying one, per draft position
    identical: int | None = 0  # None: sampled, nothing to compare
    prompts: int = 0
    outputs: list[list[int]] = field(default_factory=list)  # the new tokens of each prompt
    process_seconds: list[float] = field(default_factory=list)  # a cold cell's: each fresh process's first call

    def record_outputs(self, rows: list[list[int]], expected: list[list[int]] | None) -> None:
        """Count a batch's outputs, and those equal to `expected` (the reference's, greedy; None when sampled)."""
        self.prompts += len(rows)
        self.new_tokens += sum(len(tokens) for tokens in rows)
        self.outputs += rows
        if expected is not None:
            self.identical += sum(tokens == reference for tokens, reference in zip(rows, expected))

    def add(self, other: "MethodRun") -> None:
        """Count `other`'s calls as this run's too (the processes of a cold cell)."""
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if value is not None and not name.startswith("position_"):
                setattr(self, name, value if mine is None else mine + value)
        self.add_position_counts(other.position_accepted, other.position_verified)

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

    def summary(self, baseline: "MethodRun", eager: "MethodRun | None") -> dict:
        """Totals, tau and the speedups over `baseline` (plain decoding in the same engine and setting) and `eager`
        (eager `target.generate`, batch 1 greedy; None in other settings)."""
        tau = self.verified_tokens / self.verify_passes if self.verify_passes else float("nan")
        tokens_per_s = self.tokens_per_s()
        return {
            "prompts": self.prompts,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 3),
            "prefill_seconds": None if self.prefill_seconds is None else round(self.prefill_seconds, 3),
            "tokens_per_s": round(tokens_per_s, 3) if tokens_per_s else None,
            "speedup": self.speedup(baseline),
            "speedup_over_eager": self.speedup(eager) if eager is not None else None,
            "mean_acceptance_length": round(tau, 3),
            "verified_tokens": self.verified_tokens,  # tau = verified_tokens / verify_passes
            "verify_passes": self.verify_passes,
            "drafts_per_round": round(self.drafts_verified / self.rounds, 3) if self.rounds else None,
            "looked_up_fraction": (
                round(self.looked_up_rounds / self.rounds, 3)
                if self.rounds and self.looked_up_rounds is not None
                else None
            ),
            "tree_rounds": self.tree_rounds,
            "branch_wins": self.branch_wins,
            "lookup_wins": self.lookup_wins,
            "position_acceptance": pooled_position_rates(self.position_accepted, self.position_verified),
            "acceptance_histogram": {str(n): self.round_lengths.count(n) for n in sorted(set(self.round_lengths))},
            "identical": self.identical,
            "identical_fraction": (
                self.identical / self.prompts if self.prompts and self.identical is not None else None
            ),
            "process_seconds": self.process_seconds or None,
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


def decode(
    method: str,
    target,
    drafts: dict,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: list[int],
    run: MethodRun,
    optimization: CPUOptimization | None = None,
    setting: Setting = Setting(),
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Decode a batch of prompts (token-id lists) with `method` in `setting`, adding its time and acceptance to `run`;
    returns each row's new tokens. transformers' paths take one prompt, greedy; `optimization` is suspended for
    `plain-eager`; `generator` draws the native engine's samples."""
    if method in NATIVE_METHODS:
        return _decode_native(method, target, drafts, prompts, max_new_tokens, eos, run, setting, generator)
    assert len(prompts) == 1 and setting.greedy, f"{method} decodes one prompt greedily (Setting.methods)"
    input_ids = torch.tensor(prompts, device=target.device)
    extra = {
        "plain": {},
        "plain-eager": {},
        "prompt-lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS},
        "domino-hf": {"assistant_model": drafts.get(DRAFT_OF["domino-hf"])},
    }[method]
    eager = optimization.suspended() if method == "plain-eager" and optimization else contextlib.nullcontext()
    clock = DeviceClock(input_ids.device)  # a GPU decode is timed to its last kernel
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
    run.rounds += len(counter.lengths) - int(prefill_counts)
    run.verified_tokens += len(tokens) - int(prefill_counts)
    run.drafts_verified += sum(length - 1 for length in verify_lengths)
    return [tokens]


def _decode_native(
    method: str,
    target,
    drafts: dict,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: list[int],
    run: MethodRun,
    setting: Setting,
    generator: torch.Generator | None,
) -> list[list[int]]:
    """`decode` in the native engine: the prompts left-padded into one batch."""
    input_ids, attention_mask = (tensor.to(target.device) for tensor in left_pad(prompts, pad_token_id=eos[0]))
    draft = drafts[DRAFT_OF[method]] if method in DRAFT_OF else None
    options = None
    if method == "domino-alone":
        options = replace(draft.drafting_options, prompt_lookup=0)
    elif method == "domino-chain":
        options = replace(draft.drafting_options, tree_nodes=0)
    elif method == "domino-tree":
        options = replace(draft.drafting_options, tree_nodes=AUTO_TREE_NODES)
    sampling = (
        {}
        if setting.greedy
        else {
            "do_sample": True,
            "temperature": setting.temperature,
            "top_k": setting.top_k,
            "top_p": setting.top_p,
            "generator": generator,
        }
    )
    clock = DeviceClock(input_ids.device)  # a GPU decode is timed to its last kernel
    start = clock()
    output = speculative_generate(
        target,
        draft,
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        options=options,
        **sampling,
    )
    run.seconds += clock() - start
    run.prefill_seconds = (run.prefill_seconds or 0.0) + output.prefill_time
    width = input_ids.shape[1]
    for lengths in output.acceptance_lengths:
        run.round_lengths += lengths
        run.verified_tokens += sum(lengths)
        run.verify_passes += len(lengths)
    run.rounds += output.num_rounds
    run.add_position_counts(output.position_accepted.tolist(), output.position_verified.tolist())
    run.drafts_verified += output.drafts_verified
    run.looked_up_rounds = (run.looked_up_rounds or 0) + output.looked_up_rounds
    run.tree_rounds += output.tree_rounds
    run.branch_wins += output.branch_wins
    run.lookup_wins += output.lookup_wins
    return [output.sequences[row, width:].tolist()[:count] for row, count in enumerate(output.num_new_tokens)]


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
    settings: Sequence[Setting] = (Setting(),),
    repeats: int = 1,
) -> dict:
    """Every method on every prompt (`{eval_set: eval_prompts(eval_set)}`) in every setting it applies to
    (`Setting.methods`), with the baselines they need added (`with_baselines`), on the target and drafts
    `optimization` prepared, if any; returns what `bench_report.write_results` writes, with the cost model of each
    draft as its batch-1 rounds learned it in this run (`cost_aware.learned_costs`). `texts` holds the outputs of the
    first setting's first repeat (what `--quality` scores). `repeats` decodes every batch that many times per method
    (more samples of each cell on a noisy machine)."""
    missing = [m for m in methods if m in DRAFT_OF and drafts.get(DRAFT_OF[m]) is None]
    if missing:
        raise ValueError(f"methods {missing} need a draft: pass --domino DIR and/or --dflash DIR, or drop them")
    methods = with_baselines(methods, prepared=optimization is not None)
    eos = eos_token_ids(target, tokenizer)
    prompt_ids = tokenized_prompts(tokenizer, prompts, thinking)
    results, texts = [], None
    for setting in settings:
        runs = bench_setting(
            target, drafts, prompt_ids, setting.methods(methods), setting, max_new_tokens, eos, optimization, repeats
        )
        texts = texts or {
            name: {
                m: [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in run.outputs[: len(prompts[name])]]
                for m, run in by_method.items()
            }
            for name, by_method in runs.items()
        }
        results += setting_results(runs, setting, prepared=optimization is not None)
    return {
        "results": results,
        "cost_model": {name: cost_model(target, draft) for name, draft in drafts.items() if draft is not None},
        "config": {
            "prompts": {n: len(p) for n, p in prompts.items()},
            "max_new_tokens": max_new_tokens,
            "methods": list(methods),
            "method_descriptions": {m: METHODS[m] for m in methods},
            "greedy": all(setting.greedy for setting in settings),
            "settings": [setting.columns() for setting in settings],
            "target": target.name_or_path,
            "drafts": {name: draft.name_or_path for name, draft in drafts.items() if draft is not None},
            "dtype": str(target.dtype).removeprefix("torch."),
            "cpu_optimization": optimization is not None,
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
            "warmup_tokens": WARMUP_TOKENS,
            "repeats": repeats,
        },
        "machine": machine_description(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "texts": texts,
        "references": {name: [item["reference"] for item in prompts[name]] for name in prompts},
    }


def tokenized_prompts(tokenizer, prompts: dict[str, list[dict]], thinking: bool | None = None) -> dict[str, list]:
    """`{eval_set: [prompt token ids]}` of `{eval_set: eval_prompts(eval_set)}`, chat template applied."""
    return {
        name: [prompt_token_ids(tokenizer, item["messages"], thinking) for item in items]
        for name, items in prompts.items()
    }


def bench_setting(
    target,
    drafts: dict,
    prompt_ids: dict[str, list[list[int]]],
    methods: Sequence[str],
    setting: Setting,
    max_new_tokens: int,
    eos: list[int],
    optimization: CPUOptimization | None = None,
    repeats: int = 1,
) -> dict[str, dict[str, MethodRun]]:
    """`{eval_set: {method: MethodRun}}` of one setting: each batch of prompts decoded by every method in turn,
    `repeats` times, after an untimed warm-up per method (no method pays the one-off costs of a first call at this
    batch size: allocations, kernel choice; `--cold` measures those). Greedy outputs are compared with the
    reference's (`reference_method`)."""
    methods = list(methods)
    reference = reference_method(methods)
    generators = {method: sampling_generator(target.device, setting) for method in methods}
    warmup_batch = next(ids for ids in prompt_ids.values() if ids)[: setting.batch_size]
    for method in methods:
        decode(
            method,
            target,
            drafts,
            warmup_batch,
            WARMUP_TOKENS,
            eos,
            MethodRun(),
            optimization,
            setting,
            sampling_generator(target.device, setting),
        )
    runs = {
        name: {method: MethodRun(identical=0 if setting.greedy else None) for method in methods} for name in prompt_ids
    }
    batches = [
        (name, ids[start : start + setting.batch_size])
        for name, ids in prompt_ids.items()
        for start in range(0, len(ids), setting.batch_size)
    ]
    progress = tqdm(
        total=sum(len(batch) for _, batch in batches) * len(methods) * repeats,
        desc=f"bench {setting.label()}",
        unit="decode",
    )
    for repeat in range(repeats):
        for name, batch in batches:
            # Every other repeat in reverse order: a machine speeding up or slowing down favours no method.
            order = methods if repeat % 2 == 0 else methods[::-1]
            outputs = {}
            for method in order:
                outputs[method] = decode(
                    method,
                    target,
                    drafts,
                    batch,
                    max_new_tokens,
                    eos,
                    runs[name][method],
                    optimization,
                    setting,
                    generators[method],
                )
                progress.update(len(batch))
            for method in methods:
                runs[name][method].record_outputs(outputs[method], outputs[reference] if setting.greedy else None)
    progress.close()
    return runs


def reference_method(methods: Sequence[str]) -> str:
    """The method whose outputs the others' must equal: plain (transformers' `generate`) where it runs, else
    plain-native at the same batch size."""
    return "plain" if "plain" in methods else "plain-native"


def sampling_generator(device: torch.device, setting: Setting) -> torch.Generator | None:
    """A generator seeded with the setting's seed, for a sampled setting (None for greedy)."""
    return None if setting.greedy else torch.Generator(device=device).manual_seed(setting.seed)


def setting_results(
    runs: dict[str, dict[str, MethodRun]], setting: Setting, prepared: bool, timing: str = "warm"
) -> list[dict]:
    """The results rows of one setting: each method against plain decoding in its own engine and this setting, and
    (batch 1 greedy, on a `prepared` target) against eager `target.generate`. `timing`: "warm" (after a warm-up) or
    "cold" (a process's first call, `cold_start`)."""
    rows = []
    for name, by_method in runs.items():
        for method, run in by_method.items():
            # Each engine against its own plain decoding: the native loop and generate's differ in overhead.
            baseline = by_method["plain-native" if method in NATIVE_METHODS else "plain"]
            eager = by_method.get("plain-eager" if prepared else "plain")
            rows.append(
                {
                    "eval_set": name,
                    "method": method,
                    **setting.columns(),
                    "timing": timing,
                    **run.summary(baseline, eager),
                }
            )
    return rows


def cost_model(target, draft) -> dict:
    """The terms of a batch-1 greedy round's cost, in milliseconds, as the cost-aware draft length learned and weighed
    them by the end of this run: the decode step (a pass over one token), a verify pass over the anchor and k drafts
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
