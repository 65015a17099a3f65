"""The cost-aware draft length (`cost_aware.choose_draft_length`) and the drafting options."""

import gc
import json

import pytest
import torch

from domino_spec import DraftCosts, DraftingOptions, cost_aware
from domino_spec.cache_domino import DominoContextCache
from domino_spec.cost_aware import (
    CostAwareDrafting,
    CostModel,
    FixedCosts,
    call_progress,
    capped_by_longer,
    choose_draft_length,
    context_bucket,
    cost_aware_drafting,
    forget_draft_costs,
    learned_costs,
    prompt_lookup,
    save_learned_costs,
)
from domino_spec.drafting import DraftSampling
from domino_spec.generation import left_pad, optimize_for_cpu, speculative_generate

from conftest import tiny_draft, tiny_target
from speculative_helpers import draft_from_scratch

# A CPU-like round: verifying costs more with every draft, a drafting round a fifth of a decode step.
STEEP = DraftCosts(verify_seconds=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6), draft_seconds=0.2)


def test_drafts_are_added_while_they_raise_the_expected_tokens_per_second():
    # 0.9 each: expected tokens 1, 1.9, 2.71, 3.44, 4.10 over 1.2, 1.3, 1.4, 1.5, 1.6 seconds: rising all along.
    assert choose_draft_length(torch.full((1, 4), 0.9), STEEP) == 4
    # 0.5 then nothing: 1.5 / 1.3 beats 1 / 1.2, but 1.5 + 0.05 over 1.4 does not beat 1.5 / 1.3.
    assert choose_draft_length(torch.tensor([[0.5, 0.1, 0.9, 0.9]]), STEEP) == 1
    assert choose_draft_length(torch.tensor([[0.05, 0.9, 0.9, 0.9]]), STEEP) == 0  # 1.05 / 1.3 < 1 / 1.2
    flat = DraftCosts(verify_seconds=(1.0,) * 7, draft_seconds=0.2)
    assert choose_draft_length(torch.tensor([[0.01, 0.01]]), flat) == 2  # a free draft always pays


def test_a_round_that_cannot_beat_plain_steps_verifies_only_what_beats_them_at_the_margin():
    """Once drafted, the drafting round is paid: a length is worth its extra verify time only where it commits more
    tokens than plain steps would in that time, even when the longer round has the higher rate overall."""
    dear = DraftCosts(verify_seconds=(1.0, 2.0, 3.0), draft_seconds=0.7)  # a wide batch: each draft a whole step
    sure = torch.tensor([[0.9, 0.9]])  # rates 1 / 1.7, 1.9 / 2.7, 2.71 / 3.7: rising, and all below a plain step's
    assert choose_draft_length(sure, dear) == 0 and choose_draft_length(sure, dear, look_ahead=True) == 0
    cheap = DraftCosts(verify_seconds=(1.0, 1.2, 1.4), draft_seconds=0.7)  # 0.9 more tokens for 0.2 s: pays
    assert choose_draft_length(sure, cheap) == 2 and choose_draft_length(sure, cheap, look_ahead=True) == 2


def test_every_row_of_a_batch_counts():
    # Rows reaching draft 1: 0.05 + 0.9 = 0.95 over 2 rows: (2 + 0.95) / 1.3 > 2 / 1.2.
    assert choose_draft_length(torch.tensor([[0.05, 0.0], [0.9, 0.0]]), STEEP) == 1
    assert choose_draft_length(torch.tensor([[0.05, 0.0], [0.05, 0.0]]), STEEP) == 0


def test_a_draft_is_verified_whatever_the_confidences_after_it():
    """A stopping rule: whether draft i is verified depends on drafts 1..i only, which keeps sampling exact."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        confidence = torch.rand(3, 6, generator=generator)
        length = choose_draft_length(confidence, STEEP)
        changed = confidence.clone()
        changed[:, length + 1 :] = torch.rand(3, max(6 - length - 1, 0), generator=generator)
        assert choose_draft_length(changed, STEEP) == length


def test_looking_ahead_finds_a_long_block_past_a_jump_in_the_verify_cost():
    # This CPU's curve: one draft costs a little, two cost much more, more cost no more than two.
    jump = DraftCosts(verify_seconds=(1.0, 1.18, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5), draft_seconds=0.0)
    confidence = torch.full((1, 8), 0.6)  # 1.6 / 1.18 beats 1.96 / 1.5, but 2.48 / 1.5 beats both
    assert choose_draft_length(confidence, jump) == 1  # the stopping rule sampling needs stops at the jump
    assert choose_draft_length(confidence, jump, look_ahead=True) == 8
    assert choose_draft_length(torch.full((1, 8), 0.05), jump, look_ahead=True) == 0  # nothing pays


def test_a_noisy_dip_in_the_verify_curve_does_not_stop_drafting_early():
    dipped = DraftCosts(verify_seconds=(1.0, 1.3, 1.1, 1.3, 1.4), draft_seconds=0.2)
    assert choose_draft_length(torch.full((1, 4), 0.99), dipped) == 4


def test_draft_costs_and_options_refuse_bad_values():
    with pytest.raises(ValueError, match="DraftCosts needs verify_seconds"):
        DraftCosts(verify_seconds=(1.0, 0.0), draft_seconds=0.1)
    with pytest.raises(ValueError, match="draft_length='some' is invalid"):
        DraftingOptions(draft_length="some")
    for lookup in (-1, True, 2.0):
        with pytest.raises(ValueError, match=f"prompt_lookup={lookup!r} is invalid"):
            DraftingOptions(prompt_lookup=lookup)


def test_the_cost_model_learns_each_timed_count_and_scales_the_prior_to_the_others():
    model = CostModel(num_drafts=4)
    assert not model.knows_plain_step
    prior = model.costs()  # before any timing: the prior's ratios alone
    assert prior.verify_seconds == pytest.approx((1.0, 1.1, 1.2, 1.3, 1.4)) and prior.draft_seconds == 0.25
    model.observe_verify(2, 0.024)  # a pass over 2 drafts took 24 ms: the counts never timed follow it
    assert model.costs().verify_seconds == pytest.approx((0.02, 0.022, 0.024, 0.026, 0.028))
    model.observe_verify(0, 0.010)  # the plain step, timed: counts 0 and 1 now scale to it, 3 and 4 to count 2
    costs = model.costs()
    assert model.knows_plain_step and costs.verify_seconds == pytest.approx((0.010, 0.011, 0.024, 0.026, 0.028))
    assert costs.draft_seconds == pytest.approx(0.0025)  # a quarter of the plain step until a round is timed
    model.observe_draft(0.300)  # the first drafting round builds the draft's kernels: not the machine's speed
    assert model.costs().draft_seconds == pytest.approx(0.0025)
    model.observe_draft(0.004)
    model.observe_draft(0.002)  # a running average: recent rounds weigh most
    assert model.costs().draft_seconds == pytest.approx(0.7 * 0.004 + 0.3 * 0.002)


def test_a_batch_size_new_to_the_process_starts_from_the_shape_of_the_nearest_timed_one():
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    cost_models = learned_costs(target, draft)
    wide = cost_models(8)
    num_drafts = len(wide.verify_seconds) - 1
    steps = [1.0 + 0.5 * k for k in range(num_drafts + 1)]  # a wide batch's verify passes: half a step a draft
    for count, step in enumerate(steps):
        wide.observe_verify(count, 0.1 * step)
    wide.observe_draft(1.0)  # builds kernels: not counted
    wide.observe_draft(0.04)
    narrower = cost_models(6)  # two rows finished
    narrower.observe_verify(0, 0.08)
    costs = narrower.costs()
    assert costs.verify_seconds == pytest.approx([0.08 * step for step in steps])
    assert costs.draft_seconds == pytest.approx(0.4 * 0.08)
    assert cost_models(7).prior.verify_seconds == pytest.approx(wide.costs().verify_seconds)  # a tie: the wider
    assert learned_costs(target, draft, do_sample=True)(6).prior.draft_seconds == 0.25  # sampled: the default prior


def test_rounds_beside_a_longer_context_time_their_own_plain_step_first():
    """A pass costs more the longer the context: a plain step timed beside short prompts is not one beside long ones."""
    assert [context_bucket(n) for n in (1, 256, 257, 1400)] == [256, 256, 512, 2048]
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    cost_models = learned_costs(target, draft)
    drafting = CostAwareDrafting(cost_models)
    short, long = [torch.arange(100)] * 4, [torch.arange(1400)] * 4
    assert drafting.plan(short, limit=4).shape == (4, 0)  # the first round at a batch size times a plain step
    drafting.accepted(0, [0] * 4, seconds=0.05)
    assert drafting.plan(short, limit=4) is None  # then drafts
    drafting.forget_round()
    assert drafting.plan(long, limit=4).shape == (4, 0)  # beside long prompts: a plain step of their own first
    drafting.accepted(0, [0] * 4, seconds=0.15)
    assert cost_models(4).verify_seconds[0] == 0.05 and cost_models(4, 2048).verify_seconds[0] == 0.15
    assert cost_models(4, 2048).prior.verify_seconds == pytest.approx(cost_models(4).costs().verify_seconds)


def test_a_count_that_looked_dear_is_corrected_by_the_longer_passes_timed_since():
    assert capped_by_longer([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.0, 2.0, 4.0]
    assert capped_by_longer([3.0, 2.0, 1.0]) == [1.0, 1.0, 1.0]
    model = CostModel(num_drafts=4)
    for _ in range(8):
        model.observe_verify(0, 0.050)
        for count in (2, 3, 4):
            model.observe_verify(count, 0.055)
    model.observe_verify(1, 0.500)  # one pass over 1 draft after a stall, never timed again
    costs = model.costs().verify_seconds
    assert costs[0] == pytest.approx(0.050) and costs[1:] == pytest.approx((0.055,) * 4)  # longer passes cost no more
    model.observe_verify(0, 1.0)  # a stall in a well-timed count moves it by at most a doubling
    assert model.verify_seconds[0] == pytest.approx(0.7 * 0.05 + 0.3 * 0.1)

    stale = CostModel(num_drafts=4)  # an earlier process timed the short passes during a slow spell
    stale.restore({"verify_seconds": [0.050, 0.120, 0.120, 0.130, 0.130], "draft": 0.010})
    for _ in range(5):  # this one verifies only long blocks, at their real cost
        stale.observe_verify(4, 0.060)
    costs = stale.costs().verify_seconds
    assert costs[1:] == pytest.approx([stale.verify_seconds[4]] * 4) and costs[1] < 0.075  # the short ones too


def test_a_long_pass_that_looked_dear_in_an_earlier_process_is_tried_again_once_shorter_passes_say_it_is_cheap():
    model = CostModel(num_drafts=16)  # an earlier process timed passes over 10+ nodes under load: 2.6 plain steps
    model.restore({"verify_seconds": [0.060] + [0.070] * 9 + [0.155] * 7, "draft": 0.015})
    confident = torch.full((1, 16), 0.97)  # a tree whose deeper nodes are likely
    assert choose_draft_length(confident, model.costs(), look_ahead=True) == 9
    for _ in range(40):  # this process times plain steps only: they say nothing of passes with drafts
        model.observe_verify(0, 0.060)
    assert model.verify_seconds[10:] == [0.155] * 7
    for _ in range(40):  # and passes over 9 nodes, cheap: the untimed longer passes drift toward the prior shape
        model.observe_verify(9, 0.066)
    predicted = [0.066 / 1.9 * (1.0 + 0.1 * count) for count in range(10, 17)]
    assert all(p < estimate < 0.155 for p, estimate in zip(predicted, model.verify_seconds[10:]))
    assert choose_draft_length(confident, model.costs(), look_ahead=True) == 16
    model.observe_verify(16, 0.150)  # tried: dear after all, and a count timed lately is its own timings only
    dear = model.verify_seconds[16]
    for _ in range(10):
        model.observe_verify(9, 0.066)
    assert model.verify_seconds[16] == dear


def test_a_call_goes_on_from_the_acceptance_the_calls_before_it_learned():
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    options = DraftingOptions(draft_length="cost")
    greedy = cost_aware_drafting(target, draft, options)
    greedy.hits = 7.0
    assert cost_aware_drafting(target, draft, options) is greedy and greedy.hits == 7.0
    assert cost_aware_drafting(target, draft, options, do_sample=True) is not greedy  # sampling accepts otherwise
    assert cost_aware_drafting(target, draft, DraftingOptions(draft_length="cost", prompt_lookup=0)) is not greedy
    assert greedy.cost_models(1) is learned_costs(target, draft, options)(1)
    sampled = cost_aware_drafting(target, draft, options, do_sample=True)
    assert sampled.cost_models(1) is learned_costs(target, draft, options, do_sample=True)(1)
    assert sampled.cost_models(1) is not greedy.cost_models(1)  # a sampled pass also warps every row's logits
    fixed = DraftingOptions(draft_length="cost", draft_costs=STEEP)
    assert cost_aware_drafting(target, draft, fixed) is not cost_aware_drafting(target, draft, fixed)
    # a batch size whose costs make the recent rounds' drafting too dear skips it from its first drafted round on
    greedy.expected = torch.full((6,), 0.5, dtype=torch.float64)
    greedy.cost_models(4).observe_verify(0, 0.01)
    for _ in range(2):  # the first timing is the draft's kernels being built
        greedy.cost_models(4).observe_draft(0.05)
    committed = [torch.tensor([1, 2, 3])] * 4
    assert greedy.plan(committed, limit=6).shape == (4, 0) and not greedy.pays


def test_context_held_back_by_rounds_that_do_not_draft_projects_as_if_read_at_once():
    target = tiny_target("qwen3", dtype=torch.float64)
    draft = tiny_draft(target).to(torch.float64)
    features = torch.randn(3, 7, draft.fc.in_features, dtype=torch.float64)
    positions = torch.arange(7).repeat(3, 1)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :2] = 0  # a left-padded row
    at_once, deferred = DominoContextCache(), DominoContextCache()
    draft.extend_context(at_once, features, positions, mask)
    deferred.defer(features[:, :2], positions[:, :2], mask[:, :2])
    deferred.defer(features[:, 2:3], positions[:, 2:3], None)
    assert deferred.get_seq_length() == 3 and not deferred.keys
    rows = torch.tensor([0, 2])
    at_once.select_rows(rows)
    deferred.select_rows(rows)
    draft.extend_context(deferred, features[rows, 3:], positions[rows, 3:], mask[rows, 3:])
    assert not deferred.pending and deferred.get_seq_length() == 7
    assert torch.equal(deferred.attention_mask, at_once.attention_mask)
    for got, expected in zip(deferred.keys + deferred.values, at_once.keys + at_once.values):
        torch.testing.assert_close(got, expected)
    deferred.defer(features[rows, :1], positions[rows, :1], None)
    with pytest.raises(ValueError, match="project the pending context first"):
        deferred.crop(-1)


def test_a_first_call_measures_nothing_up_front_and_a_later_one_starts_from_what_it_learned():
    """No hidden set-up: the first call's target passes are its prefill and its rounds, the first of them a plain
    step that times what every choice is weighed against; the process keeps what its rounds timed."""
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    draft.drafting_options = DraftingOptions(draft_length="cost")
    passes = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: passes.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    input_ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    output = speculative_generate(target, draft, input_ids, max_new_tokens=12, eos_token_id=[])
    hook.remove()
    assert len(passes) == 1 + output.num_rounds  # the prefill, then one pass per round
    assert passes[1] == 1  # the first round: a plain step
    cost_model = learned_costs(target, draft)(1)
    assert cost_model.knows_plain_step
    expected = target.generate(input_ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    again = speculative_generate(target, draft, input_ids, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(again.sequences, expected) and torch.equal(output.sequences, expected)
    assert again.acceptance_lengths[0][0] >= 1 and learned_costs(target, draft)(1) is cost_model  # one per process
    assert learned_costs(target, draft)(2) is not cost_model  # each batch size learns its own


def test_a_calls_start_writes_what_the_process_learned_at_most_once_an_interval_and_its_end_writes_it_all(
    tmp_path, monkeypatch
):
    """Replacing the file can cost a decode step or two (ext4 flushes a file renamed over another): a call's start
    writes only where the process's last write (or read) is older than `SAVE_INTERVAL_SECONDS`, and its end writes
    the rest."""
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    draft.drafting_options = DraftingOptions(draft_length="cost")
    input_ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "draft_costs.json"

    def stored_plain_step() -> float:
        return next(iter(json.loads(path.read_text()).values()))["greedy 1 256"]["verify_seconds"][0]

    for _ in range(2):
        speculative_generate(target, draft, input_ids, max_new_tokens=12, eos_token_id=[])
    assert not path.exists()  # within the interval from the process's read: no call's start writes
    save_learned_costs()  # as the process does when it ends
    assert stored_plain_step() == learned_costs(target, draft)(1).verify_seconds[0]
    speculative_generate(target, draft, input_ids, max_new_tokens=12, eos_token_id=[])
    learned = learned_costs(target, draft)(1).verify_seconds[0]
    assert stored_plain_step() != learned
    monkeypatch.setattr(cost_aware, "SAVE_INTERVAL_SECONDS", 0.0)
    speculative_generate(target, draft, input_ids, max_new_tokens=12, eos_token_id=[])
    assert stored_plain_step() == learned  # a start after the interval writes what the calls before it learned


def test_a_new_process_starts_from_the_costs_the_last_one_timed_with_the_same_models(tmp_path, monkeypatch):
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    draft.drafting_options = DraftingOptions(draft_length="cost")
    input_ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        speculative_generate(target, draft, input_ids, max_new_tokens=12, eos_token_id=[])
    save_learned_costs()  # as the process does when it ends
    timed = learned_costs(target, draft)(1)
    path = tmp_path / "draft_costs.json"
    stored = json.loads(path.read_text())
    assert len(stored) == 1 and sorted(next(iter(stored.values()))) == ["greedy 1 256", "greedy gains", "sampled gains"]

    forget_draft_costs(target)  # what a new process knows: the file
    restored = learned_costs(target, draft)(1)
    assert restored is not timed and restored.knows_plain_step and restored.draft_rounds == 0
    assert restored.verify_seconds[0] == pytest.approx(stored[next(iter(stored))]["greedy 1 256"]["verify_seconds"][0])
    assert not learned_costs(target, draft, do_sample=True)(1).knows_plain_step  # sampled rounds cost otherwise
    assert not learned_costs(target, draft)(2).knows_plain_step  # and so do other batch sizes

    # a drafting round far dearer than a plain step, so a look costs more than one however this machine's load
    # swings the plain steps the processes below time: a new call looks no sooner for it
    stored[next(iter(stored))]["greedy 1 256"]["draft"] = 20 * restored.verify_seconds[0]
    stored[next(iter(stored))]["greedy 1 256"]["catch_up"] = 20 * restored.verify_seconds[0]
    for gain, first_drafting_pass in ((1.5, 1), (0.95, None), (0.5, None)):
        stored[next(iter(stored))]["greedy gains"] = {"1": gain}  # what the last process's drafted rounds delivered
        path.write_text(json.dumps(stored))
        forget_draft_costs(target)
        # where they paid, the first round, after the prefill, drafts: no plain step to time first; where they lost,
        # even within the swing of timings, a look dearer than a plain step waits as long as the exploration budget
        # says (more than these 12 rounds)
        assert _drafting_passes(target, draft, input_ids)[:1] == ([first_drafting_pass] if first_drafting_pass else [])

    first_drafting_passes, stored_gains = [], []
    for _ in range(3):  # a process that reads a loss back and does not draft stores it with half of it recovered
        forget_draft_costs(target)
        gc.collect()  # the state of the processes before is gone with them
        cost_aware._gains_written.clear()
        first_drafting_passes.append(_drafting_passes(target, draft, input_ids)[:1])
        save_learned_costs()  # as the process does when it ends
        stored_gains.append(json.loads(path.read_text())[next(iter(stored))]["greedy gains"]["1"])
    assert stored_gains == [0.75, 0.875, 0.9375] and first_drafting_passes == [[], [], []]

    stored[next(iter(stored))]["greedy gains"] = {"1": 0.5}
    path.write_text(json.dumps(stored))
    forget_draft_costs(target)
    gc.collect()
    cost_aware._gains_written.clear()
    speculative_generate(target, draft, input_ids, max_new_tokens=1, eos_token_id=[])  # reads 0.5 back as 0.75
    save_learned_costs()
    forget_draft_costs(target)  # the same process reads its own loss back: it takes no share of it back again
    gc.collect()
    speculative_generate(target, draft, input_ids, max_new_tokens=1, eos_token_id=[])  # no round: nothing timed
    save_learned_costs()
    assert json.loads(path.read_text())[next(iter(stored))]["greedy gains"]["1"] == 0.75

    monkeypatch.setenv("DOMINO_DRAFT_COSTS", str(tmp_path / "elsewhere.json"))
    forget_draft_costs(draft)
    assert not learned_costs(target, draft)(1).knows_plain_step  # another file: the prior again
    monkeypatch.setenv("DOMINO_DRAFT_COSTS", str(path))
    forget_draft_costs(draft)
    with optimize_for_cpu(target, draft):  # other kernels: other costs
        assert not learned_costs(target, draft)(1).knows_plain_step


def _drafting_passes(target, draft, input_ids) -> list[int]:
    """The target passes (the prefill counts 1) before each drafting round, a chain's or a tree's, of a 12-token
    call."""
    target_passes, drafted_after = [], []
    hook = target.register_forward_pre_hook(lambda *args: target_passes.append(1))
    block_logits = draft.block_logits

    def spied_block_logits(*args, **kwargs):
        drafted_after.append(len(target_passes))
        return block_logits(*args, **kwargs)

    draft.block_logits = spied_block_logits
    try:
        speculative_generate(target, draft, input_ids, max_new_tokens=12, eos_token_id=[])
    finally:
        hook.remove()
        del draft.block_logits
    return drafted_after


def test_calibration_scales_confidences_by_how_often_drafts_were_accepted():
    drafting = CostAwareDrafting(STEEP)
    sure = torch.full((1, 4), 0.9)
    assert drafting.length(sure, limit=4) == 4
    for _ in range(30):  # drafts the draft was sure of, never accepted
        drafting.length(sure, limit=4)
        drafting.accepted(1, [0])
    assert drafting.calibration < 0.1
    assert choose_draft_length(sure * drafting.calibration, STEEP) == 0 and drafting.length(sure, limit=4) == 0


def test_a_round_drafts_twice_what_recent_rounds_would_verify():
    costs = DraftCosts(verify_seconds=tuple(1.0 + k / 10 for k in range(17)), draft_seconds=0.1)
    drafting = CostAwareDrafting(costs)
    assert drafting.worth_drafting(batch_size=1) is None  # nothing drafted yet: the whole block
    drafting.tree_size(torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]]))  # all six pay
    assert drafting.worth_drafting(batch_size=1) == 12
    for _ in range(8):  # rounds whose tokens the costs make worth verifying only the first of
        drafting.length(torch.tensor([[0.9, 0.05, 0.05, 0.05]]), limit=4)
        drafting.accepted(2, [1])
    assert drafting.worth_drafting(batch_size=1) == CostAwareDrafting.MIN_DRAFTED
    drafting.tree_size(torch.full((1, 6), 0.95))  # a round drafted few; the count recovers by doubling
    assert drafting.worth_drafting(batch_size=1) == 12


def test_draft_sampling_draws_from_the_logits_it_returns():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    sampling = DraftSampling(temperature=0.7, top_k=3, top_p=0.9)
    warped = sampling.warp(logits)
    probs = (logits / 0.7).softmax(-1)[0, :3]
    kept = int(torch.searchsorted((probs / probs.sum()).cumsum(0), torch.tensor(0.9))) + 1  # top-p of the top 3
    assert torch.isfinite(warped[0]).sum() == kept and torch.isneginf(warped[0, 3:]).all()
    generator = torch.Generator().manual_seed(0)
    draws = [sampling.draw(logits.expand(2000, -1), generator) for _ in range(5)]
    counts = torch.bincount(torch.cat([index for index, _ in draws]), minlength=5).double()
    frequencies = counts / counts.sum()
    assert torch.allclose(frequencies, draws[0][1][0].softmax(-1).double(), atol=0.02)
    with pytest.raises(ValueError, match="temperature=0"):
        DraftSampling(temperature=0)


def test_greedy_decoding_with_the_cost_aware_length_is_lossless_and_verifies_fewer_drafts():
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    with torch.no_grad():
        draft.head.embed_proj[2].weight.mul_(50.0)  # confident drafts: some rounds verify more than others
    drafts_per_round = {"cost": [], "full": []}
    for seed in range(6):
        input_ids = torch.randint(0, 100, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(input_ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
        for draft_length, per_round in drafts_per_round.items():
            draft.drafting_options = DraftingOptions(draft_length=draft_length, draft_costs=STEEP)
            output = speculative_generate(target, draft, input_ids, max_new_tokens=20, eos_token_id=[])
            assert torch.equal(output.sequences, expected)
            hf = target.generate(input_ids, max_new_tokens=20, do_sample=False, pad_token_id=0, assistant_model=draft)
            assert torch.equal(hf, expected)
            per_round.append(output.drafts_verified / output.num_rounds)
    assert sum(drafts_per_round["cost"]) < sum(drafts_per_round["full"])


def test_rounds_skip_drafting_while_recent_ones_do_not_pay_and_look_again_ever_later():
    drafting = CostAwareDrafting(STEEP)
    # drafts that come close to paying for their round (0.96 of a plain step's rate), and drafts the draft is sure of
    close, sure = torch.full((1, 4), 0.25), torch.full((1, 4), 0.9)
    committed = [torch.tensor([1, 2, 3])]
    decisions = []
    for _ in range(16):
        planned = drafting.plan(committed, limit=4)
        if planned is None:
            decisions.append("D")
            # the round is paid: one draft is worth verifying, drafting still does not pay
            assert drafting.length(close, limit=4) == 1 and not drafting.pays
        else:
            decisions.append(".")
            assert planned.shape == (1, 0)  # a plain step
    assert "".join(decisions) == "D..D....D" + "." * 7  # the first round drafts; then after 2, 4, 8 skipped rounds
    drafting.skipped = drafting.wait  # its next look: a sure round brings drafting back every round
    assert drafting.plan(committed, limit=4) is None and drafting.length(sure, limit=3) == 3
    assert all(drafting.plan(committed, limit=4) is None for _ in range(3))


def test_a_text_whose_drafts_lose_clearly_waits_longest_and_a_new_call_looks_at_once_where_looks_are_cheap():
    drafting = CostAwareDrafting(STEEP)  # a look costs 0.3 of a step: the longest wait is MAX_SKIPPED
    committed = [torch.tensor([1, 2, 3])]
    assert drafting.plan(committed, limit=4) is None
    drafting.length(torch.full((1, 4), 0.25), limit=4)  # close to paying for its round: the wait doubles
    assert not drafting.pays and drafting.wait == 2
    drafting.skipped = drafting.wait
    assert drafting.plan(committed, limit=4) is None
    drafting.length(torch.full((1, 4), 0.01), limit=4)  # far from it: the longest wait at once, not 4
    assert not drafting.pays and drafting.wait == CostAwareDrafting.MAX_SKIPPED
    assert all(drafting.plan(committed, limit=4) is not None for _ in range(5))
    drafting.start_call()
    assert drafting.plan(committed, limit=4) is None  # a new call's first round looks: its text may be better


def test_a_look_verifies_a_draft_until_the_process_timed_one_at_its_batch_size():
    """Restored costs that make every draft look dear (an earlier process timed them in a slow spell) would keep a
    look from verifying any, and so from ever timing what a pass over drafts costs now."""
    dear = CostModel(4)
    dear.restore({"verify_seconds": [1.0, 1.5, 1.6, 1.7, 1.8], "draft": 0.4})  # a look: 0.9 of a plain step
    drafting = CostAwareDrafting(lambda batch_size, context: dear, realized_gain={1: 0.95})
    committed, unsure = [torch.tensor([1, 2, 3])], torch.full((1, 4), 0.3)
    assert drafting.plan(committed, limit=4).shape == (1, 0)  # drafting did not quite pay: a plain step, then a look
    assert drafting.plan(committed, limit=4) is None and not dear.timed_drafts
    assert choose_draft_length(unsure, dear.costs(), look_ahead=True) == 0 and drafting.length(unsure, limit=4) == 1
    drafting.accepted(1, [1], seconds=1.1)
    assert dear.timed_drafts and dear.verify_seconds[1] == 1.1  # the process's own first timing replaces the file's
    hopeless = torch.full((1, 4), 0.01)
    assert drafting.length(hopeless, limit=4) == choose_draft_length(hopeless, dear.costs(), look_ahead=True) == 0


def test_a_wide_batch_whose_drafting_costs_most_of_a_step_looks_again_less_often():
    wide = DraftCosts(verify_seconds=(1.0, 2.0, 3.0, 4.0, 5.0), draft_seconds=0.6)
    drafting = CostAwareDrafting(wide)
    committed = [torch.tensor([1, 2, 3])] * 12
    drafted_rounds = []
    for round_index in range(1500):
        if drafting.plan(committed, limit=4) is None:
            drafted_rounds.append(round_index)
            assert drafting.length(torch.full((12, 4), 0.3), limit=4) == 0
    # a look costs 0.6 of a step drafting and 1.0 more verifying a draft: at most 2% of the time, 1 round in 80;
    # each look in a row that finds the loss again waits that once more, up to MAX_LOSING_LOOKS times
    gaps = [b - a for a, b in zip(drafted_rounds, drafted_rounds[1:])]
    assert gaps == [81, 161, 241, 321, 321, 321]
    assert drafting.wait == CostAwareDrafting.MAX_LOSING_LOOKS * 80
    cheap = CostAwareDrafting(STEEP)  # a look that pays ends the run of losing looks
    for confidence, pays, losing_looks in ((0.01, False, 1), (0.9, True, 0)):
        cheap.skipped = cheap.wait
        assert cheap.plan(committed, limit=4) is None
        cheap.length(torch.full((12, 4), confidence), limit=4)
        assert (cheap.pays, cheap.losing_looks) == (pays, losing_looks)


def test_looks_are_priced_by_what_catching_up_costs_and_drafted_rounds_by_what_drafting_back_to_back_costs():
    """A look reads the context the skipped rounds held back (a new call's whole prompt in a wide batch), so it costs
    more than rounds that draft back to back: its wait follows what catching up took, kept for the next process,
    while what a drafted round delivered is charged the drafting that goes on after it."""
    model = CostModel(4)
    for count, seconds in enumerate((1.0, 2.0, 3.0, 4.0, 5.0)):
        model.observe_verify(count, seconds)
    drafting = CostAwareDrafting(lambda batch_size, context: model)
    committed = [torch.tensor([1, 2, 3])] * 12

    def skip_to_look() -> None:
        while drafting.plan(committed, limit=4) is not None:
            pass

    assert drafting.plan(committed, limit=4) is None and drafting.pays  # drafting pays until a round says not
    drafting.drafted(5.0, batch_size=12)  # builds the draft's kernels: not counted
    drafting.length(torch.full((12, 4), 0.01), limit=4)
    for _ in range(2):
        skip_to_look()
        assert not drafting.pays  # a look
        drafting.drafted(0.6, batch_size=12)  # drafting and reading the held-back context: 0.6 of a step
        drafting.length(torch.full((12, 4), 0.01), limit=4)
        drafting.losing_looks = 0  # the look's price alone
        assert drafting._longest_wait(12) == 80  # (0.6 + 1.0 verifying a draft) / 2% of the time
    assert model.catch_up_seconds == pytest.approx(0.6) and model.costs().draft_seconds == pytest.approx(0.6)
    drafting.accepted(1, [1] * 12, seconds=2.0)
    assert drafting.realized_gain[16] == pytest.approx(2 / 2.6)  # no back-to-back round timed: the look's own time
    drafting.drafted(0.1, batch_size=12)  # the next round drafts too, back to back: cheaper
    assert model.costs().draft_seconds == pytest.approx(0.1) and drafting._longest_wait(12) == 80
    skip_to_look()
    drafting.drafted(0.6, batch_size=12)
    drafting.length(torch.full((12, 4), 0.01), limit=4)
    drafting.realized_gain.clear()
    drafting.accepted(1, [1] * 12, seconds=2.0)
    assert drafting.realized_gain[16] == pytest.approx(2 / 2.1)  # charged 0.1: catching up was the look's price
    restored = CostModel(4)
    restored.restore(json.loads(json.dumps(model.state())))
    assert restored.catch_up_seconds == model.catch_up_seconds == pytest.approx(0.6)
    assert restored.draft_seconds == pytest.approx(0.1)


def test_drafting_stops_at_a_batch_size_where_its_rounds_turned_out_slower_than_plain_steps():
    """A draft sure of its tokens that the target rejects: its rounds predict a gain and deliver a loss."""
    drafting = CostAwareDrafting(STEEP)
    committed = [torch.tensor([1, 2, 3])] * 4
    sure = torch.full((4, 6), 0.9)
    assert drafting.plan(committed, limit=6) is None
    drafting.drafted(0.2, batch_size=4)
    num_drafts = drafting.length(sure, limit=6)
    assert num_drafts > 0 and drafting.pays
    drafting.accepted(num_drafts, [0] * 4, seconds=STEEP.verify_seconds[num_drafts])  # none accepted
    assert drafting.realized_gain[4] == pytest.approx(1 / (0.2 + STEEP.verify_seconds[num_drafts]))
    assert drafting.plan(committed, limit=6).shape == (4, 0)  # plain steps, though the confidences still promise
    drafting.skipped = 0  # before its next look
    assert drafting.plan(committed[:3], limit=6).shape == (3, 0)  # a row left the batch: the nearest size's gain
    drafting.realized_gain[1] = 1.5  # where drafted rounds did pay, drafting goes on
    drafting.skipped = 0
    assert drafting.plan(committed[:1], limit=6) is None
    drafting.drafted(0.2, batch_size=1)
    drafting.accepted(0, [0], seconds=STEEP.verify_seconds[0])  # a look that verified no draft measures no gain
    assert drafting.realized_gain[1] == 1.5


def test_a_batch_round_counts_what_it_did_for_the_call_its_furthest_behind_row_decides():
    """A batch call lasts until its furthest-behind row reaches its budget: tokens the rows ahead accept only let
    them leave earlier, so a round where they alone accept saved the call one plain step, not their mean."""
    assert call_progress([3, 0, 0], remaining=[10, 10, 10]) == 1  # the rows behind accepted nothing
    assert call_progress([0, 3], remaining=[5, 10]) == 4  # the row behind accepted 3: 10 -> 6 tokens left
    assert call_progress([0, 2], remaining=[10, 9]) == 1  # the row ahead's tokens: the call still needs 9 steps
    assert call_progress([0, 5], remaining=[1, 3]) == 3  # budgets end both rows: the call is done
    assert call_progress([1, 3]) == 3  # no budgets: the rows' mean tokens
    drafting = CostAwareDrafting(STEEP)
    committed = [torch.tensor([1, 2, 3])] * 4
    assert drafting.plan(committed, limit=6) is None
    drafting.drafted(0.2, batch_size=4)
    num_drafts = drafting.length(torch.full((4, 6), 0.9), limit=6)
    seconds = 0.2 + STEEP.verify_seconds[num_drafts]
    accepted = [num_drafts, num_drafts, 0, 0]  # half the rows accept every draft: their mean beats a plain step
    assert (1 + sum(accepted) / 4) / seconds > 1.0
    drafting.accepted(num_drafts, accepted, seconds=STEEP.verify_seconds[num_drafts], remaining=[64] * 4)
    assert drafting.realized_gain[4] == pytest.approx(1 / seconds)  # the call moved one step
    assert drafting.plan(committed, limit=6).shape == (4, 0)  # plain steps


def test_a_batch_calls_rounds_progress_adds_up_to_the_plain_steps_it_would_have_needed(monkeypatch):
    """The engine tells the policy each row's tokens left to its budget, so the rounds' call progress telescopes: a
    call of rows that all run to the budget moved on, over its rounds, by the steps plain decoding takes after the
    prefill's token, however the rows' acceptance differed and whenever they left the batch."""
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    with torch.no_grad():
        draft.head.embed_proj[2].weight.mul_(50.0)  # confident drafts: rows accept different counts
    draft.drafting_options = DraftingOptions(draft_length="cost", draft_costs=STEEP)
    progress = []

    def recording(self, num_verified, num_accepted, seconds=None, committed=None, remaining=None):
        progress.append(call_progress(num_accepted, remaining))
        return accepted(self, num_verified, num_accepted, seconds, committed, remaining)

    accepted = CostAwareDrafting.accepted
    monkeypatch.setattr(CostAwareDrafting, "accepted", recording)
    for seed in range(3):
        input_ids = torch.randint(0, 100, (4, 6), generator=torch.Generator().manual_seed(seed))
        progress.clear()
        output = speculative_generate(target, draft, input_ids, max_new_tokens=20, eos_token_id=[])
        assert output.sequences.shape[1] == 6 + 20
        assert sum(progress) == 20 - 1 and len(progress) == output.num_rounds


def test_rows_leaving_a_batch_go_by_what_drafting_delivered_at_batch_sizes_like_it():
    """Rows leave a batch one by one, so batch sizes between powers of two pool their drafted rounds' gains: one good
    round at 10 rows does not turn drafting on where rounds at 12 rows lost."""
    drafting = CostAwareDrafting(STEEP)
    sure = torch.full((12, 6), 0.9)
    assert drafting.plan([torch.tensor([1, 2, 3])] * 12, limit=6) is None
    drafting.drafted(0.2, batch_size=12)
    num_drafts = drafting.length(sure, limit=6)
    seconds = 0.2 + STEEP.verify_seconds[num_drafts]
    drafting.accepted(num_drafts, [0] * 12, seconds=STEEP.verify_seconds[num_drafts])  # none accepted: a loss
    drafting.drafted(0.2, batch_size=10)
    drafting.length(sure[:10], limit=6)
    drafting.accepted(num_drafts, [1] * 10, seconds=STEEP.verify_seconds[num_drafts])  # 2 tokens a row: a gain
    assert 2 / seconds > 1.0 and list(drafting.realized_gain) == [16]
    assert drafting.realized_gain[16] == pytest.approx(0.7 * (1 / seconds) + 0.3 * (2 / seconds))
    assert drafting.realized_gain[16] < 1.0
    assert drafting.plan([torch.tensor([1, 2, 3])] * 10, limit=6).shape == (10, 0)  # plain steps at 10 rows too


def test_a_process_arriving_where_drafting_lost_looks_seldom_from_its_first_round_where_a_look_is_dear():
    wide = FixedCosts(DraftCosts(verify_seconds=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0), draft_seconds=0.6))
    narrow = FixedCosts(STEEP)
    drafting = CostAwareDrafting(
        lambda batch_size, context: wide if batch_size >= 8 else narrow,
        realized_gain={1: 1.5, 2: 0.7, 8: 0.95, 16: 0.7},
    )
    sure = torch.full((1, 6), 0.9)
    assert drafting.plan([torch.tensor([1, 2, 3])], limit=6) is None  # batch 1: drafting pays
    drafting.drafted(0.2, batch_size=1)
    assert drafting.length(sure, limit=6) > 0 and drafting.pays and drafting.wait == 1

    def rounds_to_first_look(batch_size: int) -> int:
        committed = [torch.tensor([1, 2, 3])] * batch_size
        for round_index in range(100):
            if drafting.plan(committed, limit=6) is None:
                drafting.skipped = 0
                return round_index
        return 100

    assert rounds_to_first_look(2) == 1  # a clear loss where a look costs 0.3 of a step: the next round looks
    # where a look costs 1.6 steps, the longest wait at once (1.6 / EXPLORATION_SHARE), whether the loss was within
    # the swing of timings or clear
    assert rounds_to_first_look(8) == 80
    assert rounds_to_first_look(12) == 80


def test_a_draft_that_skipped_rounds_keeps_its_context_whole():
    """After skipped rounds the draft catches up on the context it did not read: its blocks are a fresh draft's."""
    target = tiny_target("qwen3", dtype=torch.float64)
    draft = tiny_draft(target, block_size=6).to(torch.float64)
    # A random draft verifying chains: mostly skips (no looked-up rounds, which would read the context the same way)
    draft.drafting_options = DraftingOptions(draft_length="cost", draft_costs=STEEP, prompt_lookup=0, tree_nodes=0)
    rounds = []

    def recording_draft_block(**kwargs):
        block = type(draft).draft_block(draft, **kwargs)
        rounds.append((int(kwargs["anchor_position_ids"][0]), block))
        return block

    for seed in range(3):
        input_ids = torch.randint(0, 100, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(input_ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
        for path in ("native", "hf"):
            rounds.clear()
            draft.draft_block = recording_draft_block
            if path == "native":
                output = speculative_generate(target, draft, input_ids, max_new_tokens=32, eos_token_id=[])
                assert output.drafts_verified < output.num_rounds  # skipped rounds verify no draft
                sequences = output.sequences
            else:
                sequences = target.generate(
                    input_ids, max_new_tokens=32, do_sample=False, pad_token_id=0, assistant_model=draft
                )
            del draft.draft_block
            assert torch.equal(sequences, expected)
            assert 1 < len(rounds) < 31, len(rounds)  # some rounds drafted, some skipped
            for anchor_position, block in rounds:
                fresh = draft_from_scratch(draft, target, sequences[:, : anchor_position + 1])
                drafted = block.tokens.shape[1]  # rounds that seemed worth fewer drafts draft the block's first ones
                assert torch.equal(block.tokens, fresh.tokens[:, :drafted]), (path, anchor_position)


def test_prompt_lookup_continues_the_latest_occurrence_of_the_longest_repeated_ending():
    sequence = torch.tensor([7, 1, 2, 9, 9, 1, 2, 5, 6, 3, 2, 1, 2])
    tokens, size = prompt_lookup(sequence, max_ngram_size=3, max_tokens=4)
    assert size == 2 and tokens.tolist() == [5, 6, 3, 2]  # "1 2" occurred twice: the later one; "2 1 2" never
    tokens, size = prompt_lookup(sequence, max_ngram_size=1, max_tokens=2)
    assert size == 1 and tokens.tolist() == [1, 2]  # "2" last occurred before "1 2"
    tokens, size = prompt_lookup(torch.tensor([4, 5, 6]), max_ngram_size=3, max_tokens=4)
    assert size == 0 and tokens.numel() == 0
    tokens, size = prompt_lookup(torch.tensor([8, 8]), max_ngram_size=3, max_tokens=4)
    assert size == 1 and tokens.tolist() == [8]  # the ending's own tokens are not a continuation


def test_looked_up_tokens_are_verified_while_they_match_and_each_ngram_size_learns_alone():
    drafting = CostAwareDrafting(STEEP, prompt_lookup=2)
    repeat_of_two = torch.tensor([1, 2, 3, 4, 5, 6, 1, 2])
    looked_up = drafting.plan([repeat_of_two], limit=4)
    assert looked_up is not None and looked_up[0].tolist() == [3, 4, 5, 6][: looked_up.shape[1]]
    for _ in range(20):  # its tokens never match: bigram lookups stop paying, and the round drafts (None)
        looked_up = drafting.plan([repeat_of_two], limit=4)
        if looked_up is None:
            break
        drafting.accepted(looked_up.shape[1], [0])
    assert looked_up is None
    unigram = drafting.plan([torch.tensor([1, 2, 3, 4, 9, 4])], limit=4)
    assert unigram is not None and unigram.shape[1] > 0  # unigram repeats still may
    drafting.accepted(2, [2])
    assert drafting.plan([torch.tensor([1, 2, 3])], limit=4) is None  # nothing repeats
    assert drafting.plan([repeat_of_two, torch.tensor([1, 2, 3])], limit=4) is None  # every row needs a repeat
    assert CostAwareDrafting(STEEP).plan([repeat_of_two], limit=4) is None  # prompt lookup off


def test_repeats_a_round_passed_over_are_checked_against_the_tokens_it_committed():
    """Rounds that verify no looked-up tokens (a row without a repeat makes the batch draft) still learn how far each
    row's repeat would have been accepted, so a text whose repeats miss is never verified against them."""
    repeat_of_two, no_repeat = torch.tensor([1, 2, 3, 4, 5, 6, 1, 2]), torch.tensor([1, 2, 3])
    missing, matching = CostAwareDrafting(STEEP, prompt_lookup=2), CostAwareDrafting(STEEP, prompt_lookup=2)
    for drafting, committed in ((missing, [9, 9, 9]), (matching, [3, 4, 5])):
        assert drafting.plan([repeat_of_two], limit=4) is not None  # the prior: a repeat's first token pays
        drafting.forget_round()
        for _ in range(12):
            assert drafting.plan([repeat_of_two, no_repeat], limit=4) is None
            drafting.accepted(2, [2, 2], committed=torch.tensor([committed, [7, 7, 7]]))
    assert missing.plan([repeat_of_two], limit=4) is None
    looked_up = matching.plan([repeat_of_two], limit=4)
    assert looked_up is not None and looked_up[0].tolist() == [3, 4, 5, 6][: looked_up.shape[1]]
    assert looked_up.shape[1] >= 3


def test_a_batch_searches_no_row_for_repeats_past_the_first_whose_repeat_does_not_pay():
    """One row without a paying repeat decides that the round verifies none, so a wide batch's plain rounds search one
    row, not every row; the rows searched before it still learn from the tokens the round commits."""
    repeat_of_two, no_repeat = torch.tensor([1, 2, 3, 4, 5, 6, 1, 2]), torch.tensor([1, 2, 3])
    drafting = CostAwareDrafting(STEEP, prompt_lookup=2)
    assert drafting.plan([repeat_of_two, no_repeat, repeat_of_two, repeat_of_two], limit=4) is None
    assert [size for size, _ in drafting.branches] == [2, 0]
    reached_before = drafting.lookup_reached.clone()
    drafting.accepted(0, [0] * 4, committed=torch.tensor([[3], [7], [3], [3]]))
    assert (drafting.lookup_reached - reached_before).sum() == 1  # the first row's repeat, checked once


def test_generate_checks_the_repeats_its_rounds_pass_over_against_the_tokens_they_commit():
    """`target.generate(assistant_model=draft)` learns how far the repeats its rounds did not verify would have been
    accepted, as the engine does: with looked-up tokens priced out, its rounds still count them."""
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    draft.drafting_options = DraftingOptions(draft_length="cost", prompt_lookup=2)
    drafting = cost_aware_drafting(target, draft, draft.drafting_options)  # the one the call goes on from
    drafting.lookup_accepted.zero_()  # no repeat is ever worth verifying
    reached_before = drafting.lookup_reached.clone()
    prompt = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(3))
    expected = target.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
    output = target.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0, assistant_model=draft)
    assert torch.equal(output, expected)
    assert drafting.lookup_reached.sum() > reached_before.sum()  # random tiny targets loop: their rows repeat
    assert drafting.lookup_accepted.sum() > 0


def test_greedy_decoding_with_looked_up_rounds_is_lossless():
    """Rows that loop (as random tiny targets do) are verified against their own earlier tokens; a left-padded batch
    with rows stopping at EOS inside a block, through both paths, equals plain greedy decoding."""
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    # Verifying costs the same for any length: every repeat pays.
    draft.drafting_options = DraftingOptions(draft_length="cost", draft_costs=DraftCosts((1.0,) * 7, 0.5))
    prompts = [torch.randint(0, 100, (1, 4 + seed), generator=torch.Generator().manual_seed(seed)) for seed in range(6)]
    alone = [target.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0) for prompt in prompts]
    eos_token_id = int(alone[0][0, prompts[0].shape[1] + 20])  # some rows stop on it
    alone = [
        target.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos_token_id)
        for prompt in prompts
    ]
    for prompt, expected in zip(prompts, alone):
        hf = target.generate(
            prompt, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos_token_id, assistant_model=draft
        )
        assert torch.equal(hf, expected)
    input_ids, attention_mask = left_pad(prompts, 127)
    output = speculative_generate(
        target, draft, input_ids, attention_mask, max_new_tokens=40, eos_token_id=eos_token_id, pad_token_id=127
    )
    assert output.looked_up_rounds > 0
    for row, (prompt, expected) in enumerate(zip(prompts, alone)):
        generated = expected[0, prompt.shape[1] :]
        assert torch.equal(output.sequences[row, input_ids.shape[1] :][: generated.numel()], generated)
    assert len(set(output.num_new_tokens)) > 1  # rows finished at different times
