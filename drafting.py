"""Run-time options of drafting and one drafting round (`draft_round`), for the native engine and `generate` alike.

How many of a round's drafts to draft and verify, and whether to draft at all, is a `DraftLengthPolicy`'s: the
package's cost-aware draft length (`domino_spec.cost_aware`), or none, drafting and verifying whole blocks.

Copied into every saved checkpoint with `modeling_domino.py` (`trust_remote_code`): imports only torch and transformers.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from .cache_domino import DominoContextCache

DRAFT_LENGTHS = ("auto", "cost", "full")  # auto: cost-aware on CPU, the whole block elsewhere
AUTO_TREE_NODES = 16  # `tree_nodes=None`'s budget with a cost-aware length: beats chains on CPU (BENCHMARKS.md)


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
    gate_table_max_bytes: int = 0  # > 0: each draft token's GRU input gates in a table, when at most this big
    draft_length: str = "auto"  # "cost": verify as many drafts as pay (`cost_aware.choose_draft_length`); "full": all
    # of them; "auto": "cost" on CPU, "full" on accelerators, where a verify pass costs about the same for any block
    draft_costs: DraftCosts | None = None  # the costs "cost" weighs; None: learned as it runs (`cost_aware.CostModel`)
    prompt_lookup: int = 3  # with a cost-aware length: rounds whose last tokens (up to this many) occurred before
    # verify what followed them there instead of drafting, where that pays (`cost_aware.prompt_lookup`); 0: off
    tree_nodes: int | None = None  # > 0: the native engine's rounds verify a tree of up to this many drafted
    # tokens (`generation.trees`; with a cost-aware length, as many as pay); 0: a chain; None: `AUTO_TREE_NODES` in
    # greedy runs with a cost-aware length that can verify trees, else chains (`tree_budget`). `generate`: chains

    def __post_init__(self):
        pool = self.candidate_pool
        if not (isinstance(pool, int) and not isinstance(pool, bool) and pool >= 0):
            raise ValueError(f"candidate_pool={pool!r} is invalid: expected 0 (off) or a pool size >= 1.")
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"draft_length={self.draft_length!r} is invalid: expected one of {DRAFT_LENGTHS}.")
        lookup = self.prompt_lookup
        if not (isinstance(lookup, int) and not isinstance(lookup, bool) and lookup >= 0):
            raise ValueError(f"prompt_lookup={lookup!r} is invalid: expected 0 (off) or the longest n-gram to match.")
        nodes = self.tree_nodes
        if not (nodes is None or (isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 0)):
            raise ValueError(f"tree_nodes={nodes!r} is invalid: expected None (automatic), 0 (chains) or a count >= 1.")

    def cost_aware(self, device: torch.device) -> bool:
        return self.draft_length == "cost" or (self.draft_length == "auto" and device.type == "cpu")

    def tree_budget(self, device: torch.device, do_sample: bool = False) -> int:
        """The most nodes a round's tree may have on `device` (0: chains): `tree_nodes`, or where it is None
        `AUTO_TREE_NODES` in greedy runs with a cost-aware length (which keeps only the nodes that pay), else chains
        (a sampled chain's drafts are draws, accepted more often than a tree's chosen tokens: BENCHMARKS.md)."""
        if self.tree_nodes is not None:
            return self.tree_nodes
        return AUTO_TREE_NODES if self.cost_aware(device) and not do_sample else 0


@dataclass(frozen=True)
class DraftSampling:
    """How sampled drafting draws each draft: from the draft's own logits over its draft vocabulary, with temperature,
    top-k and top-p applied there (the target's logits processors apply to the target's distribution only). Any
    draft distribution keeps speculative sampling exact as long as the logits it returns are the ones it drew from,
    so these only decide how often drafts are accepted."""

    temperature: float = 1.0
    top_k: int | None = None  # None or 0: off
    top_p: float | None = None  # None or 1: off

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: sampling needs a temperature > 0.")

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[M, V]` with temperature, top-k and top-p applied: -inf outside what may be drawn."""
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:  # None or 0: no top-k
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            logits = nucleus(logits, self.top_p)
        return logits

    def draw(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices `[M]` drawn from softmax of the warped `logits` `[M, V]`, and those warped logits."""
        warped = self.warp(logits.float())
        return torch.multinomial(warped.softmax(-1), 1, generator=generator).squeeze(-1), warped


NUCLEUS_CANDIDATES = 256  # the likeliest tokens `nucleus` sorts, where they hold the nucleus (a whole vocabulary else)


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` `[M, V]` with -inf outside each row's nucleus: the likeliest tokens until they hold `top_p` of the
    probability (the likeliest always kept), as transformers' `TopPLogitsWarper`, but sorting only the likeliest
    `NUCLEUS_CANDIDATES` where they hold it: a verify pass's rows cost a partial sort each, not a whole one (the
    kept tokens may differ from transformers' by float rounding at the boundary, where the whole sort is not run)."""
    num_candidates = min(NUCLEUS_CANDIDATES, logits.shape[-1])
    top, order = logits.topk(num_candidates, dim=-1)  # [M, K], likeliest first
    probs = (top - logits.logsumexp(-1, keepdim=True)).exp()
    likelier = probs.cumsum(-1) - probs  # [M, K]: the probability of the tokens before each
    if num_candidates == logits.shape[-1] or bool((likelier[:, -1] + probs[:, -1] < top_p).any()):
        ascending, order = logits.sort(dim=-1)  # transformers' own computation, where the nucleus is that wide
        outside = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        outside[:, -1] = False
        return logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    kept = top.masked_fill(likelier >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, kept)


def certain_logits(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits `[B, k, V]` giving each of `tokens` `[B, k]` all the probability: the q of a draft that was not drawn
    from a distribution (exact speculative sampling then accepts it with the target's probability of it)."""
    logits = torch.full((*tokens.shape, vocab_size), -torch.inf, device=tokens.device)
    return logits.scatter_(-1, tokens[..., None], 0.0)


class DeviceClock:
    """Wall-clock seconds that wait for the accelerator, so timings are honest on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class DraftLengthPolicy(Protocol):
    """How many tokens a round drafts and verifies, and whether it drafts (`cost_aware.CostAwareDrafting`)."""

    def plan(self, sequences: list[torch.Tensor], limit: int, tree: bool = False) -> torch.Tensor | None: ...
    def worth_drafting(self, batch_size: int) -> int | None: ...
    def lookup_branch(self, sequences: list[torch.Tensor], limit: int) -> list[tuple[torch.Tensor, torch.Tensor]]: ...
    def drafted(self, seconds: float, batch_size: int) -> None: ...
    def length(self, confidence: torch.Tensor, limit: int) -> int: ...
    def tree_size(self, path_probs: torch.Tensor) -> int: ...
    def accepted(self, num_verified: int, num_accepted: list[int], seconds=None, committed=None, remaining=None): ...


@dataclass
class DraftRound:
    """What a round verifies after each row's anchor: `tokens` `[B, k]`, the logits `[B, k, V]` they were drawn from
    (None where none was drawn: greedy decoding, a tree), whether they followed a repeat of the context, and
    for a tree each token's `parents` `[B, k]` (0: the anchor, i: the i-th token; a chain is i - 1 for token i) and
    which tokens only its looked-up branch proposed."""

    tokens: torch.Tensor
    logits: torch.Tensor | None
    looked_up: bool = False
    parents: torch.Tensor | None = None
    lookup_nodes: torch.Tensor | None = None


class DraftTree(NamedTuple):
    """A tree of drafts per row, nodes in the order they were added (every prefix is a tree): `tokens`, `parents`
    (as `DraftRound.parents`) and `path_probs`, the probability the draft gives the path to each node, `[B, N]`; and
    which nodes only the looked-up branch proposed."""

    tokens: torch.Tensor
    parents: torch.Tensor
    path_probs: torch.Tensor
    looked_up: torch.Tensor | None = None


def draft_round(
    draft,
    drafting: DraftLengthPolicy | None,
    past_key_values: DominoContextCache,
    context: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    anchor_ids: torch.LongTensor,
    anchor_position_ids: torch.LongTensor,
    sequences: Callable[[], list[torch.Tensor]],
    limit: int,
    embed_tokens: torch.nn.Module,
    lm_head: torch.nn.Module,
    do_sample: bool = False,
    sampling: DraftSampling | None = None,
    logits_processor: Callable | None = None,
    prefix_ids: torch.LongTensor | None = None,
    generator: torch.Generator | None = None,
    options: DraftingOptions | None = None,
    grow_tree: Callable[..., DraftTree] | None = None,
) -> DraftRound:
    """One round's drafts, for the native engine and `generate(assistant_model=draft)` alike: plan the round (draft,
    verify looked-up tokens, or a plain step: `DraftLengthPolicy.plan`), read the new `context` (target features
    `[B, T_new, F]`, their positions and mask) into the draft's cache (held there unprojected in a round that does
    not draft), draft at most `limit` tokens after each row's anchor, and keep as many as pay
    (`DraftLengthPolicy.length`), having drafted only as many as may pay (`worth_drafting`). `sequences()` gives each
    row's committed tokens, for prompt lookup. The drafting arguments are `DominoDraftModel.draft_block`'s. With
    `grow_tree(block, limit, branches, max_nodes)` the round drafts a tree from the backbone's block instead of a
    chain, with each row's looked-up tokens as one more branch (`DraftLengthPolicy.lookup_branch`), and keeps the
    prefix of its nodes that pays (`DraftLengthPolicy.tree_size`)."""
    committed = sequences() if drafting is not None and limit > 0 else []
    planned = drafting.plan(committed, limit, tree=grow_tree is not None) if committed else None
    if limit == 0 or planned is not None:  # no drafting this round: its context waits for the next that drafts
        past_key_values.defer(*context)
        if planned is None or planned.shape[1] == 0:
            return DraftRound(anchor_ids.new_zeros(anchor_ids.shape[0], 0), None)
        vocab_size = lm_head.weight.shape[0]
        return DraftRound(planned, certain_logits(planned, vocab_size) if do_sample else None, looked_up=True)
    clock = DeviceClock(anchor_ids.device)
    start = clock()
    drafted = drafting.worth_drafting(anchor_ids.shape[0]) if drafting is not None else None
    if grow_tree is not None:  # n nodes are at most n deep, and children come from the slot of their depth
        draft.extend_context(past_key_values, *context)
        block = draft.block_logits(anchor_ids, anchor_position_ids, past_key_values, embed_tokens, lm_head, drafted)
        branches = drafting.lookup_branch(committed, limit) if drafting is not None else []
        grown = grow_tree(block, limit, branches, drafted)
        num_nodes = grown.tokens.shape[1]
        if drafting is not None:
            drafting.drafted(clock() - start, anchor_ids.shape[0])
            num_nodes = drafting.tree_size(grown.path_probs)
        if num_nodes == 0:
            return DraftRound(grown.tokens[:, :0], None)
        lookup_nodes = None if grown.looked_up is None else grown.looked_up[:, :num_nodes]
        return DraftRound(
            grown.tokens[:, :num_nodes], None, parents=grown.parents[:, :num_nodes], lookup_nodes=lookup_nodes
        )
    block = draft.draft_block(
        anchor_ids=anchor_ids,
        anchor_position_ids=anchor_position_ids,
        past_key_values=past_key_values,
        embed_tokens=embed_tokens,
        lm_head=lm_head,
        target_hidden=context[0],
        context_position_ids=context[1],
        context_mask=context[2],
        do_sample=do_sample,
        sampling=sampling,
        logits_processor=logits_processor,
        prefix_ids=prefix_ids,
        generator=generator,
        options=options,
        num_slots=drafted,
    )
    num_drafts = limit
    if drafting is not None:
        drafting.drafted(clock() - start, anchor_ids.shape[0])
        num_drafts = drafting.length(block.confidence, limit)
    return DraftRound(block.tokens[:, :num_drafts], block.logits[:, :num_drafts])


__all__ = [
    "AUTO_TREE_NODES",
    "DRAFT_LENGTHS",
    "DeviceClock",
    "DraftCosts",
    "DraftLengthPolicy",
    "DraftRound",
    "DraftTree",
    "DraftSampling",
    "DraftingOptions",
    "certain_logits",
    "nucleus",
    "draft_round",
]
