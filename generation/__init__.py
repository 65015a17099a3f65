"""Decoding with a Domino draft: the native batched engine and its sampling helpers."""

from .engine import SpeculativeOutput, speculative_generate

__all__ = ["SpeculativeOutput", "speculative_generate"]
