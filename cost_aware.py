"""The cost-aware draft length: how many of a block's drafts to verify, whether a round drafts at all, and prompt
lookup rounds, with the costs learned from the process's own rounds.

A verify pass over the anchor and k drafts takes `verify_seconds[k]`, which on a CPU grows with k, and commits in
expectation `1 + sum_{i<=k} c_1 ... c_i` tokens, `c_i` the draft's confidence in its i-th token (the probability
its distribution gives its most likely token). `choose_draft_length` picks the k with the most expected tokens per
second, `(1 + sum ...) / (draft_seconds + verify_seconds[k])`. When sampling, it adds drafts while they raise that
rate instead: whether draft i is verified then depends on the confidences of drafts 1..i only, properties of the
distributions the draft samples from (which depend on the drafts before i, never on draft i itself), a stopping rule
under which exact speculative sampling stays exact. A round drafts at all only when rounds like the recent ones beat
a plain decode step (`CostAwareDrafting`): it would pay for the drafting round even if it then verified no draft.
The costs are learned from the process's own rounds as it decodes (`CostModel`), starting from what earlier
processes on this machine learned with the same models (`draft_costs_path`), else from a prior: no call measures
anything up front.
Where the context's last tokens occurred before, the tokens that followed them there cost no drafting at all
(`prompt_lookup`); a round verifies them instead of drafts where the run's earlier repeats say that pays more: those
verified, and those passed over, checked against the tokens committed after them.

Part of the package, not of a checkpoint: a checkpoint's `generate(assistant_model=draft)` uses it where the package
is installed (`generation_domino.py`), and verifies whole blocks without it.
"""

import atexit
import math
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from .drafting import DraftCosts, DraftingOptions
from .machine import cache_path, machine_key, read_cache, write_cache


def expected_rates(reach: torch.Tensor, costs: DraftCosts) -> list[float]:
    """The expected tokens per second of a round verifying k = 0..S tokens after the anchor, for `reach` `[B, S]`,
    the probability that each row accepts its i-th verified token (in a chain, the product of the confidences up to
    it; in a tree, its path's), every row verifying the same number, and the round's costs (the verify cost taken
    non-decreasing in k, so one noisy measurement cannot make a longer pass look cheaper)."""
    expected, seconds = _expected_tokens_and_seconds(reach, costs)
    return (expected / seconds).tolist()


def _expected_tokens_and_seconds(reach: torch.Tensor, costs: DraftCosts) -> tuple[torch.Tensor, torch.Tensor]:
    num_drafts = min(reach.shape[1], len(costs.verify_seconds) - 1)
    accepted = reach[:, :num_drafts].double().nan_to_num(0.0).sum(dim=0)  # [S]; NaN: a slot with no finite logit
    expected = reach.shape[0] + torch.cat([accepted.new_zeros(1), accepted.cumsum(0)])  # [S + 1]: for k = 0..S
    seconds = costs.draft_seconds + torch.tensor(costs.verify_seconds[: num_drafts + 1]).cummax(0).values
    return expected, seconds


def choose_draft_length(confidence: torch.Tensor, costs: DraftCosts, look_ahead: bool = False) -> int:
    """How many of the drafts to verify, by `expected_rates`: the most expected tokens per second, or, where no
    length beats a plain decode step (the drafting round is already paid), the length that loses least against
    plain steps in the same time (the most expected tokens beyond what plain steps would commit meanwhile).

    Adds drafts while each raises that measure: a stopping rule, which exact sampling needs (a draft's confidence
    depends on the drafts before it). With `look_ahead`, for greedy decoding and for tokens not drawn from the
    draft, the best length over all lengths (a CPU's verify cost can jump at two drafts and stay flat after, where
    only a longer block pays).
    """
    reach = confidence.double().nan_to_num(0.0).cumprod(dim=1)
    if look_ahead:
        return _best_length(reach, costs)
    expected, seconds = _expected_tokens_and_seconds(reach, costs)
    plain_rate = reach.shape[0] / costs.verify_seconds[0]  # tokens per second of plain steps, every row
    num_drafts = 0
    while num_drafts + 1 < len(expected):
        rate = max(plain_rate, float(expected[num_drafts] / seconds[num_drafts]))
        gained = expected[num_drafts + 1] - expected[num_drafts]
        if gained <= rate * (seconds[num_drafts + 1] - seconds[num_drafts]):
            break
        num_drafts += 1
    return num_drafts


def _best_length(reach: torch.Tensor, costs: DraftCosts) -> int:
    """The k with the most expected tokens per second, or the fewest lost against plain steps where none beats them
    (`choose_draft_length` looking ahead)."""
    expected, seconds = _expected_tokens_and_seconds(reach, costs)
    rate = max(reach.shape[0] / costs.verify_seconds[0], float((expected / seconds).max()))
    return _fastest((expected - rate * seconds).tolist())


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


# Until a run has timed them, a verify pass over k drafts is taken to cost (1 + k / 10) decode steps and a drafting
# round a quarter of one: about this CPU's curve for a small target (BENCHMARKS.md), and optimistic enough that a run
# tries drafting and so times what it really costs.
PRIOR_VERIFY_STEPS_PER_DRAFT = 0.1
PRIOR_DRAFT_STEPS = 0.25
NEW_TIMING_WEIGHT = 0.3  # each timing's weight in the running estimate: recent rounds count most (machine load moves)
MAX_TIMING_JUMP = 2.0  # a timing counts as at most this many times the estimate: a stall is not the machine's speed
# A count that looks dear is not verified again, so nothing would correct a pessimistic estimate of it (one timed in a
# stall, or in an earlier process under load: held on disk, it would last). Shorter counts are capped by longer ones;
# while a longer count goes untimed for more than STALE_AFTER timings (or was timed by an earlier process), each timing
# of a shorter pass with drafts moves its excess over what the prior shape predicts from that one by STALE_RELAXATION.
STALE_AFTER = 16
STALE_RELAXATION = 0.05
# A loss read back from an earlier process limits a process to looks at that batch size (`_delivered`) until its own
# drafted rounds deliver more: one timed in a slow spell (a profiler, a busy machine) would hold drafting back for
# many processes. So each process that reads a stored loss takes this share of it back.
STORED_LOSS_RECOVERY = 0.5
# Between a process's writes of what it learned at a call's start: replacing a file costs tens of milliseconds on some
# file systems (ext4 flushes a file renamed over another), a decode step or two of a short call.
SAVE_INTERVAL_SECONDS = 60.0


class CostModel:
    """What a round costs at one batch size and context length, learned from a process's own verify passes and drafting
    rounds (all but the first, which builds the draft's kernels for the batch's shapes), so no call pays an up-front
    measurement: a running average of the timings of each draft count, capped by every longer count's (a pass never
    costs more than a longer one: a count that looked dear after a stall, or in an earlier process, and so is not
    verified again, is corrected by the counts that are), drifting, where it was not timed for a while and is dearer
    than the prior shape predicts from the shorter passes timed meanwhile, toward that prediction (`STALE_RELAXATION`:
    a longer pass that once looked dear is tried again), and where a count was never timed the prior shape scaled to
    the nearest timed count. The prior shape is `prior`'s (the costs learned at another batch size), else
    `PRIOR_VERIFY_STEPS_PER_DRAFT` and `PRIOR_DRAFT_STEPS`. Every decision weighs ratios of costs, so before any timing
    the prior alone decides."""

    def __init__(self, num_drafts: int, prior: DraftCosts | None = None):
        self.verify_seconds: list[float | None] = [None] * (num_drafts + 1)
        self.timings = 0
        self.last_timed: list[int | None] = [None] * (num_drafts + 1)  # per count: `timings` when last timed here
        self.draft_seconds: float | None = None  # rounds drafting back to back, each reading the last round's context
        self.catch_up_seconds: float | None = None  # rounds reading more: a call's prompt, skipped rounds' context
        self.draft_rounds = 0
        if prior is None:
            prior = DraftCosts(tuple(_prior_steps(k) for k in range(num_drafts + 1)), PRIOR_DRAFT_STEPS)
        self.prior = prior

    def observe_verify(self, num_drafts: int, seconds: float) -> None:
        previous = self.verify_seconds[num_drafts]
        if self.last_timed[num_drafts] is None and self.knows_plain_step:
            # this process's first timing of the count, weighed against what the others predict, replaces an earlier
            # process's: that one may come from a slow spell, and a count that looks dear is seldom timed again
            seconds, previous = min(seconds, MAX_TIMING_JUMP * self.costs().verify_seconds[num_drafts]), None
        self.verify_seconds[num_drafts] = _average(previous, seconds)
        self.timings += 1
        self.last_timed[num_drafts] = self.timings
        if num_drafts > 0:  # plain steps say little of how a pass grows with drafts (steeply, in a wide batch)
            self._relax_stale_longer(num_drafts)

    def _relax_stale_longer(self, timed: int) -> None:
        scale = self.verify_seconds[timed] / self.prior.verify_seconds[timed]
        for longer in range(timed + 1, len(self.verify_seconds)):
            estimate, predicted = self.verify_seconds[longer], scale * self.prior.verify_seconds[longer]
            last_timed = self.last_timed[longer]
            stale = last_timed is None or self.timings - last_timed > STALE_AFTER
            if estimate is not None and estimate > predicted and stale:
                self.verify_seconds[longer] = estimate - STALE_RELAXATION * (estimate - predicted)

    def observe_draft(self, seconds: float, catch_up: bool = False) -> None:
        """A drafting round took `seconds`; a `catch_up` round also read context no drafting round read before (a
        call's prompt, the context of rounds that did not draft), so the two are priced apart: a look after skipped
        rounds costs what catching up costs, drafting back to back what `draft_seconds` says."""
        self.draft_rounds += 1
        if self.draft_rounds == 1:  # the first round at a batch size builds the draft's kernels for its shapes
            return
        if catch_up:
            self.catch_up_seconds = _average(self.catch_up_seconds, seconds)
        else:
            self.draft_seconds = _average(self.draft_seconds, seconds)

    @property
    def knows_plain_step(self) -> bool:
        """Whether a plain decode step was timed: the cost every alternative is weighed against."""
        return self.verify_seconds[0] is not None

    @property
    def timed_drafts(self) -> bool:
        """Whether this process timed a verify pass over drafts (restored timings are an earlier process's)."""
        return any(timings is not None for timings in self.last_timed[1:])

    @property
    def drafting_timed(self) -> bool:
        """Whether this process timed a drafting round past its first, which builds the draft's kernels."""
        return self.draft_rounds > 1

    def state(self) -> dict:
        """What was timed, as JSON values (`restore`)."""
        return {"verify_seconds": self.verify_seconds, "draft": self.draft_seconds, "catch_up": self.catch_up_seconds}

    def restore(self, state: dict) -> None:
        """Go on from what another process timed (`state`); its first drafting round is still left out, since this
        process builds the draft's kernels again."""
        seconds = state.get("verify_seconds")
        if isinstance(seconds, list) and len(seconds) == len(self.verify_seconds):  # else a file edited by hand
            self.verify_seconds = list(seconds)
            self.draft_seconds, self.catch_up_seconds = state.get("draft"), state.get("catch_up")

    def costs(self) -> DraftCosts:
        timed = [k for k, seconds in enumerate(self.verify_seconds) if seconds is not None]
        fitted = dict(zip(timed, capped_by_longer([self.verify_seconds[k] for k in timed])))
        verify = []
        for k in range(len(self.verify_seconds)):
            if k not in fitted:
                nearest = min(timed, key=lambda j: (abs(j - k), j), default=None)
                scale = 1.0 if nearest is None else fitted[nearest] / self.prior.verify_seconds[nearest]
            verify.append(fitted[k] if k in fitted else scale * self.prior.verify_seconds[k])
        drafting = self.draft_seconds if self.draft_seconds is not None else self.catch_up_seconds
        if drafting is not None:
            return DraftCosts(tuple(verify), drafting)
        return DraftCosts(tuple(verify), self.prior.draft_seconds / self.prior.verify_seconds[0] * verify[0])


def capped_by_longer(values: list[float]) -> list[float]:
    """Each of `values` (costs of ever longer passes) capped by every later one: the non-decreasing sequence that
    trusts the cheaper of two timings that disagree."""
    capped, cheapest = [], math.inf
    for value in reversed(values):
        cheapest = min(cheapest, value)
        capped.append(cheapest)
    return capped[::-1]


def _prior_steps(num_drafts: int) -> float:
    return 1.0 + PRIOR_VERIFY_STEPS_PER_DRAFT * num_drafts


def _average(previous: float | None, seconds: float) -> float:
    if previous is None:
        return seconds
    return (1 - NEW_TIMING_WEIGHT) * previous + NEW_TIMING_WEIGHT * min(seconds, MAX_TIMING_JUMP * previous)


class FixedCosts(CostModel):
    """A cost model that keeps the costs it was given (`DraftingOptions.draft_costs`): timings change nothing."""

    def __init__(self, costs: DraftCosts):
        self._costs = costs

    def observe_verify(self, num_drafts: int, seconds: float) -> None:
        pass

    def observe_draft(self, seconds: float, catch_up: bool = False) -> None:
        pass

    knows_plain_step = drafting_timed = timed_drafts = True
    draft_seconds = catch_up_seconds = None

    def costs(self) -> DraftCosts:
        return self._costs


class CostAwareDrafting:
    """The cost-aware draft length of a process's runs with one draft: before a round, whether to draft it, verify
    the tokens that followed a repeat of the context instead, or decode plainly (`plan`); after drafting, how many of
    the drafts to verify (`length`); after verifying, how far the tokens were accepted and what the pass took
    (`accepted`). A call goes on from the rounds of the calls before it.

    A round that drafts pays the drafting round even when it then verifies no draft. So it drafts only when a round with
    the recent confidences (an average that halves the weight of each older round) would commit more tokens per second
    than a plain decode step; skipping, it looks again after 1, 2, 4, ... up to `MAX_SKIPPED` rounds. A look (a
    drafting round reading the context skipped rounds held back, and a verify pass) that costs more than a plain step
    (a wide batch) waits instead, from the first round at that batch size on, as long as looking within
    `EXPLORATION_SHARE` of the time allows; where such a dear look keeps finding a loss, each one in a row waits longer
    (`MAX_LOSING_LOOKS`). Where the recent rounds' own confidences make drafting lose clearly (`CLEAR_LOSS`: a text
    the draft guesses badly), it waits that longest at once; each call's first round that may draft looks where a look
    is cheaper than a plain step, since a call brings new text (`start_call`).
    Where drafted rounds at a batch size (pooled with the sizes like it: `batch_bucket`) moved their calls on slower
    than plain steps (`call_progress`: a batch call waits for its furthest-behind row; `realized_gain`, which a new
    process takes from the last, less a share of the loss: `STORED_LOSS_RECOVERY`), it drafts only those looks.
    A draft's confidence (its distribution's top probability) is scaled by how often drafts were accepted where the
    run's earlier rounds predicted they would be (`calibration`). A looked-up round costs no drafting; how far
    its tokens are accepted is estimated per matched n-gram size and position from the run's earlier repeats, verified
    or checked against the tokens committed after them.
    Costs come from `cost_models(batch_size, context)` (`context_bucket`), which learn from the timings the runs report.
    Every decision depends on earlier rounds, the committed tokens and the distributions of the drafts up to the one
    decided, so sampling stays exact.
    """

    MAX_SKIPPED = 16
    EXPLORATION_SHARE = 0.02
    MAX_LOSING_LOOKS = 4  # the n-th dear look in a row that finds a loss waits n times as long, up to this many
    CLEAR_LOSS = 0.9  # a realized gain below this is a loss, not the swing of the timings behind it
    DRAFT_MARGIN = 2  # a round drafts this many times the tokens recent rounds would verify: room for a better round
    MIN_DRAFTED = 4  # a look at a text the draft guessed badly still drafts enough to see it turn predictable

    def __init__(
        self,
        costs: DraftCosts | Callable[[int, int], CostModel],
        prompt_lookup: int = 0,
        do_sample: bool = False,
        realized_gain: dict[int, float] | None = None,
    ):
        if isinstance(costs, DraftCosts):
            fixed = FixedCosts(costs)
            self.cost_models: Callable[[int, int], CostModel] = lambda batch_size, context: fixed
        else:
            self.cost_models = costs
        self.look_ahead = not do_sample  # greedy drafts may be verified for their successors' confidence too
        self.expected: torch.Tensor | None = None  # [S]: recent rounds' calibrated reach (`expected_rates`), per token
        self.pays, self.skipped, self.wait = True, 0, 1
        self.losing_looks = 0  # looks in a row since drafting last paid
        self.new_call = False  # set by `start_call`, until the call's first round that may draft
        self.held_back = True  # whether the draft has context no drafting round read: a call's prompt, skipped rounds'
        # Per `batch_bucket`: drafted rounds' call progress per second over plain steps', as it turned out (a running
        # average; a bucket without rounds of its own goes by the nearest one's), from earlier processes' rounds on.
        self.realized_gain: dict[int, float] = {} if realized_gain is None else realized_gain
        self.draft_seconds = None  # the last drafted round's, until it is verified
        # Drafts accepted, and the probability the draft predicted for them summed, over drafts verified with all
        # before them accepted (a chain's confidences) or over every node (a tree's path probabilities). Both start
        # at 2: a prior of a calibrated draft.
        self.hits, self.predicted = 2.0, 2.0
        self.predictions: torch.Tensor | None = None  # [B, S]: the last drafted round's, until it is verified
        self.tree = False  # whether those are a tree's path probabilities
        self.max_ngram_size = prompt_lookup
        self.context = SHORTEST_CONTEXT  # the `context_bucket` of the rows' committed tokens, set each round
        num_drafts = len(self._cost_model(1).costs().verify_seconds) - 1
        # Per matched n-gram size and position: looked-up tokens accepted, and verified with all before them accepted.
        # The counts start at one of two, a prior of one half.
        self.lookup_accepted = torch.ones(prompt_lookup, num_drafts, dtype=torch.float64)
        self.lookup_reached = torch.full((prompt_lookup, num_drafts), 2.0, dtype=torch.float64)
        self.looked_up: list[int] = []  # the n-gram size of each row of the last looked-up round, empty after drafting
        # Each row's (n-gram size, tokens) where the last round did not verify them alone: a tree's looked-up branch,
        # or the repeats a chain or a plain step passed over.
        self.branches: list[tuple[int, torch.Tensor]] = []

    def _cost_model(self, batch_size: int) -> CostModel:
        return self.cost_models(batch_size, self.context)

    @property
    def calibration(self) -> float:
        """Accepted drafts per unit of predicted confidence, over the run's verified drafts so far."""
        return self.hits / self.predicted

    def plan(self, sequences: list[torch.Tensor], limit: int, tree: bool = False) -> torch.Tensor | None:
        """Before a round, given each row's committed tokens: None to draft it; else the tokens `[B, k]` to verify
        instead, k <= `limit`: those that followed an earlier occurrence of each row's last tokens (`prompt_lookup`)
        where verifying them is expected to commit tokens faster than drafting or a plain step, or none (k = 0) for a
        plain step, which the first round at a batch size and context length is: it times the step that every other
        choice is weighed against. A `tree` round that drafts takes the looked-up tokens as one of its branches instead
        (`lookup_branch`)."""
        self.context = context_bucket(max(sequence.shape[0] for sequence in sequences))
        cost_model = self._cost_model(len(sequences))
        if not cost_model.knows_plain_step:
            return sequences[0].new_zeros(len(sequences), 0)
        costs = cost_model.costs()
        if self.expected is not None:  # at this batch size's costs, which the last round may have changed
            self.pays = self._drafting_pays(costs, len(sequences))
        elif not self._delivered(len(sequences)):  # before this process's first drafted round
            self.pays = False
        dear_look = self._look_steps(len(sequences)) > 1  # a look costs more than a plain step (a wide batch)
        if not self.pays and dear_look:
            # look as seldom as the exploration budget allows from the first round at this batch size on, not after
            # 1, 2, 4, ... rounds. A cheap look goes on looking soon.
            self.wait = max(self.wait, self._longest_wait(len(sequences)))
        if self.new_call and not dear_look:  # a cheap look: the call's text may pay
            self.skipped = max(self.skipped, self.wait)
        self.new_call = False
        drafts = self.pays or self.skipped >= self.wait
        if tree and drafts:
            return None  # the tree takes the looked-up tokens as a branch (`lookup_branch`)
        looked_up = self._look_up(sequences, limit, costs)
        if looked_up is None and drafts:
            return None
        self.skipped, self.held_back = self.skipped + 1, True
        return looked_up if looked_up is not None else sequences[0].new_zeros(len(sequences), 0)

    def _look_up(self, sequences: list[torch.Tensor], limit: int, costs: DraftCosts) -> torch.Tensor | None:
        """The looked-up tokens `[B, k]` to verify where they pay for every row, else None, searching no row past the
        first where they do not (a wide batch's rounds would pay for every row's search). Where a round verifies
        none, how far the searched rows' tokens would have been accepted is learned from the tokens it commits
        (`accepted`), so a process learns that a text's repeats miss without verifying them."""
        self.looked_up, self.branches = [], []
        if self.max_ngram_size == 0 or limit == 0:
            return None
        found, lengths = [], []
        for sequence in sequences:
            size, tokens = self._repeat(sequence, limit)
            found.append((size, tokens))
            lengths.append(self._lookup_length(size, tokens.shape[0], costs) if size else 0)
            if lengths[-1] == 0:
                self.branches = found
                return None
        self.looked_up = [size for size, _ in found]
        return torch.stack([tokens[: min(lengths)] for _, tokens in found])

    def worth_drafting(self, batch_size: int) -> int | None:
        """How many tokens (a chain's slots, a tree's drafted nodes) a round of `batch_size` rows drafts: `DRAFT_MARGIN`
        times as many as the recent rounds' reach would verify at this batch size's costs, at least `MIN_DRAFTED`;
        None (all) before this process drafted. The LM head's rows and the head's steps cost per drafted token, and
        where drafting barely pays (a wide batch, a text the draft guesses badly) a round verifies few of them."""
        if self.expected is None:
            return None
        verified = _best_length(self.expected[None], self._cost_model(batch_size).costs())
        return max(self.MIN_DRAFTED, self.DRAFT_MARGIN * verified)

    def lookup_branch(self, sequences: list[torch.Tensor], limit: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For a tree round: each row's looked-up tokens `[L]` (`prompt_lookup`; L <= `limit`, 0 where none) and
        the probability `[L]` of accepting each with those before it, from the run's earlier looked-up tokens. How
        far the branch would have been accepted is learned from the committed tokens (`accepted`)."""
        self.branches = [self._repeat(sequence, limit) for sequence in sequences]
        return [(tokens, self._lookup_reach(size, tokens.shape[0])) for size, tokens in self.branches]

    def _repeat(self, sequence: torch.Tensor, limit: int) -> tuple[int, torch.Tensor]:
        return prompt_lookup(sequence, self.max_ngram_size, limit)[::-1]

    def drafted(self, seconds: float, batch_size: int) -> None:
        """A drafting round of `batch_size` rows took `seconds`. Reading held-back context (a look after skipped
        rounds, a call's prompt) is what looking costs (`_look_steps`); the round's realized gain is charged what
        drafting back to back costs, where that was timed: else one catch-up after a wide batch's skipped rounds would
        say drafting does not pay at the batch size its rows leave for."""
        cost_model = self._cost_model(batch_size)
        catch_up, self.held_back = self.held_back, False
        cost_model.observe_draft(seconds, catch_up)
        if catch_up and cost_model.draft_seconds is not None:
            seconds = cost_model.draft_seconds
        self.draft_seconds = seconds if cost_model.drafting_timed else None  # not while its kernels are built

    def length(self, confidence: torch.Tensor, limit: int) -> int:
        """After drafting: how many drafts of `confidence` `[B, S]` to verify, at most `limit` (`_fewest`)."""
        fewest = self._fewest(confidence.shape[0])
        calibrated = self._predicted(confidence, tree=False)
        costs = self._remember(calibrated.cumprod(dim=1))
        return min(limit, max(fewest, choose_draft_length(calibrated, costs, self.look_ahead)))

    def tree_size(self, path_probs: torch.Tensor) -> int:
        """After growing a tree: how many of its nodes to verify, given each row's nodes in the order they were
        added (so every prefix is a tree) and `path_probs` `[B, N]`, the probability the draft gives the path to
        each. The prefix `choose_draft_length` would pick looking ahead (`_fewest`)."""
        fewest = self._fewest(path_probs.shape[0])
        reach = self._predicted(path_probs, tree=True)
        return max(fewest, _best_length(reach, self._remember(reach)))

    def _fewest(self, batch_size: int) -> int:
        """1 in a look (drafting did not pay) before this process timed a pass over drafts at `batch_size`, else 0:
        what it knows of such passes (an earlier process's timings, the prior) may be what keeps drafting off, and
        only timing one could show otherwise."""
        return int(not self.pays and not self._cost_model(batch_size).timed_drafts)

    def _predicted(self, probs: torch.Tensor, tree: bool) -> torch.Tensor:
        """The round's predicted probabilities, kept until verified, and calibrated."""
        self.predictions, self.tree = probs.double().nan_to_num(0.0).cpu(), tree  # NaN: a slot with no finite logit
        return (self.predictions * self.calibration).clamp(max=1.0)

    def _remember(self, reach: torch.Tensor) -> DraftCosts:
        """Fold a drafted round's `reach` `[B, S]` into the recent rounds' and decide whether drafting pays; returns
        the costs at its batch size."""
        costs = self._cost_model(reach.shape[0]).costs()
        recent = reach.mean(0)
        if self.expected is None:
            self.expected = recent
        else:  # rounds draft as many tokens as seemed worth it: one not drafted counts as 0
            width = max(recent.shape[0], self.expected.shape[0])
            self.expected = (
                F.pad(self.expected, (0, width - self.expected.shape[0])) + F.pad(recent, (0, width - recent.shape[0]))
            ) / 2
        batch_size = reach.shape[0]
        self.pays, self.skipped = self._drafting_pays(costs, batch_size), 0
        self.losing_looks = 0 if self.pays else self.losing_looks + 1
        if self.pays:
            self.wait = 1
        elif self._predicted_gain(costs) < self.CLEAR_LOSS:  # this text's drafts lose clearly, whatever the timings
            self.wait = self._longest_wait(batch_size)
        else:
            self.wait = min(2 * self.wait, self._longest_wait(batch_size))
        return costs

    def _longest_wait(self, batch_size: int) -> int:
        """The most rounds skipped before looking again: `MAX_SKIPPED`, or more where looking would take over
        `EXPLORATION_SHARE` of the time (`_look_steps`); where a look costs more than a plain step, the n-th look in
        a row that found drafting losing waits n times that (up to `MAX_LOSING_LOOKS`): a wide batch that keeps
        losing is not worth the budget, while a cheap look keeps looking (the loss may be the text's)."""
        look_steps = self._look_steps(batch_size)
        waits = min(max(self.losing_looks, 1), self.MAX_LOSING_LOOKS) if look_steps > 1 else 1
        return max(self.MAX_SKIPPED, waits * math.ceil(look_steps / self.EXPLORATION_SHARE))

    def _look_steps(self, batch_size: int) -> float:
        """What a look that verifies drafts costs beyond a plain step, in plain steps: its drafting round (as the
        rounds catching up on held-back context took at `batch_size`, else as drafting rounds took)
        and at least a pass over one draft (in a wide batch the pass's extra rows cost more than the drafting)."""
        cost_model = self._cost_model(batch_size)
        costs = cost_model.costs()
        drafting = costs.draft_seconds if cost_model.catch_up_seconds is None else cost_model.catch_up_seconds
        verify = costs.verify_seconds
        return (drafting + (verify[1] - verify[0] if len(verify) > 1 else 0.0)) / verify[0]

    def _drafting_pays(self, costs: DraftCosts, batch_size: int) -> bool:
        """Whether a round with the recent rounds' reach commits tokens faster than a plain step, and drafted rounds
        at this batch size did, as they turned out (where the draft's confidence misleads, e.g. a wide batch)."""
        return self._predicted_gain(costs) > 1 and self._delivered(batch_size)

    def _predicted_gain(self, costs: DraftCosts) -> float:
        """The tokens per second a round with the recent rounds' reach is expected to commit, over a plain step's."""
        return max(expected_rates(self.expected[None], costs)) * costs.verify_seconds[0]

    def _delivered(self, batch_size: int) -> bool:
        """Whether drafted rounds at batch sizes like `batch_size` (`batch_bucket`, else the nearest) committed
        tokens at least as fast as plain steps, as they turned out; True before any was timed."""
        return self._gain_near(batch_size) >= 1.0

    def _gain_near(self, batch_size: int) -> float:
        if not self.realized_gain:
            return 1.0
        bucket = batch_bucket(batch_size)
        nearest = min(self.realized_gain, key=lambda size: (abs(size - bucket), -size))
        return self.realized_gain[nearest]

    def accepted(
        self,
        num_verified: int,
        num_accepted: list[int],
        seconds: float | None = None,
        committed: torch.Tensor | None = None,
        remaining: list[int] | None = None,
    ) -> None:
        """After verifying: how many of the `num_verified` tokens each row accepted, and, if timed, the seconds the
        verify pass (with acceptance) took. `committed` `[B, >= k + 1]`, each row's accepted tokens then the target's,
        says how far the looked-up tokens the round did not verify alone would have been accepted. `remaining`, each
        row's tokens left to its length budget before the round, says what the round did for the call
        (`call_progress`)."""
        if seconds is not None:
            batch_size = len(num_accepted)
            cost_model = self._cost_model(batch_size)
            cost_model.observe_verify(num_verified, seconds)
            # Only rounds that verified drafts say whether drafts deliver what they promised: a round whose own
            # length chose none (a look while drafting does not pay) would only confirm that it does not.
            if self.draft_seconds is not None and cost_model.knows_plain_step and num_verified > 0:
                steps = call_progress(num_accepted, remaining)
                gain = steps / (self.draft_seconds + seconds) * cost_model.costs().verify_seconds[0]
                bucket = batch_bucket(batch_size)
                self.realized_gain[bucket] = _average(self.realized_gain.get(bucket), gain)
        positions = torch.arange(num_verified)
        accepted = torch.tensor(num_accepted)[:, None]
        reached, hit = positions <= accepted, positions < accepted  # [B, k]
        for size, row_reached, row_hit in zip(self.looked_up, reached, hit):
            self.lookup_reached[size - 1, :num_verified] += row_reached.double()
            self.lookup_accepted[size - 1, :num_verified] += row_hit.double()
        if self.predictions is not None and not self.looked_up:
            predictions = self.predictions[:, :num_verified]
            self.predicted += float(predictions.sum() if self.tree else (predictions * reached).sum())
            self.hits += float(hit.sum())
        if committed is not None:
            for (size, tokens), row_committed, count in zip(self.branches, committed.cpu(), num_accepted):
                if size == 0:
                    continue
                checked = min(tokens.shape[0], count + 1)  # the committed tokens say what the target chose there
                matched = int((tokens[:checked].cpu() == row_committed[:checked]).long().cumprod(0).sum())
                positions = torch.arange(checked)
                self.lookup_reached[size - 1, :checked] += (positions <= matched).double()
                self.lookup_accepted[size - 1, :checked] += (positions < matched).double()
        self.forget_round()

    def start_call(self) -> None:
        """A new call: its text may be one the draft guesses better than the last call's, so its first round that may
        draft looks, where a look costs less than a plain step (a dear look keeps its wait)."""
        self.new_call = self.held_back = True
        self.forget_round()

    def forget_round(self) -> None:
        """Drop what the last round left to verify: its predictions and looked-up tokens (a call that stopped
        mid-round leaves them)."""
        self.looked_up, self.branches, self.predictions, self.draft_seconds = [], [], None, None

    def _lookup_length(self, ngram_size: int, num_tokens: int, costs: DraftCosts) -> int:
        """How many of `num_tokens` looked-up tokens to verify: 0 where a drafting round (if it pays) or a plain step
        is expected to commit tokens faster."""
        reach = self._lookup_reach(ngram_size, num_tokens)
        looked_up = expected_rates(reach[None], DraftCosts(costs.verify_seconds, 0.0))  # no drafting
        best_other = 1 / costs.verify_seconds[0]
        if self.pays and self.expected is not None:
            best_other = max(best_other, *expected_rates(self.expected[None], costs))
        best = _fastest(looked_up)
        return best if looked_up[best] > best_other else 0

    def _lookup_reach(self, ngram_size: int, num_tokens: int) -> torch.Tensor:
        """`[num_tokens]`: the probability of accepting each looked-up token after an n-gram of `ngram_size`, with
        those before it."""
        if ngram_size == 0:
            return torch.zeros(num_tokens, dtype=torch.float64)
        accepted = self.lookup_accepted[ngram_size - 1, :num_tokens]
        return (accepted / self.lookup_reached[ngram_size - 1, :num_tokens]).cumprod(0)


class _Learned:
    """What the runs of one target and draft under one set of round options learned in this process: the cost
    models per sampling, batch size and context length, what drafted rounds delivered per sampling and batch size,
    and the cost-aware draft lengths per prompt-lookup size, sampling and tree (their recent acceptance, calibration
    and skipping), so each call goes on from the last instead of learning again. The cost models and what drafted
    rounds delivered start from those stored under `disk_key` (`draft_costs_path`) and are stored there again
    (`save`): they carry over to the machine's next process. How often drafts are accepted depends on the
    prompts, so each process learns that anew."""

    def __init__(self, num_drafts: int, disk_key: str):
        self.num_drafts = num_drafts
        self.disk_key, self.path = disk_key, draft_costs_path()
        self.stored = read_cache(self.path).get(disk_key, {})  # "greedy 1 256": a cost state; "greedy gains": gains
        self.cost_models: dict[tuple[bool, int, int], CostModel] = {}
        self.realized_gain: dict[bool, dict[int, float]] = {False: {}, True: {}}  # `CostAwareDrafting.realized_gain`
        for do_sample in (False, True):
            name = _stored_name(do_sample, "gains")
            gains, own = self.stored.get(name), _gains_written.get((disk_key, name), {})
            pooled = defaultdict(list)  # a file of gains per batch size (not per bucket) pools them here
            for batch_size, gain in gains.items() if isinstance(gains, dict) else ():
                if batch_size.isdigit() and isinstance(gain, (int, float)):  # else a file edited by hand
                    recovery = 0.0 if own.get(batch_size) == gain else STORED_LOSS_RECOVERY  # another process's
                    loss = max(0.0, 1.0 - gain)
                    pooled[batch_bucket(int(batch_size))].append(float(gain) + recovery * loss)
            self.realized_gain[do_sample] = {bucket: sum(values) / len(values) for bucket, values in pooled.items()}
        self.drafting: dict[tuple[int, bool, bool], CostAwareDrafting] = {}
        self.saved_at = time.monotonic()  # of this process's last write, or of reading what it would write again

    def cost_models_of(self, do_sample: bool) -> Callable[[int, int], CostModel]:
        """The cost models per batch size and context length (`context_bucket`) of greedy or of sampled rounds,
        which differ: a sampled verify pass also warps and samples from every row's logits over the whole
        vocabulary, once per verified token."""

        def cost_model(batch_size: int, context: int = SHORTEST_CONTEXT) -> CostModel:
            key = (do_sample, batch_size, context)
            if key not in self.cost_models:
                model = CostModel(self.num_drafts, self._nearest_costs(*key))
                if (name := _stored_name(*key)) in self.stored:
                    model.restore(self.stored[name])
                self.cost_models[key] = model
            return self.cost_models[key]

        return cost_model

    def _nearest_costs(self, do_sample: bool, batch_size: int, context: int) -> DraftCosts | None:
        """The costs learned at the nearest batch size (the larger on a tie), then context length, that timed a
        plain step: a batch size or context new to the process (rows that finished leave a batch; a context grows)
        starts from their shape, not from a batch-1-like prior, since verify passes over wider batches cost more
        decode steps per draft."""
        known = [key for key, model in self.cost_models.items() if key[0] == do_sample and model.knows_plain_step]
        if not known:
            return None
        nearest = min(
            known,
            key=lambda key: (abs(key[1] - batch_size), -key[1], abs(math.log2(key[2] / context)), -key[2]),
        )
        return self.cost_models[nearest].costs()

    def save(self, throttled: bool = False) -> None:
        """Store the timed cost models and what drafted rounds delivered under `disk_key` in the file they came
        from, beside what other processes stored; `throttled`: not within `SAVE_INTERVAL_SECONDS` of the last write
        (or the read)."""
        if throttled and time.monotonic() - self.saved_at < SAVE_INTERVAL_SECONDS:
            return
        timed = {_stored_name(*key): model.state() for key, model in self.cost_models.items() if model.knows_plain_step}
        if timed:
            delivered = {
                _stored_name(do_sample, "gains"): {str(size): gain for size, gain in gains.items()}
                for do_sample, gains in self.realized_gain.items()
            }
            _gains_written.update({(self.disk_key, name): gains for name, gains in delivered.items()})
            self.stored |= timed | delivered
            write_cache(self.path, read_cache(self.path) | {self.disk_key: self.stored})
            self.saved_at = time.monotonic()


def call_progress(num_accepted: list[int], remaining: list[int] | None = None) -> float:
    """How many plain decode steps' worth a round moved its call on (a plain step: 1). A batch call lasts until its
    furthest-behind row reaches its budget, so that is how much closer its furthest-behind rows got (rows with
    `remaining` tokens left before the round, each committing its accepted tokens and the target's); the tokens rows
    ahead accept only let them leave earlier. Without `remaining`, the rows' mean tokens (every row alike)."""
    tokens = [1 + count for count in num_accepted]
    if remaining is None:
        return sum(tokens) / len(tokens)
    return max(remaining) - max(left - min(count, left) for left, count in zip(remaining, tokens))


SHORTEST_CONTEXT = 256  # contexts up to this many tokens share a cost model; longer ones one per doubling


def batch_bucket(batch_size: int) -> int:
    """The batch sizes whose drafted rounds' realized gains are pooled: the power of two at or above `batch_size`.
    Rows leave a batch one by one, so a batch size between two others runs few rounds, and one round (a lucky one,
    or one that paid for a kernel) would decide alone whether drafting pays there."""
    return 1 << (max(batch_size, 1) - 1).bit_length()


def context_bucket(num_tokens: int) -> int:
    """The context length whose cost model a round with rows of up to `num_tokens` tokens uses: the power of two at
    or above it, at least `SHORTEST_CONTEXT`. A pass costs more the longer the context it attends to and the cache
    it extends, so a plain step timed beside short prompts says little of one beside long prompts."""
    return max(SHORTEST_CONTEXT, 1 << (max(num_tokens, 1) - 1).bit_length())


def _stored_name(do_sample: bool, *shape) -> str:
    return " ".join(["sampled" if do_sample else "greedy", *map(str, shape)])


def draft_costs_path() -> str:
    """Where processes keep the round costs they learned, for the next process on this machine with the same models
    and round options: `$DOMINO_DRAFT_COSTS`, else `$XDG_CACHE_HOME/domino_spec/draft_costs.json` (`~/.cache` by
    default). Delete it to learn from the prior again."""
    return cache_path("DOMINO_DRAFT_COSTS", "draft_costs.json")


def _disk_key(target, draft, round_options: DraftingOptions) -> str:
    """What a round's costs depend on besides the machine: the models' shapes, dtype and device, whether
    `optimize_for_cpu` prepared them (their multi-token passes cost otherwise), and the round options."""

    def described(model) -> str:
        config = model.config.get_text_config()
        layers = getattr(config, "num_hidden_layers", None)
        prepared = any("forward" in module.__dict__ for module in model.modules() if type(module) is torch.nn.Linear)
        return (
            f"{type(model).__name__} {config.hidden_size}x{layers} vocab {config.vocab_size} "
            f"{str(model.dtype).removeprefix('torch.')} {model.device.type}{' cpu-optimized' if prepared else ''}"
        )

    return f"{machine_key()} | {described(target)} | {described(draft)} | {round_options}"


# What this process stored of what drafted rounds delivered, per disk key and sampling: read back (after
# `forget_draft_costs`), its losses are this process's own and take no `STORED_LOSS_RECOVERY` again.
_gains_written: dict[tuple[str, str], dict[str, float]] = {}
_learned: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()
_all_learned: "weakref.WeakSet[_Learned]" = weakref.WeakSet()  # what to store when the process ends


@atexit.register
def save_learned_costs() -> None:
    """Store what this process's runs learned (`learned_costs`, what drafted rounds delivered) for the machine's next
    process now, as the process's end does; a call's start stores it at most every `SAVE_INTERVAL_SECONDS`."""
    for learned in list(_all_learned):
        learned.save()


def _learned_with(target, draft, options: DraftingOptions) -> _Learned:
    round_options = replace(options, draft_length="auto", draft_costs=None, prompt_lookup=0)  # what a round runs
    per_draft = _learned.setdefault(target, weakref.WeakKeyDictionary()).setdefault(draft, {})
    key = (round_options, str(target.device), target.dtype)
    if key not in per_draft:
        per_draft[key] = _Learned(
            max(draft.config.num_draft_tokens, options.tree_budget(target.device)),
            _disk_key(target, draft, round_options),
        )
        _all_learned.add(per_draft[key])
    return per_draft[key]


def learned_costs(
    target, draft, options: DraftingOptions | None = None, do_sample: bool = False
) -> Callable[..., CostModel]:
    """The cost models of greedy (or sampled) rounds with `target` and `draft` under `options`, per batch size and
    context length (`cost_model(batch_size, context=SHORTEST_CONTEXT)`, `context_bucket`), learned by every run in this
    process: a later call starts from what earlier ones timed. Options that only choose what to verify (the draft
    length, its costs, prompt lookup) share them."""
    return _learned_with(target, draft, options or draft.drafting_options).cost_models_of(do_sample)


def forget_draft_costs(model: torch.nn.Module) -> None:
    """Drop the costs learned with `model`, a target or a draft (after it changed: `optimize_for_cpu`, compiled
    drafting, another device)."""
    _learned.pop(model, None)
    for drafts in _learned.values():
        drafts.pop(model, None)


def cost_aware_drafting(
    target, draft, options: DraftingOptions, do_sample: bool = False, tree: bool = False
) -> CostAwareDrafting | None:
    """The cost-aware draft length of a run (sampling or not, verifying chains or `tree`s): with the given costs a
    new one, else the one this process's earlier runs of the same kind with `target` and `draft` left (their cost
    models are shared: `learned_costs`); None where `options` verify every draft."""
    if not options.cost_aware(target.device):
        return None
    if options.draft_costs is not None:
        return CostAwareDrafting(options.draft_costs, options.prompt_lookup, do_sample)
    learned = _learned_with(target, draft, options)
    learned.save(throttled=True)  # what the calls before this one timed, for the next process
    key = (options.prompt_lookup, do_sample, tree)
    if key not in learned.drafting:
        learned.drafting[key] = CostAwareDrafting(
            learned.cost_models_of(do_sample), options.prompt_lookup, do_sample, learned.realized_gain[do_sample]
        )
    drafting = learned.drafting[key]
    drafting.start_call()
    return drafting
