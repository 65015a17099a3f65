"""Speculative sampling is exact: the generated tokens are distributed as the target's own sampling.

Setup with statistical power: the tiny Qwen3 target's LM head is peaked on five tokens (`make_peaked`); the real
random draft shares that head, so its proposals fall on the same tokens with different probabilities and are
accepted about half the time. One of the five is EOS. The exact distribution of the whole generation (up to
`NUM_TOKENS` tokens, ending at EOS) is enumerated with transformers' own logits processors, and samples from each
decoding path are compared with Pearson's chi-square test at alpha = 1e-4 (outcomes expected fewer than 5 times
pooled). The window covers the prefill's token, a first round's drafts and its bonus token, later rounds, EOS
inside a block and the length limit cutting a round. The same test applied to the target's own
`generate(do_sample=True)` checks the reference. A sampler that skipped the residual distribution, took the bonus
token greedily or accepted every draft fails by a wide margin (the statistic is tens to hundreds of times the bound).

Every check also tests the first `FIRST_ROUND` tokens alone (the prefill's token and the first round's first two
drafts): far fewer cells than the whole window, so more power against a bias in how one round accepts its drafts
(a q that is not the distribution the drafts were drawn from). Two tests at alpha = 1e-4 each: a correct sampler
fails a check with probability at most 2e-4, and never on rerun (fixed seeds make the statistic deterministic).

The draft's side is also tested directly (`drawn_from_test`, alpha = 1e-4): each sampled draft, from `draft_block`
and from the HF path's `get_candidates`, follows the softmax of the logits returned with it, the q that acceptance
divides by. Processors on the draft side only change acceptance, never the output: what must hold is that q is the
drafts' distribution.
"""

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from domino_spec import DraftCosts, DraftingOptions
from domino_spec.draft_building import with_draft_vocab
from domino_spec.generation import left_pad, speculative_generate

from conftest import tiny_draft, tiny_target, word_tokenizer
from speculative_helpers import (
    LIVE_TOKENS,
    chi_square_test,
    draft_from_scratch,
    drawn_from_test,
    exact_joint_distribution,
    first_tokens_distribution,
    make_peaked,
    until_eos,
)

NUM_TOKENS = 5  # max_new_tokens: the prefill's token, then three drafts and a bonus token if all are accepted
EOS = LIVE_TOKENS[1]  # about half the sequences end at it, most inside a block
NUM_NATIVE_SAMPLES = 4000  # one batched call: every row is one seed's run, rows finishing at different times
NUM_HF_SAMPLES = 1500  # one generate call per seed
NUM_HF_STRONG_HEAD_SAMPLES = 1000  # the bad draft rejects often: its bias would show sooner
NUM_HF_COST_AWARE_SAMPLES = 500
NUM_DRAFT_ROWS = 4000  # drafts of one context, in one batched draft_block call
NUM_HF_CANDIDATE_DRAWS = 3000  # get_candidates calls (batch size 1)
NUM_HF_STOP_SAMPLES = 1500  # the stop string takes an eighth of the mass: more samples for power
NUM_EOS_PROMPT_TOKENS = 3  # the placeholder's round and one more
NUM_HF_EOS_PROMPT_SAMPLES = 1000
FIRST_ROUND = 3  # tokens of the second check: the prefill's token and the first round's first two


# These check exact sampling with drafts verified, whatever verifying them costs: a batch of thousands of rows verifying
# drafts costs a CPU so much that the cost-aware length would verify none (tested on its own below).
FULL_BLOCKS = DraftingOptions(draft_length="full")


@pytest.fixture(scope="module")
def models():
    target = make_peaked(tiny_target("qwen3", seed=3), scale=5.0)
    draft = tiny_draft(target)
    draft.drafting_options = FULL_BLOCKS
    prompt = torch.tensor([[5, 60, 21, 99, 14, 33, 8, 71]])
    return target, draft, prompt


def assert_distributed_as(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float], what: str) -> None:
    """Chi-square tests of the whole outcomes and of their first `FIRST_ROUND` tokens, at alpha = 1e-4 each."""
    for window in (None, FIRST_ROUND):
        observed = samples if window is None else [sample[:window] for sample in samples]
        expected = exact if window is None else first_tokens_distribution(exact, window)
        statistic, bound = chi_square_test(observed, expected)
        tokens = "all tokens" if window is None else f"first {window} tokens"
        assert statistic < bound, f"{what}, {tokens}: chi-square {statistic:.1f} >= {bound:.1f}"


def _outcomes(sequences: torch.Tensor, prompt_length: int, pad_token_id: int | None = None) -> list[tuple[int, ...]]:
    """Each row's generated tokens up to EOS; with `pad_token_id`, rows must be padded with it after their EOS."""
    outcomes = []
    for row in sequences[:, prompt_length:].tolist():
        outcome = until_eos(row, EOS)
        if pad_token_id is not None:
            assert row[len(outcome) :] == [pad_token_id] * (len(row) - len(outcome)), row
        outcomes.append(outcome)
    return outcomes


NATIVE_SETTINGS = {
    "plain-softmax": (dict(), LogitsProcessorList()),
    "temperature-top_k-top_p": (
        dict(temperature=0.7, top_k=3, top_p=0.9),
        LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(3), TopPLogitsWarper(0.9)]),
    ),
}


@pytest.mark.parametrize("name", list(NATIVE_SETTINGS))
def test_native_sampling_matches_target_distribution(models, name):
    target, draft, prompt = models
    settings, processors = NATIVE_SETTINGS[name]
    exact = exact_joint_distribution(target, prompt, NUM_TOKENS, processors, eos_token_id=EOS)
    batch = prompt.expand(NUM_NATIVE_SAMPLES, -1)
    output = speculative_generate(
        target,
        draft,
        batch,
        max_new_tokens=NUM_TOKENS,
        do_sample=True,
        eos_token_id=EOS,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(0),
        **settings,
    )
    # The draft must be neither always rejected nor always accepted for the test to mean something.
    rates = output.position_acceptance_rates
    assert 0.15 < float(rates[0]) < 0.95 and 0.05 < float(rates[1]) < 0.95, rates
    outcomes = _outcomes(output.sequences, prompt.shape[1], pad_token_id=0)
    assert 0.1 < sum(outcome[-1] == EOS for outcome in outcomes) / len(outcomes) < 0.9  # EOS inside blocks, often
    assert_distributed_as(outcomes, exact, "native speculative sampling")


@pytest.mark.parametrize("name", list(NATIVE_SETTINGS))
def test_native_sampling_down_trees_matches_target_distribution(models, name):
    """Trees of 6 nodes a round (the draft's likeliest tokens, verified by `trees.sample_tree`), every row its own."""
    target, draft, prompt = models
    settings, processors = NATIVE_SETTINGS[name]
    exact = exact_joint_distribution(target, prompt, NUM_TOKENS, processors, eos_token_id=EOS)
    output = speculative_generate(
        target,
        draft,
        prompt.expand(NUM_NATIVE_SAMPLES, -1),
        max_new_tokens=NUM_TOKENS,
        do_sample=True,
        eos_token_id=EOS,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(4),
        options=DraftingOptions(draft_length="full", tree_nodes=6),
        **settings,
    )
    assert output.tree_rounds > 0 and 0.15 < float(output.position_acceptance_rates[0]) < 0.95
    assert output.branch_wins > 0  # rows accepted a node off the draft's likeliest branch
    outcomes = _outcomes(output.sequences, prompt.shape[1], pad_token_id=0)
    assert_distributed_as(outcomes, exact, f"native sampling down trees ({name})")


@pytest.fixture(scope="module")
def strong_head_draft(models):
    """A deliberately bad draft whose Domino head matters: every slot corrected, residual weights x 150.

    The head then moves a slot's distribution by a total variation of about 0.2 (the default random head: 0.005),
    and the first draft is rejected in about 40% of rounds. Sampled drafts come from the corrected logits, so a q
    taken from other logits (the base ones, unprocessed ones) biases the output. The candidate pool set here is for
    greedy drafting only: sampling must draw from, and report, the whole vocabulary.
    """
    target, _, prompt = models
    draft = tiny_draft(target, first_corrected_slot=0)
    draft.drafting_options = DraftingOptions(candidate_pool=3, draft_length="full")
    identity = LogitsProcessorList()  # a processor: the whole-vocabulary head loop, as in sampling

    def first_slot():
        return draft_from_scratch(draft, target, prompt, logits_processor=identity, prefix_ids=prompt).logits[:, 0]

    weak = first_slot().softmax(-1)
    with torch.no_grad():
        draft.head.embed_proj[2].weight.mul_(150.0)
    assert 0.5 * float((first_slot().softmax(-1) - weak).abs().sum()) > 0.1  # the head moves q
    return draft


STRONG_HEAD_SETTINGS = {
    "plain-softmax": (dict(), LogitsProcessorList()),
    "temperature-top_k": (
        dict(temperature=1.5, top_k=2),
        LogitsProcessorList([TemperatureLogitsWarper(1.5), TopKLogitsWarper(2)]),
    ),
}


@pytest.mark.parametrize("name", list(STRONG_HEAD_SETTINGS))
def test_native_sampling_with_a_strong_head_matches_target_distribution(models, strong_head_draft, name):
    target, _, prompt = models
    settings, processors = STRONG_HEAD_SETTINGS[name]
    exact = exact_joint_distribution(target, prompt, NUM_TOKENS, processors, eos_token_id=EOS)
    output = speculative_generate(
        target,
        strong_head_draft,
        prompt.expand(NUM_NATIVE_SAMPLES, -1),
        max_new_tokens=NUM_TOKENS,
        do_sample=True,
        eos_token_id=EOS,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(2),
        **settings,
    )
    assert 0.2 < float(output.position_acceptance_rates[0]) < 0.8, output.position_acceptance_rates
    outcomes = _outcomes(output.sequences, prompt.shape[1], pad_token_id=0)
    assert_distributed_as(outcomes, exact, f"native sampling with a strong head ({name})")


DRAFT_PROCESSORS = {
    "plain-softmax": None,
    "repetition_penalty-temperature-top_k": LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(1.5), TemperatureLogitsWarper(1.3), TopKLogitsWarper(3)]
    ),
}


@pytest.mark.parametrize("name", list(DRAFT_PROCESSORS))
def test_sampled_drafts_are_drawn_from_the_logits_they_report(models, strong_head_draft, name):
    """The draft's side of exactness, for both paths: every draft is drawn from the softmax of the logits returned
    with it (the head's corrected logits after the processors, which read the drafts so far), slot by slot.

    Tested directly, with far more power than through the output: a q that is not the drafts' distribution biases
    the output only by what it changes in acceptance."""
    target, _, prompt = models
    batch = prompt.expand(NUM_DRAFT_ROWS, -1)
    block = draft_from_scratch(
        strong_head_draft,
        target,
        batch,
        do_sample=True,
        prefix_ids=batch,
        logits_processor=DRAFT_PROCESSORS[name],
        generator=torch.Generator().manual_seed(4),
    )
    statistic, bound = drawn_from_test(block.tokens, block.logits)
    assert statistic < bound, f"sampled drafts ({name}): chi-square {statistic:.1f} >= {bound:.1f}"


def test_hf_candidates_are_drawn_from_the_logits_they_return(models, strong_head_draft):
    """The candidate generator's side of the HF path: transformers' speculative sampling divides by the softmax of
    the logits `get_candidates` returns, so each candidate must be drawn from exactly that."""
    target, _, prompt = models
    input_ids = torch.cat([prompt, torch.tensor([[LIVE_TOKENS[2]]])], dim=-1)  # the prompt and the prefill's token
    prefill = target(prompt, output_hidden_states=True)
    config = GenerationConfig(do_sample=True, max_length=input_ids.shape[1] + NUM_TOKENS)
    processors = DRAFT_PROCESSORS["repetition_penalty-temperature-top_k"]
    torch.manual_seed(5)
    tokens, logits = [], []
    for _ in range(NUM_HF_CANDIDATE_DRAWS):  # a new generator each time: an empty draft cache, the same context
        generator = strong_head_draft.get_candidate_generator(target, config, input_ids, logits_processor=processors)
        candidates, candidate_logits = generator.get_candidates(input_ids, model_outputs=prefill)
        tokens.append(candidates[0, input_ids.shape[1] :])
        logits.append(candidate_logits[0])
    statistic, bound = drawn_from_test(torch.stack(tokens), torch.stack(logits))
    assert statistic < bound, f"HF-path candidates: chi-square {statistic:.1f} >= {bound:.1f}"


def test_native_sampling_of_a_left_padded_batch_matches_each_prompt(models):
    """Two prompts of different lengths interleaved in one batch: every row follows its own prompt's distribution."""
    target, draft, prompt = models
    short_prompt = torch.tensor([[9, 44, 70]])
    input_ids, attention_mask = left_pad([prompt, short_prompt] * (NUM_NATIVE_SAMPLES // 2), pad_token_id=0)
    output = speculative_generate(
        target,
        draft,
        input_ids,
        attention_mask,
        max_new_tokens=NUM_TOKENS,
        do_sample=True,
        eos_token_id=EOS,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(1),
    )
    outcomes = _outcomes(output.sequences, input_ids.shape[1], pad_token_id=0)
    for parity, row_prompt in enumerate([prompt, short_prompt]):
        exact = exact_joint_distribution(target, row_prompt, NUM_TOKENS, LogitsProcessorList(), eos_token_id=EOS)
        assert_distributed_as(outcomes[parity::2], exact, f"prompt {parity} of a padded batch")


def test_target_own_sampling_matches_reference(models):
    """Control: the enumerated reference is the target's own sampling distribution."""
    target, _, prompt = models
    torch.manual_seed(0)
    sequences = target.generate(
        prompt.expand(NUM_NATIVE_SAMPLES, -1),
        max_new_tokens=NUM_TOKENS,
        do_sample=True,
        temperature=0.7,
        top_k=3,
        top_p=0.9,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    processors = NATIVE_SETTINGS["temperature-top_k-top_p"][1]
    exact = exact_joint_distribution(target, prompt, NUM_TOKENS, processors, eos_token_id=EOS)
    assert_distributed_as(_outcomes(sequences, prompt.shape[1], pad_token_id=0), exact, "target.generate sampling")


def test_hf_path_sampling_matches_target_distribution(models):
    """Through generate(assistant_model=draft), with an id-dependent processor (repetition penalty) as well."""
    target, draft, prompt = models
    processors = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(1.5),
            TemperatureLogitsWarper(0.6),
            TopKLogitsWarper(3),
            TopPLogitsWarper(0.95),
        ]
    )
    exact = exact_joint_distribution(target, prompt, NUM_TOKENS, processors, eos_token_id=EOS)
    samples = []
    for seed in range(NUM_HF_SAMPLES):
        torch.manual_seed(seed)
        sequences = target.generate(
            prompt,
            max_new_tokens=NUM_TOKENS,
            do_sample=True,
            temperature=0.6,
            top_k=3,
            top_p=0.95,
            repetition_penalty=1.5,
            eos_token_id=EOS,
            pad_token_id=0,
            assistant_model=draft,
        )
        samples += _outcomes(sequences, prompt.shape[1])
    assert_distributed_as(samples, exact, "HF-path speculative sampling")


def test_hf_path_sampling_with_a_strong_head_matches_target_distribution(models, strong_head_draft):
    """The bad draft through generate(assistant_model=draft), with min-p and an id-dependent n-gram ban."""
    target, _, prompt = models
    processors = LogitsProcessorList([NoRepeatNGramLogitsProcessor(2), MinPLogitsWarper(0.2)])
    exact = exact_joint_distribution(target, prompt, NUM_TOKENS, processors, eos_token_id=EOS)
    samples = []
    for seed in range(NUM_HF_STRONG_HEAD_SAMPLES):
        torch.manual_seed(seed)
        sequences = target.generate(
            prompt,
            max_new_tokens=NUM_TOKENS,
            do_sample=True,
            top_k=0,
            min_p=0.2,
            no_repeat_ngram_size=2,
            eos_token_id=EOS,
            pad_token_id=0,
            assistant_model=strong_head_draft,
        )
        samples += _outcomes(sequences, prompt.shape[1])
    assert_distributed_as(samples, exact, "HF-path sampling with a strong head")


def test_hf_path_sampling_with_a_stop_string_matches_target_distribution(models):
    """A stop string the draft often completes (token 17 reads `w017`): generation must stop there exactly as often
    as the target's own sampling does, and continue otherwise with the target's probabilities."""
    target, draft, prompt = models
    tokenizer = word_tokenizer()
    exact: dict[tuple[int, ...], float] = {}
    for tokens, probability in exact_joint_distribution(target, prompt, 2, LogitsProcessorList()).items():
        outcome = tokens[:1] if tokens[0] == LIVE_TOKENS[1] else tokens  # generation stops after `w017`
        exact[outcome] = exact.get(outcome, 0.0) + probability
    samples = []
    for seed in range(NUM_HF_STOP_SAMPLES):
        torch.manual_seed(seed)
        # max_new_tokens = 3: the first round drafts the second token, and verifying it gives the third
        sequences = target.generate(
            prompt, max_new_tokens=3, do_sample=True, stop_strings=["w017"], tokenizer=tokenizer, assistant_model=draft
        )
        generated = tuple(sequences[0, prompt.shape[1] :].tolist())
        assert LIVE_TOKENS[1] not in generated[:-1], generated  # stopped at the stop string
        samples.append(generated[:1] if generated[0] == LIVE_TOKENS[1] else generated[:2])
    statistic, bound = chi_square_test(samples, exact)
    assert statistic < bound, f"HF-path sampling with a stop string: chi-square {statistic:.1f} >= {bound:.1f}"


def test_hf_path_sampling_after_a_prompt_ending_in_eos_matches_target_distribution(models):
    """The prefill's placeholder draft (EOS, one-hot q) is accepted with the target's probability of EOS and
    otherwise replaced from the rest of the target's distribution: the output is the target's sampling."""
    target, draft, prompt = models
    prompt = torch.cat([prompt, torch.tensor([[EOS]])], dim=-1)
    exact = exact_joint_distribution(target, prompt, NUM_EOS_PROMPT_TOKENS, LogitsProcessorList(), eos_token_id=EOS)
    assert 0.05 < sum(probability for tokens, probability in exact.items() if tokens[0] == EOS) < 0.95  # both branches
    samples = []
    for seed in range(NUM_HF_EOS_PROMPT_SAMPLES):
        torch.manual_seed(seed)
        sequences = target.generate(
            prompt,
            max_new_tokens=NUM_EOS_PROMPT_TOKENS,
            do_sample=True,
            top_k=0,
            eos_token_id=EOS,
            pad_token_id=0,
            assistant_model=draft,
        )
        samples += _outcomes(sequences, prompt.shape[1])
    assert_distributed_as(samples, exact, "HF-path sampling after a prompt ending in EOS")


def test_native_sampling_is_reproducible_with_a_generator(models):
    target, draft, prompt = models
    runs = [
        speculative_generate(
            target,
            draft,
            prompt.expand(4, -1),
            max_new_tokens=10,
            do_sample=True,
            top_k=4,
            generator=torch.Generator().manual_seed(11),
        ).sequences
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])


def test_sampling_with_the_cost_aware_draft_length_matches_target_distribution(models, strong_head_draft, monkeypatch):
    """Each round proposes only the drafts its confidences say pay, a stopping rule on the draft's distributions
    (never on a sampled token), so the output is still the target's sampling; here through generate, whose rounds
    each choose their own length."""
    from domino_spec.cost_aware import CostAwareDrafting, choose_draft_length

    target, _, prompt = models
    lengths = []

    def recording(self, confidence, limit):
        lengths.append(choose_draft_length(confidence, self.cost_models(1, self.context).costs()))
        return length(self, confidence, limit)

    length = CostAwareDrafting.length
    monkeypatch.setattr(CostAwareDrafting, "length", recording)
    processors = LogitsProcessorList([TemperatureLogitsWarper(1.5), TopKLogitsWarper(2)])
    exact = exact_joint_distribution(target, prompt, NUM_TOKENS, processors, eos_token_id=EOS)
    # The first draft pays where its confidence passes ~0.57, about the middle of this draft's.
    costs = DraftCosts(verify_seconds=(1.0, 1.6, 1.93, 2.4, 3.0), draft_seconds=0.05)
    strong_head_draft.drafting_options = DraftingOptions(draft_length="cost", draft_costs=costs)
    samples = []
    try:
        for seed in range(NUM_HF_COST_AWARE_SAMPLES):
            torch.manual_seed(seed)
            sequences = target.generate(
                prompt,
                max_new_tokens=NUM_TOKENS,
                do_sample=True,
                temperature=1.5,
                top_k=2,
                eos_token_id=EOS,
                pad_token_id=0,
                assistant_model=strong_head_draft,
            )
            samples += _outcomes(sequences, prompt.shape[1])
    finally:
        strong_head_draft.drafting_options = DraftingOptions(candidate_pool=3, draft_length="full")
    assert len(set(lengths)) >= 2, set(lengths)  # rounds of different lengths
    assert_distributed_as(samples, exact, "HF-path sampling with the cost-aware draft length")


# Every live token occurs inside the prompt, so every round of every row finds a repeat to look up; with a verify pass
# that costs the same for any length and a dear drafting round, every round of chains verifies looked-up tokens. With
# a cheap drafting round, every round drafts a tree with the looked-up tokens as one more branch.
LOOKUP_PROMPT = torch.tensor([[3, 17, 42, 77, 101, 3, 60, 42]])
LOOKUP_ROUNDS = DraftingOptions(draft_length="cost", draft_costs=DraftCosts((1.0,) * 4, 1.0), tree_nodes=0)
LOOKUP_BRANCHES = DraftingOptions(draft_length="cost", draft_costs=DraftCosts((1.0,) * 7, 0.01), tree_nodes=6)


def looked_up_samples(models, options: DraftingOptions, seed: int):
    """The batch of `NUM_NATIVE_SAMPLES` rows after `LOOKUP_PROMPT`, sampled with `options`, and the exact
    distribution its outcomes must follow."""
    target, draft, _ = models
    processors = NATIVE_SETTINGS["temperature-top_k-top_p"][1]
    exact = exact_joint_distribution(target, LOOKUP_PROMPT, NUM_TOKENS, processors, eos_token_id=EOS)
    output = speculative_generate(
        target,
        draft,
        LOOKUP_PROMPT.expand(NUM_NATIVE_SAMPLES, -1),
        max_new_tokens=NUM_TOKENS,
        do_sample=True,
        eos_token_id=EOS,
        pad_token_id=0,
        temperature=0.7,
        top_k=3,
        top_p=0.9,
        generator=torch.Generator().manual_seed(seed),
        options=options,
    )
    return output, _outcomes(output.sequences, LOOKUP_PROMPT.shape[1], pad_token_id=0), exact


def test_native_sampling_of_looked_up_rounds_matches_target_distribution(models):
    """Looked-up tokens were not drawn from a distribution: q is all on them, and exact rejection sampling accepts
    each with the target's probability of it, sampling the residual where it does not."""
    output, outcomes, exact = looked_up_samples(models, LOOKUP_ROUNDS, seed=7)
    assert output.looked_up_rounds >= 2  # every round with room for a draft
    assert 0.05 < float(output.position_acceptance_rates[0]) < 0.95, output.position_acceptance_rates
    assert_distributed_as(outcomes, exact, "native sampling of looked-up rounds")


def test_native_sampling_down_trees_with_a_looked_up_branch_matches_target_distribution(models):
    """A looked-up branch's tokens were not drawn either: nodes like any other to `trees.sample_tree`."""
    output, outcomes, exact = looked_up_samples(models, LOOKUP_BRANCHES, seed=8)
    assert output.tree_rounds >= 2 and output.lookup_wins > 0  # rows took a node only the looked-up branch had
    assert_distributed_as(outcomes, exact, "native sampling down trees with a looked-up branch")


def test_hf_path_sampling_of_looked_up_rounds_matches_target_distribution(models):
    target, draft, _ = models
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(4)])
    exact = exact_joint_distribution(target, LOOKUP_PROMPT, NUM_TOKENS, processors, eos_token_id=EOS)
    draft.drafting_options = LOOKUP_ROUNDS
    samples = []
    try:
        for seed in range(NUM_HF_COST_AWARE_SAMPLES):
            torch.manual_seed(seed)
            sequences = target.generate(
                LOOKUP_PROMPT,
                max_new_tokens=NUM_TOKENS,
                do_sample=True,
                temperature=0.8,
                top_k=4,
                eos_token_id=EOS,
                pad_token_id=0,
                assistant_model=draft,
            )
            samples += _outcomes(sequences, LOOKUP_PROMPT.shape[1])
    finally:
        draft.drafting_options = FULL_BLOCKS
    assert_distributed_as(samples, exact, "HF-path sampling of looked-up rounds")


def test_native_sampling_with_a_draft_vocabulary_matches_target_distribution(models):
    """A draft vocabulary without two of the target's likely tokens (EOS among them): q is zero there, the target
    still produces them (from the rejection's residual), at its own rates."""
    target, draft, prompt = models
    vocabulary = [token for token in range(120) if token not in (LIVE_TOKENS[1], LIVE_TOKENS[4])]
    restricted = with_draft_vocab(draft, torch.tensor(vocabulary))
    processors = NATIVE_SETTINGS["temperature-top_k-top_p"][1]
    exact = exact_joint_distribution(target, prompt, NUM_TOKENS, processors, eos_token_id=EOS)
    output = speculative_generate(
        target,
        restricted,
        prompt.expand(NUM_NATIVE_SAMPLES, -1),
        max_new_tokens=NUM_TOKENS,
        do_sample=True,
        eos_token_id=EOS,
        pad_token_id=0,
        temperature=0.7,
        top_k=3,
        top_p=0.9,
        generator=torch.Generator().manual_seed(6),
    )
    outcomes = _outcomes(output.sequences, prompt.shape[1], pad_token_id=0)
    assert 0.1 < sum(outcome[-1] == EOS for outcome in outcomes) / len(outcomes) < 0.9  # EOS: the target's alone
    assert_distributed_as(outcomes, exact, "native sampling with a draft vocabulary")
