"""Domino: lossless speculative decoding with a parallel block drafter and a causal correction head.

The names below load on first use, so that `domino-spec` can set its OpenMP defaults before torch starts (`cli.py`).
"""

import importlib

# Absolute module names: pytest also imports this file as the top of the test tree, under the checkout folder's name,
# which need not be a Python identifier (a clone into `ci-check`); the installed package resolves either way.
_MODULE_OF = {
    "DominoConfig": "domino_spec.configuration_domino",
    "DominoContextCache": "domino_spec.cache_domino",
    "DominoDraftModel": "domino_spec.modeling_domino",
    "DraftCosts": "domino_spec.drafting",
    "DraftingOptions": "domino_spec.drafting",
}

__all__ = ["DominoConfig", "DominoContextCache", "DominoDraftModel", "DraftCosts", "DraftingOptions"]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'domino_spec' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
