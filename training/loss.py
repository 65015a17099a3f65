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


def acceptance_length(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance proxy: 1 + the run of leading slots whose argmax is the label, averaged over blocks."""
    hits = (logits.argmax(dim=-1) == labels) & (labels != IGNORE_INDEX)  # [B, N, S]
    return (hits.long().cumprod(dim=-1).sum(dim=-1).float() + 1).mean()


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Position-weighted cross-entropy, normalised per sequence then averaged over the batch.

    Normalising per sequence makes the loss of a batch the mean of its sequences' losses, so gradient
    accumulation over micro-batches of equal size equals one large batch.
    """
    batch_size = logits.shape[0]
    token_loss = F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten().clamp(min=0), reduction="none"
    ).view_as(labels)  # [B, N, S]
    valid = (labels != IGNORE_INDEX).float() * weights
    per_sequence = (token_loss * valid).view(batch_size, -1).sum(-1) / valid.view(batch_size, -1).sum(-1).clamp(min=1e-8)
    return per_sequence.mean()


def domino_loss(
    logits: torch.Tensor,
    base_logits: torch.Tensor,
    labels: torch.Tensor,
    lam: float,
    gamma: float = 7.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`lam * CE(base) + (1 - lam) * CE(final)` over `[B, N, S, V]` logits and `[B, N, S]` labels.

    With the head off (`logits is base_logits`) this is the DFlash loss. Returns the loss and the metrics to log.
    """
    weights = position_weights(labels.shape[-1], gamma, labels.device)
    loss_base = weighted_cross_entropy(base_logits, labels, weights)
    loss_final = loss_base if logits is base_logits else weighted_cross_entropy(logits, labels, weights)
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
