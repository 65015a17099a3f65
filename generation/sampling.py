"""Small pure functions for speculative decoding: logits warpers, greedy acceptance and rejection sampling.

Tensors in, tensors out; no model, no cache. Shapes: B batch, S drafts per block, V vocabulary.
"""

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from ..drafting import nucleus


class NucleusWarper(LogitsProcessor):
    """transformers' `TopPLogitsWarper` (`drafting.nucleus`), sorting only the likeliest tokens where it can."""

    def __init__(self, top_p: float):
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p!r} is invalid: expected a float in (0, 1].")
        self.top_p = top_p

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        return nucleus(scores, self.top_p)


def build_logits_warpers(
    do_sample: bool, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> LogitsProcessorList:
    """The sampling warpers, in transformers' order (temperature, top-k, top-p); empty for greedy decoding.

    Target and draft share this list, so both sample from the processed distributions that exact speculative
    sampling compares. Neutral settings (temperature 1, top_k None or 0, top_p None or 1) add no warper.
    """
    warpers = LogitsProcessorList()
    if not do_sample:
        return warpers
    if temperature is None or not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is invalid with do_sample=True: expected a float > 0.")
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p != 1.0:
        warpers.append(NucleusWarper(top_p))
    return warpers


def process_logits(warpers: LogitsProcessorList, logits: torch.Tensor) -> torch.Tensor:
    """Apply row-wise warpers to `[..., V]` logits (all positions at once); returns float32 `[..., V]`."""
    logits = logits.float()
    if len(warpers) == 0:
        return logits
    flat = logits.reshape(-1, logits.shape[-1])  # [B * S, V]
    return warpers(None, flat).view_as(logits)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from `[..., V]` probabilities (need not be normalised): `[...]`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, num_samples=1, generator=generator).view(probs.shape[:-1])


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the longest prefix of the drafts equal to the target's argmax, plus the target's token.

    Args:
        draft_tokens: `[B, S]` proposed tokens d_1..d_S (S may be 0).
        target_logits: `[B, S + 1, V]` the target's logits at the anchor and at each draft.
    Returns:
        num_accepted `[B]` (0..S) and next_token `[B]`: the target's argmax after the accepted prefix.
    """
    target_tokens = target_logits.argmax(dim=-1)  # [B, S + 1]
    matches = draft_tokens == target_tokens[:, :-1]  # [B, S]
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (Leviathan et al. 2023, algorithm 1), batched.

    Args:
        draft_tokens: `[B, S]` drafts, d_i sampled from draft_probs[:, i - 1].
        draft_probs: `[B, S, V]` q, the draft's (processed) distributions.
        target_probs: `[B, S + 1, V]` p, the target's (processed) distributions at the anchor and each draft.
    Returns:
        num_accepted `[B]` and next_token `[B]`, so that every committed token is distributed as the target's.
    """
    # q: draft prob, p: target prob. Accept d_i with probability min(1, p(d_i) / q(d_i)), i.e. u * q < p for u
    # uniform in [0, 1): strict, so a token the target rules out (p = 0) is never accepted, not even at u = 0.
    # At the first rejection i, sample from the residual norm(max(0, p_i - q_i)); if all S drafts are accepted,
    # sample the bonus token from p_{S+1}. Together this yields exactly p at every position.
    num_drafts = draft_tokens.shape[1]
    p_draft = target_probs[:, :num_drafts].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, S]
    q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, S]
    uniform = torch.rand(q_draft.shape, generator=generator, device=q_draft.device, dtype=q_draft.dtype)
    accepted = uniform * q_draft < p_draft  # [B, S]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]

    p_next = target_probs.gather(1, num_accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    padded_q = torch.cat([draft_probs, torch.zeros_like(target_probs[:, :1])], dim=1)  # [B, S + 1, V], q = 0 at S+1
    q_next = padded_q.gather(1, num_accepted[:, None, None].expand(-1, 1, padded_q.shape[-1])).squeeze(1)
    residual = (p_next - q_next).clamp(min=0)  # [B, V]; equals p_next for the bonus token
    # p == q leaves no residual mass, but then rejection has probability 0: only rounding can get here.
    empty = residual.sum(dim=-1, keepdim=True) <= torch.finfo(residual.dtype).tiny
    residual = torch.where(empty, p_next, residual)
    return num_accepted, sample(residual, generator)


__all__ = ["build_logits_warpers", "greedy_accept", "process_logits", "rejection_sample", "sample"]
