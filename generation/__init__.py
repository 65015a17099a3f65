"""Decoding with a Domino draft: the native batched engine and its sampling helpers."""

from ..targets import left_pad
from .cpu import CPUOptimization, optimize_for_cpu
from .engine import SpeculativeOutput, pooled_position_rates, speculative_generate

__all__ = [
    "CPUOptimization",
    "SpeculativeOutput",
    "left_pad",
    "optimize_for_cpu",
    "pooled_position_rates",
    "speculative_generate",
]
