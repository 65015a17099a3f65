"""Cheap multi-token forward passes on CPU: `optimize_for_cpu`.

Speculative decoding wins when a forward pass over a few tokens (a verify pass, a draft block) costs about one
decode step, as it does on a GPU, where a small model is memory-bound. Eager `nn.Linear` on CPU sends every row
count to one BLAS call whose kernels are tuned for one row and for many: 2-64 rows can cost several one-row calls
although the weights are read once. Other layouts of the same weight do much better at those sizes: the weight
transposed (`x @ W^T` as a plain row-major product) and oneDNN's blocked layout. Which wins depends on the CPU, the
shape and the row count, so `optimize_for_cpu` times the three on the model's own weights, once per weight shape
and row count, and makes every `nn.Linear` of the models call the fastest. Outputs equal eager ones up to float
rounding (the same products, summed in another order).

Memory: each weight keeps its original tensor (state dicts and `save_pretrained` are unchanged) plus the layouts
that won some row count: at most two extra copies of the linear weights, usually one.

The plans are kept on disk (`plan_cache_path`), keyed by the CPU, torch's version, the thread count and the weight
shape: a process's first call pays the timing only where no earlier process on this machine timed that shape.

Attention: where a target groups its key/value heads, transformers' sdpa attention copies each group for every query
head it serves (`repeat_kv`) whenever a pass has a mask and several query tokens, as a verify pass and a batch's
prefill have: the whole cache written again at every layer, however few tokens the pass reads. torch's CPU kernel takes
the heads grouped (`enable_gqa`), with the same outputs (transformers keeps the copy for CUDA's fused kernels, which
take no mask with grouped heads), so `optimize_for_cpu` runs the target's attention as `GROUPED_SDPA`.
"""

import contextlib
import ctypes
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..cost_aware import forget_draft_costs
from ..machine import cache_path, machine_key, read_cache, write_cache
from ..modeling_domino import rows_of

# Row counts timed per weight shape; a count between two uses the plan of the next one up, and a count above the
# last (a prefill) the last one's. Up to 128: a wide batch's verify passes and draft blocks (12 rows of 9 tokens);
# 512: prefills, where eager `F.linear`'s GEMM kernels, made for many rows, may still lose to a blocked layout.
TUNED_ROW_COUNTS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 48, 64, 96, 128, 512)
TIMING_REPEATS = 3  # the fastest of these runs counts, the others absorb the noise of a shared machine
# A draft's layouts are tens of MB of fresh memory, which a VM may fault in at ~5 ms per MB (0.2-0.3 s for
# SmolLM2-135M's draft on a 2-core EPYC VM), while its eager products cost ~1.3 ms more a drafting round: a linear
# called this often (about 64 rounds) has run long enough for its layouts to pay.
DRAFT_EAGER_CALLS = 128
# By default glibc hands large freed blocks back to the system (fresh mappings above a threshold of 128 KB-32 MB, the
# heap's free top above twice that), so a batched prefill faults its activations in again on every call: ~0.9 GB
# for 12 rows of 126 tokens through SmolLM2-135M, 0.3-0.5 s of a 2 s prefill on a 2-core EPYC VM. Kept, a process
# reuses what it freed.
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap
MALLOC_TRIM_THRESHOLD = 1 << 30  # free memory the heap keeps before it shrinks
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's `mallopt` parameters (malloc.h)


def _linear(x: torch.Tensor, layouts: dict) -> torch.Tensor:
    return F.linear(x, layouts["weight"], layouts["bias"])


def _transposed(x: torch.Tensor, layouts: dict) -> torch.Tensor:
    output = torch.matmul(x, layouts["transposed"])
    return output if layouts["bias"] is None else output + layouts["bias"]


def _onednn(x: torch.Tensor, layouts: dict) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layouts["onednn"], layouts["bias"], "none", [], "")


# name -> (kernel, what it needs built from the weight)
KERNELS: dict[str, tuple[Callable, Callable[[torch.Tensor], torch.Tensor] | None]] = {
    "linear": (_linear, None),
    "transposed": (_transposed, lambda weight: weight.t().contiguous()),
    "onednn": (_onednn, lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight, TUNED_ROW_COUNTS[-1])),
}


GROUPED_SDPA = "sdpa_grouped_heads"  # the attention implementation `optimize_for_cpu` gives an sdpa target


def sdpa_with_grouped_heads(
    module: nn.Module, query, key, value, attention_mask, **kwargs
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except that a masked pass over several query tokens reads grouped key/value heads
    `[B, H_kv, T, D]` as they are, not copied for each of the query heads `[B, H, Q, D]`."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if attention_mask is None or query.shape[2] == 1 or not grouped or not plain:  # transformers' own
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    output = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
        enable_gqa=True,
    )
    return output.transpose(1, 2).contiguous(), None  # [B, Q, H, D], as transformers' attention functions return


AttentionInterface.register(GROUPED_SDPA, sdpa_with_grouped_heads)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks sdpa takes


class PlannedLinear:
    """An `nn.Linear`'s forward that runs each row count with the kernel its plan picked. The weight layouts the plan
    needs are built now, or after `eager_calls` planned calls that run eager `F.linear`."""

    def __init__(self, module: nn.Linear, plan: dict[int, str], eager_calls: int = 0):
        self.plan = plan  # row count (from TUNED_ROW_COUNTS) -> kernel name
        self.layouts = {"weight": module.weight, "bias": module.bias}
        self.built = False
        self.eager_calls = eager_calls
        if eager_calls == 0:
            self.build_layouts()
        self.by_rows: list[Callable] = []  # row count -> kernel, for every count up to the last tuned one
        for count in TUNED_ROW_COUNTS:  # a count between two tuned ones runs the plan of the next one up
            self.by_rows += [KERNELS[plan[count]][0]] * (count + 1 - len(self.by_rows))

    def build_layouts(self) -> None:
        for name in set(self.plan.values()):
            build = KERNELS[name][1]
            if build is not None:
                self.layouts[name] = build(self.layouts["weight"].detach())
        self.built = True

    def extra_bytes(self) -> int:
        """Memory the extra layouts built so far take (oneDNN's blocked layout reports its logical size)."""
        extra = (t for name, t in self.layouts.items() if name not in ("weight", "bias"))
        return sum(t.numel() * t.element_size() for t in extra)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return F.linear(x, self.layouts["weight"], self.layouts["bias"])
        if not self.built:
            if self.eager_calls > 0:
                self.eager_calls -= 1
                return F.linear(x, self.layouts["weight"], self.layouts["bias"])
            self.build_layouts()
        rows = x.numel() // x.shape[-1]
        return self.by_rows[min(rows, len(self.by_rows) - 1)](x, self.layouts)


class CPUOptimization:
    """What `optimize_for_cpu` changed: every planned `nn.Linear` and the models whose attention became `GROUPED_SDPA`.
    `restore()` (or leaving the `with` block) puts the eager forwards and sdpa back, `suspended()` for a while; `plans`
    maps each weight shape `(out, in, dtype, bias)` to its kernel per tuned row count."""

    def __init__(
        self,
        models: list[nn.Module],
        planned: dict[nn.Linear, PlannedLinear],
        plans: dict[tuple, dict],
        grouped_attention: list[nn.Module],
    ):
        self.models, self.planned, self.plans = models, planned, plans
        self.grouped_attention = grouped_attention
        self._forget_costs()

    @property
    def extra_bytes(self) -> int:
        return sum(forward.extra_bytes() for forward in self.planned.values())

    def restore(self) -> None:
        for module in self.planned:
            module.__dict__.pop("forward", None)  # the class's nn.Linear.forward again
        for model in self.grouped_attention:
            model.set_attn_implementation("sdpa")
        for model in self.models:
            if hasattr(model, "derived"):
                model.derived.__dict__.pop("prepare", None)
        self.planned, self.grouped_attention = {}, []
        self._forget_costs()

    def _forget_costs(self) -> None:
        """The draft costs measured with these models (`cost_aware.learned_costs`) timed other kernels."""
        for model in self.models:
            forget_draft_costs(model)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The eager forwards and sdpa inside the block (to time eager decoding beside the prepared one), planned and
        `GROUPED_SDPA` after."""
        for module in self.planned:
            module.__dict__.pop("forward", None)
        for model in self.grouped_attention:
            model.set_attn_implementation("sdpa")
        try:
            yield
        finally:
            for module, forward in self.planned.items():
                module.forward = forward
            for model in self.grouped_attention:
                model.set_attn_implementation(GROUPED_SDPA)

    def __enter__(self) -> "CPUOptimization":
        return self

    def __exit__(self, *exc_info) -> None:
        self.restore()


def _shape(module: nn.Linear) -> tuple:
    return (*module.weight.shape, module.weight.dtype, module.bias is not None)


def _derived_linear_stand_ins(target: nn.Module | None, drafts: Iterable[nn.Module]) -> list[nn.Linear]:
    """Linears shaped as those the drafts derive from the target's weights as they draft (a draft vocabulary's rows of
    the LM head, `modeling_domino.rows_of`), over the target's own rows (views, no copy), to plan their kernels by."""
    lm_head = target.get_output_embeddings() if target is not None else None
    if type(lm_head) is not nn.Linear:  # a module that transforms its output (an adapter): drafts call it whole
        return []
    vocabularies = [getattr(draft, "draft_vocab", None) for draft in drafts if hasattr(draft, "derived")]
    return [rows_of(lm_head, slice(0, len(vocab))) for vocab in vocabularies if vocab is not None]


def _plain_linears(models: Iterable[nn.Module]) -> list[nn.Linear]:
    """Every `nn.Linear` of the models, once (a tied or shared module counts once)."""
    found: dict[int, nn.Linear] = {}
    for model in models:
        for module in model.modules():
            if type(module) is nn.Linear and "forward" not in module.__dict__:
                found.setdefault(id(module), module)
    return list(found.values())


def _time_kernel(kernel: Callable, layouts: list[dict], x: torch.Tensor) -> float:
    """Seconds to run `x` through every weight of a shape, as a forward pass does (each weight read from memory,
    not cache): the fastest of `TIMING_REPEATS` runs."""
    best = float("inf")
    for _ in range(TIMING_REPEATS + 1):  # one untimed run: first-call allocations
        start = time.perf_counter()
        for weight_layouts in layouts:
            kernel(x, weight_layouts)
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def plan_shape(modules: list[nn.Linear]) -> dict[int, str]:
    """The fastest kernel per tuned row count for linears of one weight shape, timed on their own weights."""
    weight = modules[0].weight
    layouts = [{"weight": m.weight, "bias": m.bias} for m in modules]
    usable = {}
    for name, (kernel, build) in KERNELS.items():
        try:
            built = [build(m.weight.detach()) if build else None for m in modules]
            trial = [{**lay, name: b} for lay, b in zip(layouts, built)]
            kernel(weight.new_zeros(2, weight.shape[1]), trial[0])
        except RuntimeError:  # a layout this build of torch or this dtype lacks
            continue
        usable[name] = (kernel, trial)
    plan = {}
    for rows in TUNED_ROW_COUNTS:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        times = {name: _time_kernel(kernel, trial, x) for name, (kernel, trial) in usable.items()}
        plan[rows] = min(times, key=times.get)
    return plan


def plan_cache_path() -> str:
    """Where `optimize_for_cpu` keeps the plans it timed: `$DOMINO_CPU_PLANS`, else
    `$XDG_CACHE_HOME/domino_spec/cpu_plans.json` (`~/.cache` by default)."""
    return cache_path("DOMINO_CPU_PLANS", "cpu_plans.json")


def _plan_key(machine: str, shape: tuple) -> str:
    """What a plan depends on: the `machine` (CPU, torch, thread count) and the weight's shape, dtype and bias."""
    out_features, in_features, dtype, bias = shape
    return f"{machine} | {out_features}x{in_features} {str(dtype).removeprefix('torch.')}{' +bias' if bias else ''}"


def _read_plans(path: str) -> dict[str, dict[int, str]]:
    try:
        return {key: {int(rows): kernel for rows, kernel in plan.items()} for key, plan in read_cache(path).items()}
    except (TypeError, ValueError, AttributeError):  # unreadable: time again
        return {}


def optimize_for_cpu(
    target: nn.Module,
    *drafts: nn.Module,
    verbose: bool = False,
    plan_cache: str | None = "default",
    keep_freed_memory: bool = True,
) -> CPUOptimization:
    """Make every `nn.Linear` of `target` (and of `drafts`, with the linears a draft derives from the target's weights
    as it drafts) run each row count with the fastest of three layouts of its weight, timed here once per weight shape
    and tuned row count (`TUNED_ROW_COUNTS`; a longer pass runs the last count's); in place, undone by `restore()`.

    Multi-token passes (verify passes, draft blocks, batches) get much cheaper on most CPUs, the one-token decode step
    stays as fast, and plain decoding of the prepared target speeds up too, so compare speculative and plain decoding
    of the same prepared target. Inference only: with gradients enabled the eager forward runs, and a weight changed
    after this call is not seen by the extra layouts (`restore()` first). Costs an extra copy of the linear weights
    in the winning layouts (`extra_bytes`), and the timing (seconds to tens of seconds) of every weight shape that
    `plan_cache` (a JSON file; "default": `plan_cache_path()`; None: none) holds no plan of for this machine.
    With `keep_freed_memory` (glibc only), the process keeps the memory it frees for its next allocations
    (`keep_freed_memory_for_reuse`): a process-wide setting that `restore()` does not undo.
    The target's layouts are built now, since the cost-aware draft length times its passes from the first step on;
    a draft's linears run eagerly for their first `DRAFT_EAGER_CALLS` calls, then build theirs: a process that drafts
    a few dozen rounds (a short first call) saves more than the eager products cost. A target whose attention is sdpa
    runs it as `GROUPED_SDPA`, which reads grouped key/value heads without copying them.

        with optimize_for_cpu(target, draft):
            out = speculative_generate(target, draft, input_ids)
    """
    models = [model for model in (target, *drafts) if model is not None]
    for model in models:
        devices = {p.device.type for p in model.parameters()}
        if devices != {"cpu"}:
            raise ValueError(
                f"optimize_for_cpu prepares models on the CPU, but {type(model).__name__} has parameters on "
                f"{', '.join(sorted(devices))}: on an accelerator leave the model as it is (or compile it)."
            )
    linears = _plain_linears(models)
    by_shape: dict[tuple, list[nn.Linear]] = defaultdict(list)
    for module in linears + _derived_linear_stand_ins(target, drafts):
        by_shape[_shape(module)].append(module)
    path = plan_cache_path() if plan_cache == "default" else plan_cache
    stored = _read_plans(path) if path else {}
    plans, planned, timed = {}, {}, False
    machine = machine_key()
    for shape, modules in by_shape.items():
        key = _plan_key(machine, shape)
        if set(stored.get(key, {})) != set(TUNED_ROW_COUNTS) or not set(stored[key].values()) <= set(KERNELS):
            stored[key], timed = plan_shape(modules), True
        plans[shape] = stored[key]
        if verbose:
            print(f"optimize_for_cpu: {shape[:2]} x{len(modules)}: {plans[shape]}", flush=True)
    if path and timed:
        write_cache(path, stored)
    targets_own = set(_plain_linears([target])) if target is not None else set()
    for module in linears:
        eager_calls = 0 if module in targets_own else DRAFT_EAGER_CALLS
        module.forward = planned[module] = PlannedLinear(module, plans[_shape(module)], eager_calls)

    def plan_derived(derived: torch.Tensor | nn.Module) -> None:
        if type(derived) is nn.Linear and _shape(derived) in plans:  # built when drafting starts: layouts at once
            derived.forward = planned[derived] = PlannedLinear(derived, plans[_shape(derived)])

    for draft in drafts:
        if hasattr(draft, "derived"):
            draft.derived.prepare = plan_derived
            draft.derived.clear()  # what was built before is built again, planned
    if keep_freed_memory:
        keep_freed_memory_for_reuse()
    config = getattr(target, "config", None)
    grouped_attention = [target] if getattr(config, "_attn_implementation", None) == "sdpa" else []
    for model in grouped_attention:
        model.set_attn_implementation(GROUPED_SDPA)
    return CPUOptimization(models, planned, plans, grouped_attention)


def keep_freed_memory_for_reuse() -> bool:
    """Have glibc's malloc keep the memory the process frees, up to `MALLOC_TRIM_THRESHOLD`, and serve blocks up to
    `MALLOC_MMAP_THRESHOLD` from it, instead of returning it to the system and faulting it in again at the next
    pass; True where set, False where the C library is not glibc. The process then holds its peak memory, as it
    would with jemalloc or tcmalloc, which CPU inference often preloads for the same reason."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    )


LOAD_SAMPLES = 5  # looks at the machine's runnable tasks, a millisecond apart; the fewest counts


def other_runnable_tasks() -> int:
    """Tasks of other processes ready to run now, from /proc: the fewest of `LOAD_SAMPLES` looks, so that one that
    just woke or is about to block does not count; 0 where /proc is missing."""
    counts = []
    try:
        for _ in range(LOAD_SAMPLES):
            with open("/proc/loadavg") as loadavg:
                runnable = int(loadavg.read().split()[3].split("/")[0])  # "running/total", this thread included
            own = sum(_task_state(task.path) == "R" for task in os.scandir("/proc/self/task"))
            counts.append(runnable - own)
            time.sleep(0.001)
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, min(counts))


def _task_state(task_path: str) -> str:
    with open(os.path.join(task_path, "stat")) as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]  # the field after the command name, which may hold spaces


PROBE_LINEARS = 8  # the model's first linears, one row each: the small parallel regions a decode step is made of
PROBE_ROUNDS = 4  # each timing runs them this many times (~3 ms for a 135M model)
PROBE_REPEATS = 5  # timings per thread count, taken in turn; the median counts


@torch.no_grad()
def faster_thread_count(model: nn.Module, counts: tuple[int, int]) -> int:
    """Which of two thread counts runs `model`'s one-row products faster now: a few of its linears, timed on each
    count in turn, the median of `PROBE_REPEATS` timings each; the first count on a tie."""
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)][:PROBE_LINEARS]
    rows = [module.weight.new_zeros(1, module.in_features) for module in linears]
    times: dict[int, list[float]] = {count: [] for count in counts}
    threads = torch.get_num_threads()
    try:
        for _ in range(PROBE_REPEATS):
            for count in counts:
                torch.set_num_threads(count)
                start = time.perf_counter()
                for _ in range(PROBE_ROUNDS):
                    for linear, row in zip(linears, rows):
                        linear(row)
                times[count].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    median = {count: sorted(timings)[len(timings) // 2] for count, timings in times.items()}
    return min(counts, key=lambda count: (median[count], counts.index(count)))


@contextlib.contextmanager
def threads_fitted_to_load(model: nn.Module) -> Iterator[int]:
    """Run torch, for the block, on the thread count that runs `model` fastest beside the other processes ready to
    run now; yields the thread count. CPU only.

    Torch's OpenMP threads meet at the end of every parallel region, so where one shares its core with a busy
    process the others can wait for it. How much that costs depends on the CPU and on the other process: beside a
    second busy process a decode step took 4x as long on two threads as on one on an Intel Xeon, while on an AMD
    EPYC, beside a nice-19 one, two threads stayed ~1.3x faster than one (BENCHMARKS.md). So where other tasks are
    ready to run, the model's own small products are timed on torch's threads and on the cores the others leave
    free (at least one), and the faster count runs (`faster_thread_count`, ~30 ms). Looking at the load costs ~5 ms.
    `DOMINO_FIT_THREADS=0` keeps torch's thread count.
    """
    threads = torch.get_num_threads()
    device = next(model.parameters()).device
    if device.type != "cpu" or threads == 1 or os.environ.get("DOMINO_FIT_THREADS") == "0":
        yield threads
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    free = max(1, min(threads, cores - other_runnable_tasks()))
    fitted = threads if free == threads else faster_thread_count(model, (threads, free))
    torch.set_num_threads(fitted)
    try:
        yield fitted
    finally:
        torch.set_num_threads(threads)


__all__ = [
    "CPUOptimization",
    "faster_thread_count",
    "keep_freed_memory_for_reuse",
    "optimize_for_cpu",
    "other_runnable_tasks",
    "plan_cache_path",
    "threads_fitted_to_load",
]
