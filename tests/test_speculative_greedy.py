"""Greedy speculative decoding is lossless: token for token equal to `target.generate(do_sample=False)`.

50 random prompts per target family (tiny Qwen3 and Llama), with a random draft (the real model: low acceptance)
and an oracle draft (the target's own greedy continuation: full-block acceptance), EOS and length limits landing
inside blocks, through `target.generate(assistant_model=draft)` (draft loaded with AutoModel, trust_remote_code)
and through the native engine, alone and in padded batches. Losslessness cannot show a draft fed the wrong context
(it is only slower): every round's block is also checked against a draft given the whole sequence at once.

Floating point: verification computes the target's logits on 1 + S tokens at once, which can differ from one-token
decoding in the last bits and flip an argmax on a near tie. Every test runs in float64, where such ties cannot
decide the comparison, and in float32, where none occurs on these prompts (a float32-only failure that float64
passes would point at a near tie, not at a bug).
"""

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModel

from domino_spec import DraftingOptions
from domino_spec.draft_building import from_target
from domino_spec.generation import left_pad, speculative_generate

from conftest import tiny_draft, tiny_target
from speculative_helpers import OracleDraft, draft_from_scratch, random_prompts, run_offline

NUM_PROMPTS = 50


@dataclass
class Case:
    prompt: torch.Tensor  # [1, P]
    max_new_tokens: int
    eos_token_id: int | None  # None: the target's default (Llama's generation config has one, Qwen3's none)
    reference: torch.Tensor  # target.generate(prompt, do_sample=False, ...): [1, P + new]
    greedy_sequence: list[int]  # prompt and a greedy continuation past the stop, for the oracle


@dataclass
class Setup:
    family: str
    target: torch.nn.Module
    draft: torch.nn.Module  # the real random draft
    loaded_draft: torch.nn.Module  # the same, saved and loaded via AutoModel(trust_remote_code=True)
    oracle: OracleDraft
    cases: list[Case]


def _build_cases(target, num_drafts: int, seed: int) -> list[Case]:
    cases = []
    for index, prompt in enumerate(random_prompts(NUM_PROMPTS, seed=seed)):
        max_new_tokens = 9 + index % 8  # length limits at every offset inside a block of S + 1 = 5
        greedy = target.generate(prompt, max_new_tokens=max_new_tokens + num_drafts + 1, do_sample=False)
        generated = greedy[0, prompt.shape[1] :].tolist()
        # Every other prompt stops at a token a few positions into its continuation (EOS inside a block).
        eos_token_id = generated[2 + index % 5] if index % 2 == 0 and len(generated) > 7 else None
        reference = target.generate(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, do_sample=False)
        cases.append(Case(prompt, max_new_tokens, eos_token_id, reference, greedy[0].tolist()))
    return cases


@pytest.fixture(
    scope="module",
    params=[("qwen3", torch.float64), ("llama", torch.float64), ("qwen3", torch.float32), ("llama", torch.float32)],
    ids=lambda param: f"{param[0]}-{str(param[1]).removeprefix('torch.')}",
)
def setup(request, tmp_path_factory) -> Setup:
    family, dtype = request.param
    target = tiny_target(family, dtype=dtype)
    draft = tiny_draft(target)
    folder = tmp_path_factory.mktemp(f"draft-{family}")
    draft.save_pretrained(folder)
    loaded_draft = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=dtype).eval()
    assert loaded_draft.dtype == dtype
    assert type(loaded_draft).__module__.startswith("transformers_modules"), "expected the remote-code class"
    torch.manual_seed(2)
    oracle = from_target(
        target,
        draft_class=OracleDraft,
        num_hidden_layers=1,
        block_size=4,
        target_layer_ids=[1, 3],
        gru_hidden_dim=8,
        residual_rank=8,
    ).eval()
    oracle.drafting_options = DraftingOptions(draft_length="full")  # full blocks, whatever verifying them costs
    cases = _build_cases(target, draft.config.num_draft_tokens, seed=100 + len(family))
    assert sum(case.eos_token_id is not None for case in cases) >= NUM_PROMPTS // 3
    return Setup(family, target, draft, loaded_draft, oracle, cases)


def _count_target_forwards(target):
    calls = []
    handle = target.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


def _assert_equal(case: Case, output: torch.Tensor, label: str) -> None:
    assert torch.equal(output, case.reference), (
        f"{label}: speculative output differs from target.generate (max_new_tokens={case.max_new_tokens}, "
        f"eos_token_id={case.eos_token_id})\nexpected {case.reference.tolist()}\ngot      {output.tolist()}"
    )


def test_hf_path_random_draft(setup):
    for case in setup.cases:
        output = setup.target.generate(
            case.prompt,
            max_new_tokens=case.max_new_tokens,
            eos_token_id=case.eos_token_id,
            do_sample=False,
            assistant_model=setup.loaded_draft,
        )
        _assert_equal(case, output, f"{setup.family} HF path, random draft")


def test_hf_path_oracle_draft_accepts_full_blocks(setup):
    block = setup.oracle.config.num_draft_tokens + 1
    for case in setup.cases:
        setup.oracle.set_sequences([case.greedy_sequence])
        calls, handle = _count_target_forwards(setup.target)
        try:
            output = setup.target.generate(
                case.prompt,
                max_new_tokens=case.max_new_tokens,
                do_sample=False,
                eos_token_id=case.eos_token_id,
                assistant_model=setup.oracle,
            )
        finally:
            handle.remove()
        _assert_equal(case, output, f"{setup.family} HF path, oracle draft")
        num_new = output.shape[1] - case.prompt.shape[1]
        # Prefill (one token), then full blocks of S + 1 tokens; only the last round may be cut by EOS or length.
        assert len(calls) == 1 + -(-(num_new - 1) // block), f"{len(calls)} target passes for {num_new} tokens"


def test_native_random_draft(setup):
    for case in setup.cases:
        output = speculative_generate(
            setup.target, setup.draft, case.prompt, max_new_tokens=case.max_new_tokens, eos_token_id=case.eos_token_id
        )
        _assert_equal(case, output.sequences, f"{setup.family} native, random draft")
        num_new = output.sequences.shape[1] - case.prompt.shape[1]
        assert sum(output.acceptance_lengths[0]) + 1 == output.num_new_tokens[0] == num_new


def test_native_oracle_draft_accepts_full_blocks(setup):
    block = setup.oracle.config.num_draft_tokens + 1
    for case in setup.cases:
        setup.oracle.set_sequences([case.greedy_sequence])
        output = speculative_generate(
            setup.target, setup.oracle, case.prompt, max_new_tokens=case.max_new_tokens, eos_token_id=case.eos_token_id
        )
        _assert_equal(case, output.sequences, f"{setup.family} native, oracle draft")
        lengths = output.acceptance_lengths[0]
        # Every round commits a full block, but the last one may be cut by EOS or the length limit.
        assert all(length == block for length in lengths[:-1]), lengths


def test_native_plain_decoding(setup):
    for case in setup.cases[:10]:
        output = speculative_generate(
            setup.target, None, case.prompt, max_new_tokens=case.max_new_tokens, eos_token_id=case.eos_token_id
        )
        _assert_equal(case, output.sequences, f"{setup.family} native plain decoding")
        assert set(output.acceptance_lengths[0]) <= {1}


@pytest.mark.parametrize("path", ["hf", "native"])
def test_every_round_drafts_what_a_draft_from_scratch_drafts(path):
    """Losslessness hides a draft fed wrong context (features at shifted positions, a stale cache): its output is
    still exact, only slower. Each round's block must equal the block of a draft given the whole committed sequence
    at once (one target forward, an empty context cache)."""
    target = tiny_target("qwen3", dtype=torch.float64)
    draft = tiny_draft(target).to(torch.float64)
    draft.drafting_options = DraftingOptions(draft_length="full")  # no cost measurement: every round is the test's
    rounds = []

    def recording_draft_block(**kwargs):
        block = type(draft).draft_block(draft, **kwargs)
        rounds.append((int(kwargs["anchor_position_ids"][0]), block))
        return block

    for prompt in random_prompts(4, seed=7):
        rounds.clear()
        draft.draft_block = recording_draft_block
        if path == "hf":
            output = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=draft)
        else:
            output = speculative_generate(target, draft, prompt, max_new_tokens=16, eos_token_id=[]).sequences
        del draft.draft_block
        assert len(rounds) > 3
        for anchor_position, block in rounds:
            expected = draft_from_scratch(draft, target, output[:, : anchor_position + 1])
            assert torch.equal(block.tokens, expected.tokens), f"round at {anchor_position} of {output.tolist()}"
            torch.testing.assert_close(block.logits, expected.logits)


def test_bfloat16_draft_of_a_float32_target_is_lossless():
    """The shipped setting: a bf16 draft reads fp32 target features and the target's fp32 embeddings and LM head."""
    target = tiny_target("qwen3")
    draft = tiny_draft(target).to(torch.bfloat16)
    for prompt in random_prompts(10, seed=13):
        expected = target.generate(prompt, max_new_tokens=14, do_sample=False)
        assert torch.equal(target.generate(prompt, max_new_tokens=14, do_sample=False, assistant_model=draft), expected)
        native = speculative_generate(target, draft, prompt, max_new_tokens=14, eos_token_id=[])
        assert torch.equal(native.sequences, expected)


@pytest.mark.parametrize("which", ["random", "oracle"])
def test_native_batch_rows_equal_prompts_decoded_alone(setup, which):
    """Left padding, rows accepting different counts and finishing at different times."""
    cases = setup.cases[:12]
    max_new_tokens = 14
    eos_token_id = cases[0].greedy_sequence[cases[0].prompt.shape[1] + 3]  # some rows stop early on it
    alone = [
        setup.target.generate(case.prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, do_sample=False)
        for case in cases
    ]
    draft = setup.draft if which == "random" else setup.oracle
    setup.oracle.set_sequences([case.greedy_sequence for case in cases])
    pad_token_id = 127
    input_ids, attention_mask = left_pad([case.prompt for case in cases], pad_token_id)
    output = speculative_generate(
        setup.target,
        draft,
        input_ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    width = input_ids.shape[1]
    finish_lengths = set()
    for row, (case, reference) in enumerate(zip(cases, alone)):
        num_new = reference.shape[1] - case.prompt.shape[1]
        got = torch.cat([case.prompt[0], output.sequences[row, width : width + num_new]])
        assert torch.equal(got, reference[0]), f"row {row}: {got.tolist()} != {reference[0].tolist()}"
        assert output.num_new_tokens[row] == num_new
        assert (output.sequences[row, width + num_new :] == pad_token_id).all()
        finish_lengths.add(num_new)
    assert len(finish_lengths) > 1, "the batch should have rows finishing at different times"
    if which == "random":
        assert len({tuple(lengths) for lengths in output.acceptance_lengths}) > 1


SLIDING_WINDOW = 6  # prompts and generations below run well past it


def _sliding_window_target(family: str, sliding_window: int = SLIDING_WINDOW):
    overrides = dict(sliding_window=sliding_window)
    if family == "qwen2":
        overrides.update(use_sliding_window=True, max_window_layers=0)  # every layer slides
    return tiny_target(family, dtype=torch.float64, **overrides)  # gemma3: sliding layers between full ones


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_native_sliding_window_target_one_prompt_at_a_time(family):
    """Crops by a negative count roll a sliding window back past its edge; the window is trimmed after every
    round (plain decoding included), and the tokens stay the target's own."""
    target = _sliding_window_target(family)
    oracle = from_target(
        target,
        draft_class=OracleDraft,
        num_hidden_layers=1,
        block_size=4,
        target_layer_ids=[1, 3],
        gru_hidden_dim=8,
        residual_rank=8,
    ).eval()
    full_blocks = DraftingOptions(draft_length="full")  # rejected drafts every round, and no cost measurement
    longest_window = []  # stored slots of the sliding layers before each target forward

    def record(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        lengths = [layer.keys.shape[-2] for layer in cache.layers if layer.is_sliding and layer.is_initialized]
        longest_window.append(max(lengths, default=0))

    handle = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        for prompt in random_prompts(8, seed=7, min_length=2, max_length=9):
            attention_mask = torch.ones_like(prompt)
            expected = target.generate(prompt, attention_mask=attention_mask, max_new_tokens=20, do_sample=False)
            greedy_sequence = target.generate(prompt, attention_mask=attention_mask, max_new_tokens=30, do_sample=False)
            oracle.set_sequences([greedy_sequence[0].tolist()])
            for draft in [None, tiny_draft(target), oracle]:
                longest_window.clear()
                output = speculative_generate(target, draft, prompt, max_new_tokens=20, options=full_blocks)
                assert torch.equal(output.sequences, expected), f"{family}, draft {type(draft).__name__}"
                assert max(longest_window) <= SLIDING_WINDOW - 1, f"sliding layers kept {max(longest_window)} slots"
    finally:
        handle.remove()


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_native_batch_refuses_sliding_window_target(family):
    """Rejected drafts stay in a row's cache as masked holes, and a sliding window counts them once it slides:
    refused, while batched plain decoding (no holes), and drafting under a window too wide to slide, still match
    each prompt decoded alone."""
    prompts = random_prompts(3, seed=8, min_length=2, max_length=9)
    input_ids, attention_mask = left_pad(prompts, pad_token_id=127)
    target = _sliding_window_target(family)
    with pytest.raises(ValueError, match="SlidingWindowLayer cache layers would give wrong tokens.*batch size 1"):
        speculative_generate(target, tiny_draft(target), input_ids, attention_mask, max_new_tokens=12)
    wide_window_target = _sliding_window_target(family, sliding_window=1000)  # > 9 + 12 * (3 drafts + 1) slots
    for windowed, draft in ((target, None), (wide_window_target, tiny_draft(wide_window_target))):
        output = speculative_generate(windowed, draft, input_ids, attention_mask, max_new_tokens=12)
        width = input_ids.shape[1]
        for row, prompt in enumerate(prompts):
            expected = windowed.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False
            )
            num_new = expected.shape[1] - prompt.shape[1]
            assert output.num_new_tokens[row] == num_new, f"row {row}"
            assert torch.equal(output.sequences[row, width : width + num_new], expected[0, prompt.shape[1] :])


def test_native_batch_counts_every_rounds_rejected_drafts_against_the_window():
    """A window wider than prompt + max_new_tokens still slides over the holes once some rows accept whole blocks
    and others none: refused (with the refusal removed, an oracle for row 0 alone gave row 1 wrong tokens here)."""
    prompts = random_prompts(3, seed=8, min_length=2, max_length=9)
    input_ids, attention_mask = left_pad(prompts, pad_token_id=127)
    target = _sliding_window_target("gemma3", sliding_window=24)
    max_new_tokens = 16
    assert input_ids.shape[1] + max_new_tokens < 24
    draft = tiny_draft(target)
    max_slots = input_ids.shape[1] + max_new_tokens * (draft.config.num_draft_tokens + 1)
    with pytest.raises(ValueError, match=f"wider than prompt \\+ max_new_tokens x \\(drafts \\+ 1\\) = {max_slots} "):
        speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=max_new_tokens)


def test_native_batch_refuses_recurrent_target():
    """A linear-attention state has absorbed a row's rejected drafts, and finished rows cannot leave it."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"] * 2,
    )
    target = Qwen3NextForCausalLM(config).eval()
    input_ids, attention_mask = left_pad(random_prompts(2, seed=9, max_length=9), pad_token_id=127)
    with pytest.raises(ValueError, match="LinearAttentionLayer cache layers would give wrong tokens.*batch size 1"):
        speculative_generate(target, tiny_draft(target), input_ids, attention_mask, max_new_tokens=8)
    with pytest.raises(ValueError, match="LinearAttentionLayer cache layers cannot drop the rows.*batch size 1"):
        speculative_generate(target, None, input_ids, attention_mask, max_new_tokens=8)


def test_a_checkpoint_generates_without_the_package_verifying_every_draft(tmp_path):
    """A Hub user loads the checkpoint's own code with only torch and transformers installed: generate still gives
    the target's greedy tokens, and on CPU says once that the cost-aware draft length needs the package."""
    target = tiny_target("qwen3")
    tiny_draft(target).save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    script = (
        "import sys, warnings\n"
        "class NoPackage:\n"  # as if domino_spec were not installed
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'domino_spec':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, NoPackage())\n"
        "import torch\n"
        "from transformers import AutoModel, AutoModelForCausalLM\n"
        "target = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "draft = AutoModel.from_pretrained(sys.argv[2], trust_remote_code=True).eval()\n"
        "for seed in range(4):\n"
        "    generator = torch.Generator().manual_seed(seed)\n"
        "    ids = torch.randint(3, target.config.vocab_size, (1, 5 + seed), generator=generator)\n"
        "    expected = target.generate(ids, max_new_tokens=16, do_sample=False)\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        out = target.generate(ids, assistant_model=draft, max_new_tokens=16, do_sample=False)\n"
        "    print(torch.equal(out, expected), any('domino_spec package' in str(w.message) for w in caught))\n"
        "print('domino_spec' in sys.modules)\n"
    )
    result = run_offline(script, str(tmp_path / "target"), str(tmp_path / "draft"), cwd=tmp_path)
    assert result.stdout.split() == ["True", "True"] * 4 + ["False"], result.stdout + result.stderr[-3000:]
