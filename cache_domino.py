"""The draft's KV cache of the target context: keys and values of the fused target features, per draft layer.

Only context enters it, never block tokens: a drafting round's block is recomputed each round. Copied into every saved
checkpoint with `modeling_domino.py` (`trust_remote_code`): imports only torch.
"""

import torch


class DominoContextCache:
    """Keys and values of the target context for every draft layer: context only, never block tokens.

    `attention_mask` (`[B, T]`, bool) marks the slots that hold committed tokens; it stays `None` while every slot
    does (batch size one, no padding), so attention needs no mask.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # per layer: [B, Hkv, T, Dh]
        self.values: list[torch.Tensor] = []
        self.attention_mask: torch.Tensor | None = None

    def get_seq_length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

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


__all__ = ["DominoContextCache"]
