"""Decoding with a Domino draft: the native batched engine and its sampling helpers."""

from .engine import SpeculativeOutput, left_pad, pooled_position_rates, speculative_generate

__all__ = ["SpeculativeOutput", "left_pad", "pooled_position_rates", "speculative_generate"]
