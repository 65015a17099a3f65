"""The pure functions of `generation/sampling.py` on hand-made tensors."""

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from domino_spec.drafting import nucleus
from domino_spec.generation.sampling import build_logits_warpers, greedy_accept, process_logits, rejection_sample


def one_hot_logits(tokens: list[list[int]], vocab_size: int = 6) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab_size).float() * 5.0


def test_greedy_accept_hand_made():
    draft_tokens = torch.tensor([[1, 2, 3], [1, 4, 3], [5, 2, 3], [1, 2, 3]])
    target_logits = one_hot_logits([[1, 2, 3, 0], [1, 2, 3, 0], [1, 2, 3, 0], [1, 2, 4, 0]])
    num_accepted, next_token = greedy_accept(draft_tokens, target_logits)
    assert num_accepted.tolist() == [3, 1, 0, 2]
    assert next_token.tolist() == [0, 2, 1, 4]  # the bonus token, then the target's token at the first mismatch
    # No drafts (plain decoding): the target's argmax at the anchor.
    num_accepted, next_token = greedy_accept(torch.zeros(2, 0, dtype=torch.long), one_hot_logits([[3], [5]]))
    assert num_accepted.tolist() == [0, 0] and next_token.tolist() == [3, 5]


def test_rejection_sample_is_exact_on_hand_made_distributions():
    """Committed tokens follow p exactly: the first one for any q, the second given the first was accepted."""
    generator = torch.Generator().manual_seed(0)
    rows = 200_000
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]])  # [S + 1, V]
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]])  # [S, V]
    draft_tokens = torch.multinomial(q, rows, replacement=True, generator=generator).T  # [B, S]
    num_accepted, next_token = rejection_sample(
        draft_tokens, q.expand(rows, -1, -1), p.expand(rows, -1, -1), generator=generator
    )
    first = torch.where(num_accepted > 0, draft_tokens[:, 0], next_token)
    frequencies = torch.bincount(first, minlength=4).double() / rows
    torch.testing.assert_close(frequencies, p[0].double(), atol=0.005, rtol=0)  # 5 sigma: sqrt(.25 / 2e5) = 0.0011
    # Acceptance probability of the first draft: sum_x min(p, q) = 0.1 + 0.2 + 0.2 + 0 = 0.5.
    assert abs(float((num_accepted > 0).double().mean()) - 0.5) < 0.005
    second_rows = num_accepted > 0
    second = torch.where(num_accepted[second_rows] > 1, draft_tokens[second_rows, 1], next_token[second_rows])
    frequencies = torch.bincount(second, minlength=4).double() / int(second_rows.sum())
    torch.testing.assert_close(frequencies, p[1].double(), atol=0.007, rtol=0)
    # All drafts accepted: the bonus token comes from p at S + 1.
    bonus = next_token[num_accepted == 2]
    frequencies = torch.bincount(bonus, minlength=4).double() / bonus.numel()
    torch.testing.assert_close(frequencies, p[2].double(), atol=0.02, rtol=0)


def test_rejection_sample_never_commits_a_token_the_target_excludes():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])  # [1, S + 1, V]
    q = torch.tensor([[[0.5, 0.5, 0.0]]])
    for seed in range(50):
        generator = torch.Generator().manual_seed(seed)
        draft_token = torch.multinomial(q[0], 1, generator=generator)  # [1, 1]
        num_accepted, next_token = rejection_sample(draft_token, q, p, generator)
        committed = draft_token[0, : int(num_accepted)].tolist() + next_token.tolist()
        assert committed in ([1, 2], [1]), committed


def test_rejection_sample_rejects_a_token_the_target_excludes_even_at_a_zero_uniform_draw(monkeypatch):
    """`torch.rand` draws from [0, 1): at u = 0, a non-strict `u * q <= p` would accept a token with p = 0."""

    def zeros(size, generator=None, device=None, dtype=None):
        return torch.zeros(size, device=device, dtype=dtype)

    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])  # [1, S + 1, V]
    q = torch.tensor([[[0.5, 0.5, 0.0]]])
    monkeypatch.setattr(torch, "rand", zeros)
    num_accepted, next_token = rejection_sample(torch.tensor([[0]]), q, p)  # token 0: q = 0.5, p = 0
    assert num_accepted.tolist() == [0] and next_token.tolist() == [1]
    num_accepted, next_token = rejection_sample(torch.tensor([[1]]), q, p)  # token 1: p = 1, accepted
    assert num_accepted.tolist() == [1] and next_token.tolist() == [2]


def test_rejection_sample_identical_distributions_accept_everything():
    p = torch.softmax(torch.randn(8, 4, 10), -1)
    generator = torch.Generator().manual_seed(1)
    draft_tokens = torch.multinomial(p[:, :3].reshape(-1, 10), 1, generator=generator).view(8, 3)
    num_accepted, _ = rejection_sample(draft_tokens, p[:, :3], p, generator)
    assert num_accepted.tolist() == [3] * 8


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_the_nucleus_sorts_only_the_likeliest_tokens_yet_keeps_what_transformers_keeps(top_p):
    generator = torch.Generator().manual_seed(0)
    peaked = torch.randn(3, 5000, generator=generator) * 6  # a nucleus of a few tokens
    flat = torch.randn(3, 5000, generator=generator) * 0.1  # a nucleus of thousands: past the sorted candidates
    cut = TopKLogitsWarper(40)(None, torch.randn(2, 5000, generator=generator))  # -inf outside 40 tokens
    logits = torch.cat([peaked, flat, cut])
    expected = TopPLogitsWarper(top_p)(None, logits)
    assert torch.equal(nucleus(logits, top_p).isinf(), expected.isinf())
    assert torch.equal(process_logits(build_logits_warpers(True, top_p=top_p), logits), expected)


def test_build_logits_warpers_match_transformers():
    assert len(build_logits_warpers(do_sample=False, temperature=0.5, top_k=3)) == 0
    assert len(build_logits_warpers(do_sample=True)) == 0  # neutral settings add nothing
    warpers = build_logits_warpers(do_sample=True, temperature=0.7, top_k=5, top_p=0.8)
    reference = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.8)])
    logits = torch.randn(2, 3, 50)
    expected = torch.stack([reference(None, logits[:, i]) for i in range(3)], dim=1)
    torch.testing.assert_close(process_logits(warpers, logits), expected)
    with pytest.raises(ValueError, match="temperature"):
        build_logits_warpers(do_sample=True, temperature=0.0)
