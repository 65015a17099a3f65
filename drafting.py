"""Run-time options of drafting, the cost-aware draft length (how many of a block's drafts to verify), prompt lookup
rounds, and compiled drafting.

A verify pass over the anchor and k drafts takes `verify_seconds[k]`, which on a CPU grows with k, and commits in
expectation `1 + sum_{i<=k} c_1 ... c_i` tokens, `c_i` the draft's confidence in its i-th token (the probability
its distribution gives its most likely token). `choose_draft_length` picks the k with the most expected tokens per
second, `(1 + sum ...) / (draft_seconds + verify_seconds[k])`. When sampling, it adds drafts while they raise that
rate instead: whether draft i is verified then depends on the confidences of drafts 1..i only, properties of the
distributions the draft samples from (which depend on the drafts before i, never on draft i itself), a stopping rule
under which exact speculative sampling stays exact. A round drafts at all only when rounds like the recent ones beat
a plain decode step (`CostAwareDrafting`): it would pay for the drafting round even if it then verified no draft.
Where the context's last tokens occurred before, the tokens that followed them there cost no drafting at all
(`prompt_lookup`); a round verifies them instead of drafts where the run's earlier such rounds say that pays more.

Copied into every saved checkpoint with `modeling_domino.py` (`trust_remote_code`): imports only torch and
transformers.
"""

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

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

    candidate_pool: int = 0  # > 0: greedy slots correct only their best base tokens, the rest get -inf (0: all)
    fused_step: bool = False  # greedy pooled drafting on CUDA: one Triton kernel per slot (needs a pool)
    gate_table_max_bytes: int = 256 * 2**20  # precompute every draft token's GRU input gates when at most this big
    draft_length: str = "auto"  # "cost": verify as many drafts as pay (`choose_draft_length`); "full": all of them;
    # "auto": "cost" on CPU, "full" on accelerators, where a verify pass costs about the same for any block
    draft_costs: DraftCosts | None = None  # the costs "cost" weighs; None: measured once per process, target, draft
    prompt_lookup: int = 3  # with a cost-aware length: rounds whose last tokens (up to this many) occurred before
    # verify what followed them there instead of drafting, where that pays (`prompt_lookup`); 0: off

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
        lookup = self.prompt_lookup
        if not (isinstance(lookup, int) and not isinstance(lookup, bool) and lookup >= 0):
            raise ValueError(f"prompt_lookup={lookup!r} is invalid: expected 0 (off) or the longest n-gram to match.")

    def check_device(self, device: torch.device) -> None:
        """`RuntimeError` if the fused step cannot run on `device`."""
        if self.fused_step and not kernel_runs_on(device):
            raise RuntimeError(
                f"fused_step runs a Triton kernel on CUDA, but the draft is on {device} and Triton is "
                f"{'installed' if triton_available() else 'not installed'}: draft with fused_step=False there."
            )

    def cost_aware(self, device: torch.device) -> bool:
        return self.draft_length == "cost" or (self.draft_length == "auto" and device.type == "cpu")


def expected_rates(confidence: torch.Tensor, costs: DraftCosts) -> list[float]:
    """The expected tokens per second of a round verifying k = 0..S of the drafts, for `confidence` `[B, S]` (every
    row verifies the same number) and the round's costs (the verify cost taken non-decreasing in k, so one noisy
    measurement cannot make a longer pass look cheaper)."""
    num_drafts = min(confidence.shape[1], len(costs.verify_seconds) - 1)
    confidence = confidence[:, :num_drafts].double().nan_to_num(0.0)  # NaN: a slot that had no finite logit
    reach = confidence.cumprod(dim=1).sum(dim=0)  # [S]: rows reaching draft i
    expected = confidence.shape[0] + torch.cat([reach.new_zeros(1), reach.cumsum(0)])  # [S + 1]: for k = 0..S drafts
    seconds = costs.draft_seconds + torch.tensor(costs.verify_seconds[: num_drafts + 1]).cummax(0).values
    return (expected / seconds).tolist()


def choose_draft_length(confidence: torch.Tensor, costs: DraftCosts, look_ahead: bool = False) -> int:
    """How many of the drafts to verify, by their `expected_rates`.

    Stops at the first draft that lowers the round's expected tokens per second: a stopping rule, which exact
    sampling needs (a draft's confidence depends on the drafts before it). With `look_ahead`, for greedy decoding and
    for tokens not drawn from the draft, the length with the most expected tokens per second over all lengths
    (a CPU's verify cost can jump at two drafts and stay flat after, where only a longer block pays).
    """
    rates = expected_rates(confidence, costs)
    if look_ahead:
        return _fastest(rates)
    falls = [k for k in range(len(rates) - 1) if rates[k + 1] < rates[k]]
    return falls[0] if falls else len(rates) - 1


def _fastest(rates: list[float]) -> int:
    return max(range(len(rates)), key=lambda k: (rates[k], -k))  # the shortest of equally fast lengths


def prompt_lookup(sequence: torch.Tensor, max_ngram_size: int, max_tokens: int) -> tuple[torch.Tensor, int]:
    """The tokens `[L]` (at most `max_tokens`) that followed the latest earlier occurrence of the last n tokens of
    `sequence` `[T]`, for the largest n <= `max_ngram_size` that occurred before, and n; an empty tensor and 0 where
    none did (prompt lookup decoding: text often repeats its prompt or itself)."""
    for size in range(min(max_ngram_size, sequence.shape[0] - 1), 0, -1):
        windows = sequence[:-1].unfold(0, size, 1)  # [T - size, size]: the n-grams a token follows
        starts = (windows == sequence[-size:]).all(-1).nonzero().flatten()
        if starts.numel() > 0:
            start = int(starts[-1]) + size
            return sequence[start : start + max_tokens], size
    return sequence[:0], 0


def certain_logits(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits `[B, k, V]` giving each of `tokens` `[B, k]` all the probability: the q of a draft that was not drawn
    from a distribution (exact speculative sampling then accepts it with the target's probability of it)."""
    logits = torch.full((*tokens.shape, vocab_size), -torch.inf, device=tokens.device)
    return logits.scatter_(-1, tokens[..., None], 0.0)


class CostAwareDrafting:
    """The cost-aware draft length of one decoding run: before a round, whether to draft it, verify the tokens that
    followed a repeat of the context instead, or decode plainly (`plan`); after drafting, how many of the drafts to
    verify (`length`); after verifying, how far looked-up tokens were accepted (`accepted`).

    A round that drafts pays the drafting round even when it then verifies no draft. So it drafts only when a round
    with the recent confidences (an average that halves the weight of each older round) would commit more tokens per
    second than a plain decode step; skipping, it looks again after 1, 2, 4, ... up to `MAX_SKIPPED` rounds. A
    looked-up round costs no drafting; how far its tokens are accepted is estimated per matched n-gram size and
    position from the run's earlier looked-up rounds. Every decision depends on earlier rounds, the committed tokens
    and the distributions of the drafts up to the one decided, so sampling stays exact.
    """

    MAX_SKIPPED = 16

    def __init__(self, costs: DraftCosts, prompt_lookup: int = 0, do_sample: bool = False):
        self.costs = costs
        self.look_ahead = not do_sample  # greedy drafts may be verified for their successors' confidence too
        self.expected: torch.Tensor | None = None  # [S]: the recent confidences, per draft position
        self.pays, self.skipped, self.wait = True, 0, 1
        self.max_ngram_size = prompt_lookup
        # Per matched n-gram size and position: looked-up tokens accepted, and verified with all before them accepted.
        # The counts start at one of two, a prior of one half.
        num_drafts = len(costs.verify_seconds) - 1
        self.lookup_accepted = torch.ones(prompt_lookup, num_drafts, dtype=torch.float64)
        self.lookup_reached = torch.full((prompt_lookup, num_drafts), 2.0, dtype=torch.float64)
        self.looked_up: list[int] = []  # the n-gram size of each row of the last looked-up round, empty after drafting

    def plan(self, sequences: list[torch.Tensor], limit: int) -> torch.Tensor | None:
        """Before a round, given each row's committed tokens: None to draft it; else the tokens `[B, k]` to verify
        instead, k <= `limit`: those that followed an earlier occurrence of each row's last tokens
        (`prompt_lookup`) where verifying them is expected to commit tokens faster than drafting or a plain step,
        or none (k = 0) for a plain step."""
        looked_up = self._look_up(sequences, limit)
        if looked_up is None and (self.pays or self.skipped >= self.wait):
            return None
        self.skipped += 1
        return looked_up if looked_up is not None else sequences[0].new_zeros(len(sequences), 0)

    def _look_up(self, sequences: list[torch.Tensor], limit: int) -> torch.Tensor | None:
        self.looked_up = []
        if self.max_ngram_size == 0 or limit == 0:
            return None
        found, lengths = [], []
        for sequence in sequences:
            tokens, size = prompt_lookup(sequence, self.max_ngram_size, limit)
            length = self._lookup_length(size, tokens.shape[0]) if size else 0
            if length == 0:
                return None
            found.append((tokens, size))
            lengths.append(length)
        self.looked_up = [size for _, size in found]
        return torch.stack([tokens[: min(lengths)] for tokens, _ in found])

    def accepted(self, num_verified: int, num_accepted: list[int]) -> None:
        """After verifying: how many of the `num_verified` drafts each row accepted (learns from looked-up rounds)."""
        positions = torch.arange(num_verified)
        for size, count in zip(self.looked_up, num_accepted):
            self.lookup_reached[size - 1, :num_verified] += (positions <= count).double()
            self.lookup_accepted[size - 1, :num_verified] += (positions < count).double()
        self.looked_up = []

    def length(self, confidence: torch.Tensor, limit: int) -> int:
        """After drafting: how many drafts of `confidence` `[B, S]` to verify, at most `limit`."""
        recent = confidence.double().nan_to_num(0.0).mean(0).cpu()  # NaN: a slot that had no finite logit
        self.expected = recent if self.expected is None else (self.expected + recent) / 2
        self.pays = max(expected_rates(self.expected[None], self.costs)) > 1 / self.costs.verify_seconds[0]
        self.skipped, self.wait = 0, 1 if self.pays else min(2 * self.wait, self.MAX_SKIPPED)
        return min(limit, choose_draft_length(confidence, self.costs, self.look_ahead))

    def _lookup_length(self, ngram_size: int, num_tokens: int) -> int:
        """How many of `num_tokens` looked-up tokens to verify: 0 where a drafting round (if it pays) or a plain step
        is expected to commit tokens faster."""
        rates = self.lookup_accepted[ngram_size - 1, :num_tokens] / self.lookup_reached[ngram_size - 1, :num_tokens]
        looked_up = expected_rates(rates[None], DraftCosts(self.costs.verify_seconds, 0.0))  # no drafting round
        best_other = 1 / self.costs.verify_seconds[0]
        if self.pays and self.expected is not None:
            best_other = max(best_other, *expected_rates(self.expected[None], self.costs))
        best = _fastest(looked_up)
        return best if looked_up[best] > best_other else 0


def cost_aware_drafting(target, draft, options: DraftingOptions, batch_size: int = 1,
                        do_sample: bool = False) -> CostAwareDrafting | None:  # fmt: skip
    """The cost-aware draft length of a run (sampling or not), with the given costs or those measured here; None
    where `options` verify every draft."""
    if not options.cost_aware(target.device):
        return None
    costs = options.draft_costs or measure_draft_costs(target, draft, options, batch_size)
    return CostAwareDrafting(costs, options.prompt_lookup, do_sample)


_measured: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()


def forget_draft_costs(model: torch.nn.Module) -> None:
    """Drop the costs measured with `model`, a target or a draft (after it changed: `optimize_for_cpu`, compiled
    drafting, another device)."""
    _measured.pop(model, None)
    for drafts in _measured.values():
        drafts.pop(model, None)


@torch.no_grad()
def measure_draft_costs(
    target, draft, options: DraftingOptions | None = None, batch_size: int = 1, context_length: int = 64,
    repeats: int = 7,
) -> DraftCosts:  # fmt: skip
    """Time a verify pass over the anchor and k drafts for k = 0..S, and a drafting round under `options`, for
    `batch_size` rows after a random context of `context_length` tokens; the fastest of `repeats` runs each (on a
    shared machine the others carry its noise). Measured once per target, draft, options and batch size in a process
    (a few forward passes; `forget_draft_costs` measures again); options that only choose what to verify (the draft
    length, its costs, prompt lookup) share one measurement."""
    options = options or draft.drafting_options
    known = _measured.setdefault(target, weakref.WeakKeyDictionary()).setdefault(draft, {})
    round_options = replace(options, draft_length="auto", draft_costs=None, prompt_lookup=0)  # what a round runs
    key = (round_options, batch_size, str(target.device), target.dtype)
    if key in known:
        return known[key]
    device, num_drafts = target.device, draft.config.num_draft_tokens
    context = torch.randint(0, draft.config.vocab_size, (batch_size, context_length + num_drafts + 1),
                            generator=torch.Generator().manual_seed(0)).to(device)  # fmt: skip
    cache, keyword = new_dynamic_cache(target.config), cache_keyword(target)
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
    for count in range(num_drafts + 1):
        block = context[:, context_length : context_length + count + 1]
        verify.append(seconds(lambda: target(block, output_hidden_states=True, use_cache=True, **{keyword: cache}),
                              lambda: cache.crop(-block.shape[1])))  # fmt: skip
    draft_cache = DominoContextCache()
    features = draft.fuse_target_hidden_states(prefill.hidden_states)
    positions = torch.arange(context_length, device=device).expand(batch_size, -1)
    draft.extend_context(draft_cache, features[:, :-1], positions[:, :-1])
    anchor, anchor_position = context[:, context_length - 1], positions[:, -1]
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()

    def draft_round():
        draft.draft_block(anchor, anchor_position, draft_cache, embed_tokens, lm_head, features[:, -1:],
                          positions[:, -1:], options=options)  # fmt: skip

    known[key] = DraftCosts(tuple(verify), seconds(draft_round, lambda: draft_cache.crop(-1)))
    return known[key]


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


class CompiledDrafting:
    """What `DominoDraftModel.compile_drafting` builds: the compiled backbone and greedy head (not modules)."""

    def __init__(self, backbone: Callable[..., torch.Tensor], greedy_head: Callable[..., tuple], mode: str,
                 dynamic_backbone: bool):  # fmt: skip
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


__all__ = ["COMPILE_MODES", "DRAFT_LENGTHS", "CompiledDrafting", "CostAwareDrafting", "DraftCosts", "DraftingOptions",
           "certain_logits", "choose_draft_length", "cost_aware_drafting", "expected_rates", "forget_draft_costs",
           "measure_draft_costs", "prompt_lookup"]  # fmt: skip
