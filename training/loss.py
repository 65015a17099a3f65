"""The Domino training loss: base-anchored curriculum over position-weighted cross-entropies (paper sec. 3.3)."""

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def curriculum_lambda(step: int, total_steps: int, lambda_start: float = 1.0, decay_ratio: float = 1.0) -> float:
    """Weight of the base loss: `lambda_start`, falling linearly to 0 over the first `decay_ratio` of training.

    Keeping the backbone's own loss in charge early stops the correction head from covering for a weak backbone.
    """
    decay_steps = decay_ratio * total_steps
    if decay_steps <= 0:
        return 0.0
    return lambda_start * max(0.0, 1.0 - step / decay_steps)


def position_weights(num_slots: int, gamma: float, device=None) -> torch.Tensor:
    """`exp(-k / gamma)` for slot k: early drafts matter most, since a miss ends the accepted run."""
    return torch.exp(-torch.arange(num_slots, device=device, dtype=torch.float32) / gamma)


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchor_positions: torch.Tensor, num_slots: int):
    """Targets `[B, N, S]` of each block's slots: the token at anchor + s + 1, or IGNORE_INDEX outside the response."""
    length = input_ids.shape[1]
    positions = anchor_positions[:, :, None] + 1 + torch.arange(num_slots, device=input_ids.device)  # [B, N, S]
    inside = positions < length
    clamped = positions.clamp(max=length - 1).flatten(1)
    labels = input_ids.gather(1, clamped).view_as(positions)
    in_response = loss_mask.gather(1, clamped).view_as(positions).bool() & inside
    return labels.masked_fill(~in_response, IGNORE_INDEX)


def block_soft_targets(top_ids: torch.Tensor, top_probs: torch.Tensor, anchor_positions: torch.Tensor, num_slots: int):
    """The target's distribution over each block slot's token, from its top-K at every position `[B, T, K]`: slot s
    predicts the token at anchor + s + 1, which the target's logits at anchor + s score. Returns `[B, N, S, K]` ids
    and probabilities (slots past the sequence read its last position: `block_labels` ignores them)."""
    batch_size, length, k = top_ids.shape
    positions = anchor_positions[:, :, None] + torch.arange(num_slots, device=top_ids.device)  # [B, N, S]
    rows = positions.clamp(max=length - 1).flatten(1)[..., None].expand(-1, -1, k)  # [B, N * S, K]
    shape = (*positions.shape, k)
    return top_ids.gather(1, rows).view(shape), top_probs.gather(1, rows).view(shape)


def acceptance_length(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance proxy: 1 + the run of leading slots whose argmax is the label, averaged over blocks."""
    hits = (logits.argmax(dim=-1) == labels) & (labels != IGNORE_INDEX)  # [B, N, S]
    return (hits.long().cumprod(dim=-1).sum(dim=-1).float() + 1).mean()


def soft_cross_entropy(logits: torch.Tensor, soft_ids: torch.Tensor, soft_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy `[...]` of `logits` `[..., V]` against the distribution that puts `soft_probs` `[..., K]` on the
    tokens `soft_ids` `[..., K]`, renormalised over the ids that are not IGNORE_INDEX (tokens the draft cannot
    propose). A slot with none of them scores 0."""
    probs = soft_probs.float() * (soft_ids != IGNORE_INDEX)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-8)
    log_probs = logits.float().log_softmax(-1).gather(-1, soft_ids.clamp(min=0))
    return -(probs * log_probs).sum(-1)


def weighted_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    soft_targets: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Position-weighted cross-entropy, normalised per sequence then averaged over the batch: against the labels, or
    against `soft_targets` (`[B, N, S, K]` ids and probabilities, `soft_cross_entropy`) in the slots labelled.

    Normalising per sequence makes the loss of a batch the mean of its sequences' losses, so gradient
    accumulation over micro-batches of equal size equals one large batch.
    """
    batch_size = logits.shape[0]
    if soft_targets is None:
        token_loss = F.cross_entropy(
            logits.float().flatten(0, -2), labels.flatten().clamp(min=0), reduction="none"
        ).view_as(labels)  # [B, N, S]
    else:
        token_loss = soft_cross_entropy(logits, *soft_targets)  # [B, N, S]
    valid = (labels != IGNORE_INDEX).float() * weights
    per_sequence = (token_loss * valid).view(batch_size, -1).sum(-1) / valid.view(batch_size, -1).sum(-1).clamp(
        min=1e-8
    )
    return per_sequence.mean()


def domino_loss(
    logits: torch.Tensor,
    base_logits: torch.Tensor,
    labels: torch.Tensor,
    lam: float,
    gamma: float = 7.0,
    soft_targets: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`lam * CE(base) + (1 - lam) * CE(final)` over `[B, N, S, V]` logits and `[B, N, S]` labels (or, where
    labelled, against the target's `soft_targets`: `[B, N, S, K]` draft-vocabulary ids and probabilities).

    With the head off (`logits is base_logits`) this is the DFlash loss. Returns the loss and the metrics to log;
    the acceptance metrics always score the labels (the target's greedy tokens).
    """
    weights = position_weights(labels.shape[-1], gamma, labels.device)
    loss_base = weighted_cross_entropy(base_logits, labels, weights, soft_targets)
    loss_final = loss_base if logits is base_logits else weighted_cross_entropy(logits, labels, weights, soft_targets)
    loss = lam * loss_base + (1.0 - lam) * loss_final
    with torch.no_grad():
        metrics = {
            "loss_base": loss_base.item(),
            "loss_final": loss_final.item(),
            "lam": lam,
            "acceptance_base": acceptance_length(base_logits, labels).item(),
            "acceptance_final": acceptance_length(logits, labels).item(),
        }
    if not math.isfinite(metrics["loss_final"]):
        raise FloatingPointError(f"non-finite Domino loss: {metrics}")
    return loss, metrics
