"""`target.generate(assistant_model=draft)` features (stop strings, streamers, return_dict_in_generate), the
generate hook, and the clear errors of both decoding paths."""

import inspect
import io

import pytest
import torch
from transformers import GenerationMixin, PreTrainedTokenizerFast
from transformers.cache_utils import DynamicCache, StaticLayer
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.streamers import BaseStreamer

from domino_spec.generation import left_pad, speculative_generate
from domino_spec.generation.compiled_drafting import compile_drafting, is_drafting_compiled
from domino_spec.generation_domino import StopStringDraftMask, install_generate_hook

from conftest import tiny_draft, tiny_target, word_tokenizer
from speculative_helpers import make_peaked, random_prompts

# transformers 5.17 to 5.24 validate an assistant's vocabulary before building its candidate generator: hooked too.
VALIDATES_ASSISTANTS = (
    "generation_mode_kwargs"
    in inspect.signature(getattr(GenerationMixin, "_validate_generation_mode", lambda: None)).parameters
)
HOOKED_METHODS = ["_get_candidate_generator"] + (["_validate_generation_mode"] if VALIDATES_ASSISTANTS else [])


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen3")
    return target, tiny_draft(target)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer()


class CollectingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


# ---------------------------------------------------------------------------------------------- HF path features


def test_stop_strings_inside_blocks(models, tokenizer):
    target, draft = models
    for index, prompt in enumerate(random_prompts(10, seed=21)):
        continuation = target.generate(prompt, max_new_tokens=16, do_sample=False)[0, prompt.shape[1] :].tolist()
        k = 3 + index % 4
        # A stop string spanning two tokens: the end of token k's text and the start of token k + 1's.
        stop = f"w{continuation[k]:03d}"[2:] + f"w{continuation[k + 1]:03d}"[:2]
        kwargs = dict(max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
        reference = target.generate(prompt, **kwargs)
        assert reference.shape[1] < prompt.shape[1] + 16, "the stop string should end generation early"
        assert torch.equal(target.generate(prompt, assistant_model=draft, **kwargs), reference)


def test_a_prompt_ending_in_a_stop_is_continued_as_plain_decoding_does(models, tokenizer):
    """Plain decoding generates after a prompt that ends in EOS or in a stop string. Transformers 5.17 took the
    prompt's own stop for the candidates' and generated nothing: the prefill's placeholder draft moves the check onto
    a verified token. Both outcomes of the placeholder (EOS) are covered: the target's first token is the prompt's
    last one (accepted), or not."""
    target, draft = models
    accepted = set()
    for index, prompt in enumerate(random_prompts(12, seed=31)):
        continuation = target.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1] :].tolist()
        # Cut where the greedy continuation repeats a token (the next token is then the prompt's last), or after one.
        repeats = [i + 1 for i in range(len(continuation) - 2) if continuation[i] == continuation[i + 1]]
        cut = repeats[0] if repeats and index % 2 == 0 else 1
        prompt = torch.cat([prompt, torch.tensor([continuation[:cut]])], dim=-1)
        last = int(prompt[0, -1])
        accepted.add(continuation[cut] == last)
        for max_new_tokens in (1, 6):
            for stop in (dict(eos_token_id=last), dict(stop_strings=[f"w{last:03d}"], tokenizer=tokenizer)):
                kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, **stop)
                reference = target.generate(prompt, **kwargs)
                assert reference.shape[1] > prompt.shape[1]
                output = target.generate(prompt, assistant_model=draft, **kwargs)
                assert torch.equal(output, reference), (stop, max_new_tokens, prompt.tolist())
    assert accepted == {True, False}


def test_stop_string_completed_by_the_first_draft_while_sampling(tokenizer):
    """Regression: a stop string completed by the first draft leaves no candidates; sampling must not crash."""
    target = make_peaked(tiny_target("qwen3", seed=3))
    draft = tiny_draft(target)
    prompt = torch.tensor([[5, 60, 21, 99, 14, 33, 8, 71]])
    stopped = 0
    for seed in range(12):
        torch.manual_seed(seed)
        output = target.generate(
            prompt, max_new_tokens=12, do_sample=True, stop_strings=["w017"], tokenizer=tokenizer, assistant_model=draft
        )
        generated = output[0, prompt.shape[1] :].tolist()
        assert 17 not in generated[:-1], generated
        stopped += generated[-1] == 17
    assert stopped > 0


def test_stop_string_draft_mask_masks_exactly_the_completing_tokens(tokenizer):
    """Sampled drafts avoid the tokens that would complete a stop string after their context, and only those."""
    mask = StopStringDraftMask(StopStringCriteria(tokenizer, ["7w01"]))
    scores = torch.zeros(2, 128)
    masked = mask(torch.tensor([[5, 17], [5, 18]]), scores)  # contexts ending in `w017` and in `w018`
    assert torch.isneginf(masked[0]).nonzero().flatten().tolist() == list(range(10, 20))  # `w010` .. `w019`
    assert torch.equal(masked[1], scores[1])
    only_completing = torch.full((1, 128), float("-inf"))
    only_completing[0, 12] = 0.0  # e.g. after top-k: every token left completes the stop string
    assert torch.equal(mask(torch.tensor([[5, 17]]), only_completing), only_completing)  # then the block is cut
    # Logits narrower than the tokenizer (tokens added without resizing the model): masked as far as they reach.
    narrow = StopStringDraftMask(StopStringCriteria(tokenizer, ["7w1"]))(torch.tensor([[5, 17]]), torch.zeros(1, 110))
    assert torch.isneginf(narrow[0]).nonzero().flatten().tolist() == list(range(100, 110))  # `w100` .. `w109`


def test_streamer_and_return_dict(models):
    target, draft = models
    prompt = random_prompts(1, seed=5)[0]
    reference = target.generate(
        prompt, max_new_tokens=15, do_sample=False, return_dict_in_generate=True, output_scores=True
    )
    streamer = CollectingStreamer()
    output = target.generate(
        prompt,
        max_new_tokens=15,
        do_sample=False,
        assistant_model=draft,
        streamer=streamer,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert torch.equal(output.sequences, reference.sequences)
    assert len(output.scores) == len(reference.scores) == 15
    for got, expected in zip(output.scores, reference.scores):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert streamer.ended and sum(streamer.chunks, []) == output.sequences[0].tolist()


def test_generate_hook_is_idempotent_and_keeps_other_assistants(models):
    target, _ = models
    hooked = {name: getattr(GenerationMixin, name) for name in HOOKED_METHODS}
    assert all(getattr(method, "_domino_hook", False) for method in hooked.values())
    assert install_generate_hook()
    for name, method in hooked.items():
        assert getattr(GenerationMixin, name) is method
        assert not getattr(method.__wrapped__, "_domino_hook", False), f"the hook must wrap {name} once"
    # An ordinary assistant (no get_candidate_generator) still takes transformers' own assisted decoding.
    assistant = tiny_target("qwen3", seed=9, num_hidden_layers=2)
    prompt = random_prompts(1, seed=6)[0]
    reference = target.generate(prompt, max_new_tokens=10, do_sample=False)
    output = target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=assistant)
    assert torch.equal(output, reference)
    with pytest.raises(ValueError, match="different tokenizers"):  # transformers' own validation, unchanged
        target.generate(prompt, max_new_tokens=10, assistant_model=tiny_target("qwen3", vocab_size=256))


@pytest.mark.skipif(not VALIDATES_ASSISTANTS, reason="this transformers validates no assistant vocabulary")
def test_generate_hook_installs_whichever_hook_is_missing(models):
    """On import, and after a copy of the model file (trust_remote_code) of a version that installed the candidate
    generator's hook only: both hooks end up installed, and another vocabulary gets the draft's own error."""
    _, draft = models
    hooked = {name: getattr(GenerationMixin, name) for name in HOOKED_METHODS}
    other = tiny_target("qwen3", vocab_size=256)
    try:
        for missing in (["_validate_generation_mode"], HOOKED_METHODS):
            for name in missing:
                setattr(GenerationMixin, name, hooked[name].__wrapped__)
            assert install_generate_hook()
            assert all(getattr(getattr(GenerationMixin, name), "_domino_hook", False) for name in HOOKED_METHODS)
            with pytest.raises(ValueError, match=r"vocabulary of 256 rows \(draft expects 128\)"):
                other.generate(random_prompts(1, seed=8)[0], max_new_tokens=5, assistant_model=draft)
    finally:
        for name, method in hooked.items():
            setattr(GenerationMixin, name, method)


def test_a_draft_built_for_another_name_warns_once_per_generate():
    """The validation hook runs the draft's check only where transformers would refuse the assistant: the candidate
    generator's check gives the name warning, once."""
    target = tiny_target("qwen3")
    target.name_or_path = "Qwen/Qwen3-8B"
    draft = tiny_draft(target, target_model_name="Qwen/Qwen3-8B-Base")
    with pytest.warns(UserWarning, match="built for Qwen/Qwen3-8B-Base") as record:
        target.generate(random_prompts(1, seed=8)[0], max_new_tokens=5, assistant_model=draft)
    assert sum("built for" in str(warning.message) for warning in record) == 1


def test_static_cache_where_transformers_can_crop_it(models):
    target, draft = models
    settings = dict(max_new_tokens=24, do_sample=False, cache_implementation="static")
    for prompt in random_prompts(3, seed=11):
        if getattr(StaticLayer, "is_croppable", False):  # transformers 5.24 on
            reference = target.generate(prompt, **settings)
            assert torch.equal(target.generate(prompt, assistant_model=draft, **settings), reference)
        else:  # ours names the setting; older transformers rejects a static cache for assisted decoding first
            with pytest.raises(ValueError, match="cache_implementation='static'|not supported with Static cache"):
                target.generate(prompt, assistant_model=draft, **settings)


# ---------------------------------------------------------------------------------------------- errors


def test_hf_path_errors(models):
    target, draft = models
    prompt = random_prompts(1, seed=8)[0]
    # ours names the setting; before 5.24 transformers rejects every static cache for assisted decoding first
    if getattr(StaticLayer, "is_croppable", False):
        refusal = "cache_implementation='offloaded_static' cannot be cropped"
    else:
        refusal = "not supported with Static cache"
    with pytest.raises(ValueError, match=refusal):
        target.generate(prompt, max_new_tokens=5, assistant_model=draft, cache_implementation="offloaded_static")
    with pytest.raises(ValueError, match="num_return_sequences"):
        target.generate(prompt, max_new_tokens=5, do_sample=True, num_return_sequences=2, assistant_model=draft)
    with pytest.raises(ValueError, match="speculative_generate"):
        input_ids, attention_mask = left_pad(random_prompts(2, seed=9))
        target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, assistant_model=draft)
    other = tiny_target("qwen3", num_hidden_layers=4)
    with pytest.raises(ValueError, match="built for"):
        other.generate(prompt, max_new_tokens=5, assistant_model=draft)
    # Another vocabulary: the draft's own check, not transformers' "different tokenizers" of assistant validation.
    other = tiny_target("qwen3", vocab_size=256)
    with pytest.raises(ValueError, match=r"built for .* vocabulary of 256 rows \(draft expects 128\)"):
        other.generate(prompt, max_new_tokens=5, assistant_model=draft)
    # A cached prompt prefix, with which assisted decoding goes wrong (`cache` is `past_key_values` before 5.2x).
    cache_name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    prefix_cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(prompt[:, :-2], **{cache_name: prefix_cache})
    with pytest.raises(ValueError, match=f"prefilled {cache_name} .* Pass the whole prompt without a cache"):
        target.generate(prompt, max_new_tokens=5, assistant_model=draft, **{cache_name: prefix_cache})
    embeds = target.get_input_embeddings()(prompt)
    with pytest.raises(ValueError, match="needs the prompt as `input_ids` \\(with or without `inputs_embeds`\\)"):
        target.generate(
            inputs_embeds=embeds, attention_mask=torch.ones_like(prompt), max_new_tokens=5, assistant_model=draft
        )


@pytest.mark.parametrize("token", [-1, 128])
def test_a_token_outside_the_vocabulary_is_named_on_both_paths(models, token):
    target, draft = models
    prompt = random_prompts(1, seed=8)[0].clone()
    prompt[0, 2] = token
    message = f"input_ids holds token id {token}, outside the target's vocabulary of 128 tokens \\(ids 0 to 127\\)"
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, draft, prompt)
    with pytest.raises(ValueError, match=message):
        target.generate(prompt, max_new_tokens=5, assistant_model=draft)


def test_a_draft_that_has_drafted_pickles_and_drafts_the_same_after(models):
    target, draft = models
    prompt = random_prompts(1, seed=10)[0]
    expected = target.generate(prompt, max_new_tokens=9, do_sample=False, assistant_model=draft)
    buffer = io.BytesIO()
    torch.save(draft, buffer)  # its derived tensors hold weak references, which do not pickle
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=9, do_sample=False, assistant_model=copy), expected)


def test_a_compiled_draft_pickles_as_an_eager_one():
    """Compiled functions do not pickle: the copy drafts eagerly until `compile_drafting` is called on it."""
    draft = compile_drafting(tiny_draft(tiny_target("qwen3")))  # compiles on first use: nothing compiled here
    buffer = io.BytesIO()
    torch.save(draft, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    assert is_drafting_compiled(draft) and not is_drafting_compiled(copy)
    assert torch.equal(copy.fc.weight, draft.fc.weight)


def test_native_errors(models):
    target, draft = models
    prompt = random_prompts(1, seed=8)[0]
    with pytest.raises(ValueError, match="built for"):
        speculative_generate(tiny_target("llama", hidden_size=32, num_attention_heads=2), draft, prompt)
    with pytest.raises(ValueError, match="left padding"):
        speculative_generate(target, draft, torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 0]] * 2))
    with pytest.raises(ValueError, match="row 1 has no tokens .*: every prompt needs at least one"):  # not "padding"
        speculative_generate(target, draft, torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 1], [0] * 4]))
    with pytest.raises(ValueError, match=r"input_ids must be a \[batch_size, length\] tensor .* got shape \(0, 4\)"):
        speculative_generate(target, draft, torch.ones(0, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, draft, prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, draft, prompt, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="streamer"):
        speculative_generate(target, draft, prompt.expand(2, -1), streamer=CollectingStreamer())


def test_native_streamer_and_statistics(models):
    target, draft = models
    prompt = random_prompts(1, seed=10)[0]
    streamer = CollectingStreamer()
    output = speculative_generate(target, draft, prompt, max_new_tokens=20, streamer=streamer)
    assert streamer.ended and sum(streamer.chunks, []) == output.sequences[0].tolist()
    assert output.num_new_tokens == [20] and sum(output.acceptance_lengths[0]) == 19
    assert output.mean_acceptance_length >= 1.0 and output.num_rounds == len(output.acceptance_lengths[0])
    assert output.position_acceptance_rates.shape == (draft.config.num_draft_tokens,)
    assert output.draft_time > 0 and output.verify_time > 0 and output.total_time >= output.draft_time
