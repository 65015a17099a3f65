"""Domino: lossless speculative decoding with a parallel block drafter and a causal correction head."""

# Absolute imports: pytest also imports this file as the top of the test tree, under the checkout folder's name,
# which need not be a Python identifier (a clone into `ci-check`); the installed package resolves either way.
from domino_spec.cache_domino import DominoContextCache
from domino_spec.configuration_domino import DominoConfig
from domino_spec.drafting import DraftCosts, DraftingOptions
from domino_spec.modeling_domino import DominoDraftModel

__all__ = ["DominoConfig", "DominoContextCache", "DominoDraftModel", "DraftCosts", "DraftingOptions"]
