"""Native batched speculative decoding with a Domino draft: `speculative_generate`.

Reads top to bottom like gpt-fast: prefill, then rounds of draft -> verify -> accept -> commit -> update caches.

Batching: one target `DynamicCache` and one `DominoContextCache` whose slots stay aligned. Every verify pass feeds
`[anchor, d_1..d_S]` for all rows at positions `row_length - 1 + arange(S + 1)`. A row's rejected slots become holes,
marked 0 in a per-row slot mask that is the target's 2D `attention_mask` (positions are explicit) and the draft
cache's mask. Only the tail invalid for every row is cropped, so batch size one never has holes. The target
features of the verified slots enter the draft cache at the start of the next round. Finished rows leave the batch.

Shapes: B batch (active rows), P prompt, C cache slots, S drafts per block, V vocabulary, F fused target features.
"""

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, DynamicLayer, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DynamicSlidingWindowLayer

from ..cache_domino import DominoContextCache
from ..configuration_domino import check_input_ids
from ..cost_aware import cost_aware_drafting
from ..drafting import (
    DeviceClock,
    DraftingOptions,
    DraftRound,
    DraftSampling,
    DraftTree,
    draft_round,
)
from ..transformers_compat import cache_keyword, new_dynamic_cache, takes_argument, tapped_hidden_states
from .cpu import GROUPED_SDPA, threads_fitted_to_load
from .sampling import build_logits_warpers, greedy_accept, process_logits, rejection_sample, sample
from .trees import (
    accept_tree,
    add_branch,
    grow_tree,
    left_the_first_branch,
    sample_tree,
    tree_attention_mask,
    tree_depths,
)


@dataclass
class SpeculativeOutput:
    """Result of `speculative_generate`.

    Args:
        sequences (`torch.LongTensor` of shape `(batch_size, prompt_length + new_tokens)`): the (left-padded) prompts
            followed by the generated tokens; rows that stopped early are padded with `pad_token_id`, as in
            transformers' `generate`.
        acceptance_lengths (`list[list[int]]`): per row, the tokens committed in each round (accepted drafts + 1,
            fewer where EOS or the length budget cut the round), the prefill's first token excluded; all ones for
            plain decoding.
        position_acceptance_rates (`torch.Tensor` of shape `(num_draft_tokens,)`): for draft position k (1-based,
            k = index + 1), the fraction of rounds verifying a k-th draft (all rows) that accepted it
            (`num_accepted >= k`); NaN where no round verified one. `position_accepted / position_verified`.
        position_accepted, position_verified (`torch.LongTensor` of shape `(num_draft_tokens,)`): those counts, per
            draft position, summed over rounds and rows (to pool runs exactly).
        num_new_tokens (`list[int]`): tokens generated per row.
        prefill_time, draft_time, verify_time, total_time (`float`): seconds; verify includes acceptance.
        num_rounds (`int`): verify passes after the prefill (batched: one pass serves every active row).
        drafts_verified (`int`): drafts the verify passes read, summed over rounds (with the cost-aware draft length,
            fewer than the block's).
        looked_up_rounds (`int`): rounds that verified the tokens following an earlier occurrence of the context's
            last tokens instead of drafts (`DraftingOptions.prompt_lookup`).
        plain_rounds (`int`): rounds that verified nothing after the anchor, plain decode steps: where the
            cost-aware draft length found that neither drafting nor looked-up tokens would pay.
        tree_rounds (`int`): rounds that verified a tree of drafts (`DraftingOptions.tree_nodes`); branch_wins
            (`int`): rows of those rounds whose accepted path left the draft's likeliest branch somewhere;
            lookup_wins (`int`): rows whose accepted path took a node only the looked-up branch proposed.
    """

    sequences: torch.LongTensor
    acceptance_lengths: list[list[int]]
    position_acceptance_rates: torch.Tensor
    position_accepted: torch.LongTensor
    position_verified: torch.LongTensor
    num_new_tokens: list[int]
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    num_rounds: int = 0
    drafts_verified: int = 0
    looked_up_rounds: int = 0
    plain_rounds: int = 0
    tree_rounds: int = 0
    branch_wins: int = 0
    lookup_wins: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens committed per verify round over all rows (tau); 1.0 for plain decoding."""
        rounds = [length for row in self.acceptance_lengths for length in row]
        return sum(rounds) / len(rounds) if rounds else float("nan")


def pooled_position_rates(accepted: list[int], verified: list[int]) -> list[float | None]:
    """Per draft position, the fraction of verified k-th drafts that were accepted, from `position_accepted` and
    `position_verified` summed over several runs; rounded for reports, None where none was verified."""
    return [round(hits / total, 4) if total else None for hits, total in zip(accepted, verified)]


@dataclass
class _Rows:
    """Per-row decoding state of the rows still running (index i of every tensor is the same sequence)."""

    index: torch.LongTensor  # [B] original batch row
    anchor: torch.LongTensor  # [B] last committed token, not yet in the target cache
    length: torch.LongTensor  # [B] committed tokens, the anchor included; the anchor's position is length - 1
    num_generated: torch.LongTensor  # [B]
    slot_mask: torch.Tensor  # [B, C] 1 where the target cache slot holds a committed token
    features: torch.Tensor | None  # [B, T_new, F] target features of slots not yet in the draft cache
    feature_positions: torch.LongTensor | None  # [B, T_new]
    feature_mask: torch.Tensor | None  # [B, T_new]

    def select(self, keep: torch.LongTensor) -> "_Rows":
        def pick(value):
            return None if value is None else value[keep]

        return _Rows(*(pick(getattr(self, name)) for name in self.__dataclass_fields__))


def _token_ids(value, name: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"{name}={value!r} is invalid: expected an int, a list of ints or None.")


def _check_inputs(target, draft, input_ids, attention_mask, max_new_tokens, streamer) -> torch.Tensor:
    """Validate the public arguments; returns the attention mask (all ones when none is given)."""
    if target.config.is_encoder_decoder:
        raise ValueError("speculative_generate supports decoder-only targets only.")
    if draft is not None:
        draft.check_target(target)
    check_input_ids(input_ids, target.get_input_embeddings().weight.shape[0])
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: expected an integer >= 1.")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(f"streamers take one sequence; got batch size {input_ids.shape[0]}.")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}.")
    has_tokens = attention_mask.bool().any(dim=-1)  # [B]; checked first: an empty row fails the padding check too
    if not bool(has_tokens.all()):
        row = int((~has_tokens).nonzero()[0])
        raise ValueError(f"row {row} has no tokens (its attention_mask is all 0): every prompt needs at least one.")
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("speculative_generate needs left padding: the last column of attention_mask must be all 1.")
    return attention_mask.to(input_ids.device)


@dataclass
class _Setup:
    """What every step of one `speculative_generate` call reads and never changes."""

    target: PreTrainedModel
    draft: object | None
    warpers: LogitsProcessorList
    do_sample: bool
    sampling: DraftSampling | None  # how sampled drafts are drawn: the run's temperature, top-k, top-p
    generator: torch.Generator | None
    eos: torch.LongTensor  # [E] stop tokens
    max_new_tokens: int
    num_drafts: int  # S, 0 for plain decoding
    options: DraftingOptions | None
    cache_name: str  # the target forward's cache keyword
    takes_logits_to_keep: bool
    hidden_states: bool | list[int]  # the forward's `output_hidden_states`: the draft's tapped layers, or none
    grow_tree: Callable[..., DraftTree] | None = None  # a round's tree (`trees.grow_tree`), None: chains

    def forward(self, cache, **inputs):
        """The target's forward with its cache, returning tapped hidden states when there is a draft."""
        return self.target(
            use_cache=True, output_hidden_states=self.hidden_states, **{self.cache_name: cache}, **inputs
        )


class _Record:
    """The output buffer and statistics: committed tokens per row, acceptance per round, phase times."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, setup: _Setup, pad_token_id: int):
        batch_size, device = input_ids.shape[0], input_ids.device
        self.prompts = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
        width = setup.max_new_tokens + setup.num_drafts + 1  # room for a whole block past the budget
        self.generated = torch.full((batch_size, width), pad_token_id, dtype=torch.long, device=device)
        self.num_generated = [0] * batch_size
        self.acceptance_lengths: list[list[int]] = [[] for _ in range(batch_size)]
        self.accepted = torch.zeros(setup.num_drafts, dtype=torch.long)  # per draft position
        self.verified = torch.zeros(setup.num_drafts, dtype=torch.long)
        self.draft_time = self.verify_time = 0.0
        self.num_rounds = self.drafts_verified = self.looked_up_rounds = self.plain_rounds = 0
        self.tree_rounds = self.branch_wins = self.lookup_wins = 0

    def tokens(self, row: int) -> torch.Tensor:
        """The committed tokens `[T]` of original row `row`: its prompt and what it generated."""
        return torch.cat([self.prompts[row], self.generated[row, : self.num_generated[row]]])

    def commit(self, rows: _Rows, candidates: torch.Tensor, count: torch.Tensor, is_round: bool) -> None:
        """Append each row's first `count` candidates `[B, S + 1]` after its previous tokens."""
        steps = torch.arange(candidates.shape[1], device=candidates.device)
        offsets = rows.num_generated[:, None] + steps  # [B, S + 1]
        current = self.generated[rows.index[:, None], offsets]
        self.generated[rows.index[:, None], offsets] = torch.where(steps < count[:, None], candidates, current)
        for row, tokens in zip(rows.index.tolist(), count.tolist()):
            self.num_generated[row] += tokens
            if is_round:
                self.acceptance_lengths[row].append(tokens)

    def round(
        self,
        num_accepted: torch.Tensor,
        drafted: DraftRound,
        valid: torch.Tensor,
        depth: int,
        draft_time: float,
        verify_time: float,
    ) -> None:
        """A round's statistics; a tree's positions are its depths (`depth`: the deepest draft verified)."""
        num_drafts = drafted.tokens.shape[1]
        positions = torch.arange(depth, device=num_accepted.device)
        self.accepted[:depth] += (num_accepted[:, None] > positions).sum(0).cpu()
        self.verified[:depth] += num_accepted.shape[0]
        self.draft_time += draft_time
        self.verify_time += verify_time
        self.num_rounds += 1
        self.drafts_verified += num_drafts
        self.looked_up_rounds += drafted.looked_up
        self.plain_rounds += num_drafts == 0
        if drafted.parents is not None:
            self.tree_rounds += 1
            self.branch_wins += int(left_the_first_branch(drafted.parents, valid).sum())
            if drafted.lookup_nodes is not None:
                self.lookup_wins += int((drafted.lookup_nodes & valid[:, 1:]).any(-1).sum())

    def output(self, input_ids: torch.Tensor, prefill_time: float, total_time: float) -> SpeculativeOutput:
        return SpeculativeOutput(
            sequences=torch.cat([input_ids, self.generated[:, : max(self.num_generated)]], dim=-1),
            acceptance_lengths=self.acceptance_lengths,
            position_acceptance_rates=self.accepted.double() / self.verified.double(),
            position_accepted=self.accepted,
            position_verified=self.verified,
            num_new_tokens=self.num_generated,
            prefill_time=prefill_time,
            draft_time=self.draft_time,
            verify_time=self.verify_time,
            total_time=total_time,
            num_rounds=self.num_rounds,
            drafts_verified=self.drafts_verified,
            looked_up_rounds=self.looked_up_rounds,
            plain_rounds=self.plain_rounds,
            tree_rounds=self.tree_rounds,
            branch_wins=self.branch_wins,
            lookup_wins=self.lookup_wins,
        )


@torch.no_grad()
def speculative_generate(
    target: PreTrainedModel,
    draft,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    streamer=None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    options: DraftingOptions | None = None,
) -> SpeculativeOutput:
    r"""
    Lossless speculative decoding of a batch with a Domino draft, or plain decoding with `draft=None`.

    Greedy: each row keeps the longest draft prefix equal to the target's argmax plus the target's token, so the
    output is the target's own greedy decoding. Sampling: exact rejection sampling with the draft's probabilities
    and the residual norm(max(0, p - q)) (down a tree, each node's children in turn: `trees.sample_tree`), so
    outputs are distributed as the target's sampling with the same warpers (note: `top_k=None` means no top-k,
    unlike transformers' generation default of 50).

    Args:
        target: a Hugging Face causal LM; draft: its `DominoDraftModel`, or `None` for plain decoding (same engine,
            for fair timing).
        input_ids (`torch.LongTensor` of shape `(batch_size, prompt_length)`): left-padded prompts.
        attention_mask (*optional*): 0 on left padding.
        eos_token_id: stop tokens; defaults to `target.generation_config.eos_token_id`.
        streamer: a transformers streamer (batch size 1 only); pad_token_id: fills finished rows (default: the
            target's pad token, else the first EOS, else 0). generator: RNG for sampling.
        options (`DraftingOptions`, *optional*): drafting's run-time options, `draft.drafting_options` by default;
            with a cost-aware draft length (on CPU by default) each round verifies only the drafts that pay.
    """
    attention_mask = _check_inputs(target, draft, input_ids, attention_mask, max_new_tokens, streamer)
    setup, pad_token_id = _make_setup(
        target,
        draft,
        input_ids.device,
        max_new_tokens,
        do_sample,
        temperature,
        top_k,
        top_p,
        eos_token_id,
        pad_token_id,
        generator,
        options,
    )
    with threads_fitted_to_load(target):  # a busy machine's cores may not be ours
        clock = DeviceClock(input_ids.device)
        start = clock()
        record = _Record(input_ids, attention_mask, setup, pad_token_id)
        cache = _new_target_cache(target, input_ids.shape[0], setup.num_drafts, _max_slots(setup, input_ids, 0))
        setup.grow_tree = _tree_grower(setup, cache, input_ids)
        draft_cache = DominoContextCache()
        drafting = None
        if draft is not None:
            drafting = cost_aware_drafting(target, draft, setup.options, do_sample, tree=setup.grow_tree is not None)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        rows = _prefill(setup, input_ids, attention_mask, cache, record, streamer)
        finished = torch.isin(rows.anchor, setup.eos) | (rows.num_generated >= max_new_tokens)
        rows = _drop_finished(rows, finished, cache, draft_cache)
        _crop_invalid_tail(rows, cache)
        prefill_time = clock() - start

        while rows.index.numel() > 0:
            budget = max_new_tokens - rows.num_generated  # [B] tokens each row may still commit, >= 1
            limit = min(setup.num_drafts, int(budget.max()) - 1)  # drafts past every row's budget are wasted work
            tick = clock()
            drafted = _draft(setup, rows, record, draft_cache, limit, drafting)
            num_drafts = drafted.tokens.shape[1]  # [B, S] tokens (a tree's nodes) after the anchor
            tock = clock()
            outputs, verify_positions = _verify(setup, rows, drafted, cache)
            accepted_tokens, num_accepted, next_token, valid = _accept(setup, drafted, outputs.logits)
            verify_seconds = clock() - tock
            depth = int((verify_positions - verify_positions[:, :1]).max())  # the deepest draft verified (0: none)
            record.round(num_accepted, drafted, valid, depth, tock - tick, verify_seconds)

            # commit: accepted drafts plus the target's token, cut at EOS and at the length budget
            candidates = torch.cat([accepted_tokens[:, : setup.num_drafts], next_token[:, None]], dim=-1)  # [B, S + 1]
            candidates.scatter_(1, num_accepted[:, None], next_token[:, None])
            if drafting is not None:
                drafting.accepted(num_drafts, num_accepted.tolist(), verify_seconds, candidates, budget.tolist())
            count, finished = _commit_count(setup, candidates, torch.minimum(num_accepted + 1, budget), budget)
            record.commit(rows, candidates, count, is_round=True)
            if streamer is not None:
                streamer.put(candidates[0, : int(count[0])].cpu())

            # update: the anchor's and accepted drafts' slots hold committed tokens, the target's token is the anchor
            rows.anchor, rows.length, rows.num_generated = next_token, rows.length + count, rows.num_generated + count
            rows.slot_mask = torch.cat([rows.slot_mask, valid.to(rows.slot_mask.dtype)], dim=-1)
            rows.features = _masked_features(setup.draft, outputs, valid)
            rows.feature_positions, rows.feature_mask = verify_positions, valid
            rows = _drop_finished(rows, finished, cache, draft_cache)
            _crop_invalid_tail(rows, cache)

        if streamer is not None:
            streamer.end()
        return record.output(input_ids, prefill_time, clock() - start)


def _make_setup(
    target,
    draft,
    device,
    max_new_tokens,
    do_sample,
    temperature,
    top_k,
    top_p,
    eos_token_id,
    pad_token_id,
    generator,
    options,
) -> tuple[_Setup, int]:
    """Resolve defaults from the target's generation config and the draft's options; returns the setup and the pad
    token."""
    config = target.generation_config
    eos_ids = _token_ids(eos_token_id if eos_token_id is not None else config.eos_token_id, "eos_token_id")
    if pad_token_id is None:
        pad_token_id = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    options = options or (draft.drafting_options if draft is not None else None)
    setup = _Setup(
        target=target,
        draft=draft,
        warpers=build_logits_warpers(do_sample, temperature, top_k, top_p),
        do_sample=do_sample,
        sampling=DraftSampling(temperature, top_k, top_p) if do_sample else None,
        generator=generator,
        eos=torch.tensor(eos_ids, dtype=torch.long, device=device),
        max_new_tokens=max_new_tokens,
        num_drafts=draft.config.num_draft_tokens if draft is not None else 0,
        options=options,
        cache_name=cache_keyword(target),
        takes_logits_to_keep=takes_argument(target, "logits_to_keep"),
        hidden_states=tapped_hidden_states(draft.config.target_layer_ids) if draft is not None else False,
    )
    return setup, pad_token_id


def _new_target_cache(target: PreTrainedModel, batch_size: int, num_drafts: int, max_slots: int) -> DynamicCache:
    """The target's cache, checked against what a batch does to it: finished rows leave it (`batch_select_indices`)
    and, with drafts, rejected ones stay in it as masked holes, up to `max_slots` slots per row."""
    cache = new_dynamic_cache(target.config)
    for layer in cache.layers if batch_size > 1 else []:
        if num_drafts and not _ignores_holes(layer, max_slots):
            problem = (
                "would give wrong tokens: a row's rejected drafts stay in them as masked holes, which only full "
                "attention ignores (a sliding window counts them as tokens unless it is wider than prompt + "
                f"max_new_tokens x (drafts + 1) = {max_slots} slots; a recurrent state has absorbed them)"
            )
        elif not hasattr(layer, "batch_select_indices"):
            problem = "cannot drop the rows that finish early"
        else:
            continue
        raise ValueError(
            f"Batched decoding of {type(target).__name__} is not supported: its {type(layer).__name__} cache layers "
            f"{problem}. Decode one prompt at a time (batch size 1)"
            + (", or use `target.generate(..., assistant_model=draft)`." if num_drafts else ".")
        )
    return cache


def _max_slots(setup: _Setup, input_ids: torch.Tensor, tree_nodes: int) -> int:
    """The most cache slots a row can take: its prompt, and every round's verified tokens kept (rejected ones as
    holes), a block's drafts or a tree's `tree_nodes` per committed token at worst."""
    return input_ids.shape[1] + setup.max_new_tokens * (max(setup.num_drafts, tree_nodes) + 1)


def _tree_grower(setup: _Setup, cache, input_ids: torch.Tensor) -> Callable[..., DraftTree] | None:
    """What grows a round's tree under `DraftingOptions.tree_budget`; None for chains, with a warning where the run
    asked for trees (`tree_nodes` > 0) that this target cannot verify."""
    draft, options = setup.draft, setup.options
    num_nodes = options.tree_budget(setup.target.device, setup.do_sample) if draft is not None else 0
    if num_nodes == 0:
        return None
    max_slots = _max_slots(setup, input_ids, num_nodes)
    attention = setup.target.config._attn_implementation
    if draft.head is None:
        problem = "the draft has no Domino head to roll along each branch"
    elif attention not in ("eager", "sdpa", GROUPED_SDPA):
        problem = f"its {attention!r} attention takes no tree mask (eager and sdpa do)"
    elif not all(_ignores_holes(layer, max_slots) for layer in cache.layers):
        problem = "a tree's unaccepted nodes stay in its cache as masked holes, which only full attention ignores"
    else:
        embed_tokens = setup.target.get_input_embeddings()

        def grow(
            block, max_depth: int, branches: list[tuple[torch.Tensor, torch.Tensor]], max_nodes: int | None = None
        ) -> DraftTree:
            drafted = num_nodes if max_nodes is None else min(num_nodes, max_nodes)
            tree = grow_tree(draft, block, embed_tokens, drafted, max_depth, options, setup.sampling)
            return add_branch(tree, branches, num_nodes)  # looked-up tokens cost no drafting

        return grow
    if options.tree_nodes is not None:  # automatic trees fall back to chains silently
        warnings.warn(f"tree_nodes={num_nodes}: verifying chains instead, since {problem}.", stacklevel=3)
    return None


def _ignores_holes(layer, max_slots: int) -> bool:
    """Whether masked slots leave what a row attends to unchanged: in full attention, and in a sliding window too
    wide to ever slide over the cache."""
    if type(layer) is DynamicSlidingWindowLayer:
        return layer.sliding_window > max_slots
    return type(layer) is DynamicLayer


def _prefill(setup: _Setup, input_ids, attention_mask, cache, record: _Record, streamer) -> _Rows:
    """Fill the target cache with the prompts and pick the first token as plain decoding would; the prompts'
    features wait in the returned state for the first draft."""
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # as transformers
    outputs = setup.forward(
        cache,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        **({"logits_to_keep": 1} if setup.takes_logits_to_keep else {}),
    )
    logits = process_logits(setup.warpers, outputs.logits[:, -1])  # [B, V]
    first = sample(logits.softmax(-1), setup.generator) if setup.do_sample else logits.argmax(-1)
    batch_size = input_ids.shape[0]
    rows = _Rows(
        index=torch.arange(batch_size, device=input_ids.device),
        anchor=first,
        length=attention_mask.long().sum(-1) + 1,
        num_generated=torch.zeros(batch_size, dtype=torch.long, device=input_ids.device),
        slot_mask=attention_mask,
        features=_masked_features(setup.draft, outputs, attention_mask),
        feature_positions=positions,
        feature_mask=attention_mask,
    )
    record.commit(rows, first[:, None], torch.ones_like(first), is_round=False)
    rows.num_generated = rows.num_generated + 1
    if streamer is not None:
        streamer.put(first.cpu())
    return rows


def _draft(
    setup: _Setup, rows: _Rows, record: _Record, draft_cache: DominoContextCache, limit: int, drafting
) -> DraftRound:
    """The round's drafts (`drafting.draft_round`): at most `limit`, none for plain decoding. The features of the
    slots verified last round enter the draft cache first, so both caches stay aligned."""
    if setup.draft is None:
        return DraftRound(rows.anchor.new_zeros(rows.anchor.shape[0], 0), None)
    context = (rows.features, rows.feature_positions, rows.feature_mask)
    rows.features = rows.feature_positions = rows.feature_mask = None
    return draft_round(
        setup.draft,
        drafting,
        draft_cache,
        context,
        anchor_ids=rows.anchor,
        anchor_position_ids=rows.length - 1,
        sequences=lambda: [record.tokens(row) for row in rows.index.tolist()],
        limit=limit,
        embed_tokens=setup.target.get_input_embeddings(),
        lm_head=setup.target.get_output_embeddings(),
        do_sample=setup.do_sample,
        sampling=setup.sampling,
        generator=setup.generator,
        options=setup.options,
        grow_tree=setup.grow_tree,
    )


def _verify(setup: _Setup, rows: _Rows, drafted: DraftRound, cache):
    """The target reads `[anchor, d_1..d_S]` of every row after its committed slots (holes masked); a tree's nodes
    see their ancestors only, at the anchor's position plus their depth."""
    verify_ids = torch.cat([rows.anchor[:, None], drafted.tokens], dim=-1)  # [B, S + 1]
    if drafted.parents is None:
        offsets = torch.arange(verify_ids.shape[1], device=verify_ids.device)
        attention_mask = torch.cat([rows.slot_mask, torch.ones_like(verify_ids)], dim=-1)  # [B, C + S + 1]
    else:
        offsets = tree_depths(drafted.parents)
        attention_mask = tree_attention_mask(drafted.parents, rows.slot_mask, setup.target.dtype)
    positions = (rows.length - 1)[:, None] + offsets
    outputs = setup.forward(cache, input_ids=verify_ids, attention_mask=attention_mask, position_ids=positions)
    return outputs, positions


def _accept(setup: _Setup, drafted: DraftRound, target_logits):
    """Greedy matching, or exact rejection sampling on processed logits, along a chain or down a tree: the accepted
    drafts `[B, S]` (left-aligned), their count `[B]`, the target's next token `[B]`, and the verify slots holding
    committed tokens `[B, S + 1]`."""
    if drafted.parents is not None and setup.do_sample:  # processes only the slots its rows reach
        return sample_tree(drafted.tokens, drafted.parents, target_logits, setup.warpers, setup.generator)
    target_logits = process_logits(setup.warpers, target_logits)  # [B, S + 1, V]
    if drafted.parents is not None:
        return accept_tree(drafted.tokens, drafted.parents, target_logits)
    if not setup.do_sample:
        num_accepted, next_token = greedy_accept(drafted.tokens, target_logits)
    else:
        # q: the distributions the drafts were drawn from (none in plain decoding)
        draft_probs = target_logits[:, :0] if drafted.logits is None else drafted.logits.float().softmax(-1)
        num_accepted, next_token = rejection_sample(
            drafted.tokens, draft_probs, target_logits.softmax(-1), setup.generator
        )
    valid = torch.arange(drafted.tokens.shape[1] + 1, device=num_accepted.device) <= num_accepted[:, None]
    return drafted.tokens, num_accepted, next_token, valid


def _commit_count(setup: _Setup, candidates, count, budget) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row's `count` committed candidates `[B, S + 1]` after its first EOS; returns the count and whether
    the row is finished (EOS committed or budget used)."""
    within = torch.arange(candidates.shape[1], device=candidates.device)[None, :] < count[:, None]
    is_eos = torch.isin(candidates, setup.eos) & within  # [B, S + 1]
    has_eos = is_eos.any(-1)
    count = torch.where(has_eos, is_eos.long().argmax(-1) + 1, count)
    return count, has_eos | (count >= budget)


def _masked_features(draft, outputs, mask: torch.Tensor) -> torch.Tensor | None:
    """Fused target features `[B, T, F]` of a forward's tokens, zero on slots that hold no committed token.

    Zeroing keeps padding and rejected slots finite in the draft cache (they are masked there, but a NaN value
    would still poison attention through 0 * NaN).
    """
    if draft is None:
        return None
    features = draft.fuse_target_hidden_states(outputs.hidden_states)
    features = features[:, -mask.shape[1] :]
    return features * mask[..., None].to(features.dtype)


def _drop_finished(rows: _Rows, finished: torch.Tensor, cache, draft_cache: DominoContextCache) -> _Rows:
    """Remove finished rows from the state and both caches."""
    if not bool(finished.any()):
        return rows
    keep = (~finished).nonzero().squeeze(1)
    if keep.numel() > 0:
        cache.batch_select_indices(keep)
        if draft_cache.get_seq_length() > 0:
            draft_cache.select_rows(keep)
    return rows.select(keep)


def _crop_invalid_tail(rows: _Rows, cache) -> None:
    """Crop the last slots that hold no committed token in any row, from the target cache, the slot mask and the
    pending features (the draft cache receives only the kept part at the next round)."""
    if rows.index.numel() == 0:
        return
    invalid_everywhere = ~rows.slot_mask.bool().any(0)  # [C]
    num_invalid = int(invalid_everywhere.flip(0).long().cumprod(0).sum())  # trailing slots invalid in every row
    if rows.features is not None:
        num_invalid = min(num_invalid, rows.features.shape[1])
    cache.crop(-num_invalid)  # even when 0: it trims sliding-window layers back to their window
    if num_invalid == 0:
        return
    rows.slot_mask = rows.slot_mask[:, :-num_invalid]
    if rows.features is not None:
        keep = rows.features.shape[1] - num_invalid
        rows.features = rows.features[:, :keep]
        rows.feature_positions = rows.feature_positions[:, :keep]
        rows.feature_mask = rows.feature_mask[:, :keep]


__all__ = ["SpeculativeOutput", "pooled_position_rates", "speculative_generate"]
