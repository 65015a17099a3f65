"""Run-time options of drafting, the cost-aware draft length (how many of a block's drafts to verify), and compiled
drafting.

A verify pass over the anchor and k drafts takes `verify_seconds[k]`, which on a CPU grows with k, and commits in
expectation `1 + sum_{i<=k} c_1 ... c_i` tokens, `c_i` the draft's confidence in its i-th token (the probability
its distribution gives its most likely token). `choose_draft_length` adds drafts while they raise the expected
tokens per second of the round, `(1 + sum ...) / (draft_seconds + verify_seconds[k])`. Whether draft i is verified
depends on the confidences of drafts 1..i only, which are properties of the distributions the draft samples from,
never of a sampled token: a stopping rule, under which exact speculative sampling stays exact. A round drafts at all
only when rounds like the recent ones beat a plain decode step (`DraftGate`): it would pay for the drafting round
even if it then verified no draft.

Copied into every saved checkpoint with `modeling_domino.py` (`trust_remote_code`): imports only torch and
transformers.
"""

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cache_domino import DominoContextCache
from .head_step_triton import kernel_runs_on, triton_available
from .transformers_compat import cache_keyword, new_dynamic_cache

DRAFT_LENGTHS = ("auto", "cost", "full")  # auto: cost-aware on CPU, the whole block elsewhere


@dataclass(frozen=True)
class DraftCosts:
    """What a round costs: `verify_seconds[k]`, a verify pass over the anchor and k drafts (k = 0..S), and
    `draft_seconds`, one drafting round."""

    verify_seconds: tuple[float, ...]
    draft_seconds: float

    def __post_init__(self):
        if len(self.verify_seconds) < 1 or min(self.verify_seconds) <= 0 or self.draft_seconds < 0:
            raise ValueError(
                f"DraftCosts needs verify_seconds for 0..S drafts, all > 0, and draft_seconds >= 0; got "
                f"{self.verify_seconds!r} and {self.draft_seconds!r}."
            )


@dataclass(frozen=True)
class DraftingOptions:
    """Run-time options of drafting. None changes the weights, the training, or the output (the target verifies
    every draft); they trade drafting and verifying time against how many drafts are accepted.

    Set them on a draft (`draft.drafting_options = DraftingOptions(candidate_pool=32)`) for
    `target.generate(assistant_model=draft)`, or pass them to `speculative_generate`.
    """

    candidate_pool: int = 0  # > 0: greedy slots correct only their K best base tokens, the rest get -inf (0: all)
    fused_step: bool = False  # greedy pooled drafting on CUDA: one Triton kernel per slot (needs a pool)
    gate_table_max_bytes: int = 256 * 2**20  # precompute every draft token's GRU input gates when at most this big
    draft_length: str = "auto"  # "cost": verify as many drafts as pay (`choose_draft_length`); "full": all of them;
    # "auto": "cost" on CPU, "full" on accelerators, where a verify pass costs about the same for any block
    draft_costs: DraftCosts | None = None  # the costs "cost" weighs; None: measured once per process and models

    def __post_init__(self):
        pool = self.candidate_pool
        if not (isinstance(pool, int) and not isinstance(pool, bool) and pool >= 0):
            raise ValueError(f"candidate_pool={pool!r} is invalid: expected 0 (off) or a pool size >= 1.")
        if not isinstance(self.fused_step, bool) or (self.fused_step and not pool):
            raise ValueError(
                f"fused_step={self.fused_step!r} is invalid: expected False, or True with candidate_pool > 0 (the "
                "fused step corrects a candidate pool)."
            )
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"draft_length={self.draft_length!r} is invalid: expected one of {DRAFT_LENGTHS}.")

    def check_device(self, device: torch.device) -> None:
        """`RuntimeError` if the fused step cannot run on `device`."""
        if self.fused_step and not kernel_runs_on(device):
            raise RuntimeError(
                f"fused_step runs a Triton kernel on CUDA, but the draft is on {device} and Triton is "
                f"{'installed' if triton_available() else 'not installed'}: draft with fused_step=False there."
            )

    def cost_aware(self, device: torch.device) -> bool:
        return self.draft_length == "cost" or (self.draft_length == "auto" and device.type == "cpu")


def choose_draft_length(confidence: torch.Tensor, costs: DraftCosts) -> int:
    """How many of the drafts to verify: `confidence` `[B, S]` (every row verifies the same number) and the round's
    costs. Stops at the first draft that lowers the round's expected tokens per second (the verify cost is taken
    non-decreasing in k, so one noisy measurement cannot stop it early)."""
    num_drafts = min(confidence.shape[1], len(costs.verify_seconds) - 1)
    reach = confidence[:, :num_drafts].double().cumprod(dim=1).sum(dim=0).tolist()  # [S]: rows reaching draft i
    expected, seconds = float(confidence.shape[0]), costs.draft_seconds + costs.verify_seconds[0]
    for index, gain in enumerate(reach):
        longer = max(seconds, costs.draft_seconds + costs.verify_seconds[index + 1])
        if (expected + gain) / longer < expected / seconds:
            return index
        expected, seconds = expected + gain, longer
    return num_drafts


class DraftGate:
    """Whether a round should draft at all, the cost-aware draft length's zero: a round that drafts pays the drafting
    round even when it then verifies no draft.

    It expects the next round's confidences to be the recent ones (an average that halves the weight of each older
    round) and drafts when a round with those would commit more tokens per second than a plain decode step. Skipping,
    it looks again after 1, 2, 4, ... up to `MAX_SKIPPED` rounds. Every decision depends on earlier rounds only, so
    sampling stays exact.
    """

    MAX_SKIPPED = 16

    def __init__(self, costs: DraftCosts):
        self.costs = costs
        self.expected: torch.Tensor | None = None  # [S]: the recent confidences, per draft position
        self.skipped, self.wait = 0, 1

    def should_draft(self) -> bool:
        return self.expected is None or self.skipped >= self.wait or self._pays()

    def update(self, confidence: torch.Tensor | None) -> None:
        """After a round: `confidence` `[B, S]` of its drafts, None if it skipped drafting."""
        if confidence is None:
            self.skipped += 1
            return
        recent = confidence.double().mean(0).cpu()
        self.expected = recent if self.expected is None else (self.expected + recent) / 2
        self.skipped = 0
        self.wait = 1 if self._pays() else min(2 * self.wait, self.MAX_SKIPPED)

    def _pays(self) -> bool:
        """Whether a round of the expected confidences commits more tokens per second than a plain decode step."""
        confidence = self.expected[None]
        length = choose_draft_length(confidence, self.costs)
        tokens = 1 + float(confidence[0, :length].cumprod(0).sum())
        seconds = self.costs.draft_seconds + max(self.costs.verify_seconds[: length + 1])
        return tokens / seconds > 1 / self.costs.verify_seconds[0]


_measured: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def forget_draft_costs(target: torch.nn.Module) -> None:
    """Drop the costs measured with `target` (after it changed: `optimize_for_cpu`, another device)."""
    _measured.pop(target, None)


@torch.no_grad()
def measure_draft_costs(target, draft, context_length: int = 64, repeats: int = 7) -> DraftCosts:
    """Time a verify pass over the anchor and k drafts for k = 0..S, and a drafting round, after a random context
    of `context_length` tokens; the fastest of `repeats` runs each (on a shared machine the others carry its noise).
    Measured once per target and draft in a process (a few forward passes; `forget_draft_costs` measures again)."""
    known = _measured.setdefault(target, {})
    key = (id(draft), draft.config.num_draft_tokens, str(target.device), target.dtype)
    if key in known:
        return known[key]
    device = target.device
    context = torch.randint(0, draft.config.vocab_size, (1, context_length + draft.config.num_draft_tokens + 1),
                            generator=torch.Generator().manual_seed(0)).to(device)  # fmt: skip
    cache = new_dynamic_cache(target.config)
    keyword = cache_keyword(target)
    prefill = target(context[:, :context_length], output_hidden_states=True, use_cache=True, **{keyword: cache})

    def seconds(run, undo) -> float:
        times = []
        for _ in range(repeats + 1):  # the first run is untimed: first-call allocations
            _synchronize(device)
            start = time.perf_counter()
            run()
            _synchronize(device)
            times.append(time.perf_counter() - start)
            undo()
        return min(times[1:])

    verify = []
    for num_drafts in range(draft.config.num_draft_tokens + 1):
        block = context[:, context_length : context_length + num_drafts + 1]
        verify.append(seconds(lambda: target(block, output_hidden_states=True, use_cache=True, **{keyword: cache}),
                              lambda: cache.crop(-block.shape[1])))  # fmt: skip
    draft_cache = DominoContextCache()
    features = draft.fuse_target_hidden_states(prefill.hidden_states)
    positions = torch.arange(context_length, device=device)[None]
    draft.extend_context(draft_cache, features[:, :-1], positions[:, :-1])
    anchor, anchor_position = context[:, context_length - 1], positions[:, -1]
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    new_features, new_position = features[:, -1:], positions[:, -1:]
    def draft_round():
        draft.draft_block(anchor, anchor_position, draft_cache, embed_tokens, lm_head, new_features, new_position)

    draft_seconds = seconds(draft_round, lambda: draft_cache.crop(-1))
    known[key] = DraftCosts(tuple(verify), draft_seconds)
    return known[key]


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


class CompiledDrafting:
    """What `DominoDraftModel.compile_drafting` builds: the compiled backbone and greedy head (not modules)."""

    def __init__(self, backbone: Callable[..., torch.Tensor], greedy_head: Callable[..., tuple], mode: str,
                 dynamic_backbone: bool):  # fmt: skip
        self.mode, self.dynamic_backbone = mode, dynamic_backbone
        # With dynamic shapes, CUDA graphs would still be recorded once per context length: compile without them.
        backbone_mode = _WITHOUT_CUDA_GRAPHS.get(mode, mode) if dynamic_backbone else mode
        self._backbone_graphs = backbone_mode in _WITHOUT_CUDA_GRAPHS
        self._backbone = torch.compile(backbone, mode=backbone_mode, dynamic=dynamic_backbone)
        self._greedy_head = torch.compile(greedy_head, mode=mode, dynamic=False)

    def backbone(self, *args) -> torch.Tensor:
        """`DominoDraftModel.backbone`, compiled."""
        if not self._backbone_graphs:
            return self._backbone(*args)
        torch.compiler.cudagraph_mark_step_begin()
        return self._backbone(*args).clone()  # the head's graph must not read a buffer a later replay rewrites

    def greedy_head(self, base_logits, draft_hidden, anchor_embeds, weights, *static) -> tuple[torch.Tensor, ...]:
        """The greedy head (`head_domino.greedy_head`), compiled; returns tensors the caller owns."""
        for tensor in weights:
            if isinstance(tensor, torch.Tensor):
                # Weights keep their address across calls: CUDA graphs read them in place instead of copying them
                # into the graph's input buffers every call (parameters are marked so by torch.compile already).
                torch._dynamo.mark_static_address(tensor)
        torch.compiler.cudagraph_mark_step_begin()  # a new drafting round: earlier graph outputs may be overwritten
        outputs = self._greedy_head(base_logits, draft_hidden, anchor_embeds, weights, *static)
        return tuple(output.clone() for output in outputs)  # the next replay overwrites a CUDA graph's outputs


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["COMPILE_MODES", "DRAFT_LENGTHS", "CompiledDrafting", "DraftCosts", "DraftGate", "DraftingOptions",
           "choose_draft_length", "forget_draft_costs", "measure_draft_costs"]  # fmt: skip
