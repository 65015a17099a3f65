"""Decoding with a Domino draft: the native batched engine and its sampling helpers."""

from ..targets import left_pad
from .compiled_drafting import compile_drafting
from .cpu import CPUOptimization, optimize_for_cpu
from .engine import SpeculativeOutput, pooled_position_rates, speculative_generate
from .fused_head_step import fuse_head_step

__all__ = [
    "CPUOptimization",
    "SpeculativeOutput",
    "compile_drafting",
    "fuse_head_step",
    "left_pad",
    "optimize_for_cpu",
    "pooled_position_rates",
    "speculative_generate",
]
