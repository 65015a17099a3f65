"""The draft's KV cache of the target context: keys and values of the fused target features, per draft layer.

Only context enters it, never block tokens: a drafting round's block is recomputed each round. Copied into every saved
checkpoint with `modeling_domino.py` (`trust_remote_code`): imports only torch.
"""

import torch


class DominoContextCache:
    """Keys and values of the target context for every draft layer: context only, never block tokens.

    `attention_mask` (`[B, T]`, bool) marks the slots that hold committed tokens; it stays `None` while every slot
    does (batch size one, no padding), so attention needs no mask. Context of rounds that do not draft waits
    unprojected (`defer`) until the next round that does, which projects it all at once.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # per layer: [B, Hkv, T, Dh]
        self.values: list[torch.Tensor] = []
        self.attention_mask: torch.Tensor | None = None
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []  # (features, positions, mask)

    def get_seq_length(self) -> int:
        """Context slots held, projected or pending."""
        projected = self.keys[0].shape[-2] if self.keys else 0
        return projected + sum(features.shape[1] for features, _, _ in self.pending)

    def defer(self, features: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Hold target features `[B, T_new, F]`, their positions and mask until the next `take_pending`."""
        self.pending.append((features, position_ids, attention_mask))

    def take_pending(self, features: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """The pending context followed by `features`, `position_ids` and `attention_mask`, concatenated; none pending
        after."""
        if not self.pending:
            return features, position_ids, attention_mask
        parts = [*self.pending, (features, position_ids, attention_mask)]
        self.pending = []
        mask = None
        if any(part_mask is not None for _, _, part_mask in parts):
            mask = torch.cat(
                [
                    torch.ones(part.shape[:2], dtype=torch.bool, device=part.device)
                    if part_mask is None
                    else part_mask.bool()
                    for part, _, part_mask in parts
                ],
                dim=1,
            )
        return torch.cat([part for part, _, _ in parts], 1), torch.cat([pos for _, pos, _ in parts], 1), mask

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if layer_idx == len(self.keys):
            self.keys.append(keys)
            self.values.append(values)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=-2)

    def append_mask(self, previous_length: int, new_mask: torch.Tensor | None, batch_size: int) -> None:
        """Extend the slot mask by `new_mask` (`[B, T_new]`, `None` means all valid)."""
        if new_mask is None or bool(new_mask.all()):
            if self.attention_mask is not None:
                ones = self.attention_mask.new_ones(batch_size, self.get_seq_length() - previous_length)
                self.attention_mask = torch.cat([self.attention_mask, ones], dim=-1)
            return
        if self.attention_mask is None:
            self.attention_mask = new_mask.new_ones(batch_size, previous_length, dtype=torch.bool)
        self.attention_mask = torch.cat([self.attention_mask, new_mask.bool()], dim=-1)

    def crop(self, max_length: int) -> None:
        """A negative `max_length` drops that many slots from the end, as transformers' cache `crop` does, and 0 drops
        none (so `crop(-num_rejected)` is always right); a positive one keeps the first `max_length` slots
        (transformers' older `crop(max_length)`)."""
        if self.pending:
            raise ValueError("crop drops projected context: project the pending context first (extend_context).")
        if max_length <= 0:
            max_length = max(self.get_seq_length() + max_length, 0)
        if max_length >= self.get_seq_length():
            return
        self.keys = [k[..., :max_length, :] for k in self.keys]
        self.values = [v[..., :max_length, :] for v in self.values]
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[:, :max_length]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (drop finished sequences)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[rows]
        self.pending = [(f[rows], p[rows], None if m is None else m[rows]) for f, p, m in self.pending]


__all__ = ["DominoContextCache"]
