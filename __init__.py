"""Domino: lossless speculative decoding with a parallel block drafter and a causal correction head."""

from .configuration_domino import DominoConfig
from .modeling_domino import DominoContextCache, DominoDraftModel

__all__ = ["DominoConfig", "DominoContextCache", "DominoDraftModel"]
