"""Where the transformers releases Domino supports (5.17 to 5.24, as `setup.cfg` admits) differ, in one place.

- 5.24 renamed the forward's cache argument `past_key_values` to `cache` (the old name warns).
- 5.24 made the static cache croppable (`StaticLayer.is_croppable`); before, only the dynamic cache can drop
  rejected drafts.
- 5.18 made `crop(n)` with a positive absolute length raise: crop by a negative count, which every release reads as
  "drop that many".
- The sliding-window layers of newer releases keep a window only; `activate_past_recording` (where it exists) lets
  a verify pass's rejected tokens be cropped back.
- Releases that take `output_hidden_states` as a list of indices (`output_capturing.selected_hidden_states`) keep
  only the tapped layers' hidden states; the others keep every layer's (`tapped_hidden_states`).
- 5.17 judges a prompt's own stop (EOS or a stop string) as the candidates' stop in assisted decoding, and its
  `CandidateGenerator.update_candidate_strategy` raises unless overridden; `generation_domino.py` works on all.

Copied into every saved checkpoint with `modeling_domino.py` (`trust_remote_code`): imports only torch and
transformers.
"""

import inspect

from transformers.cache_utils import DynamicCache, StaticLayer
from transformers.utils import output_capturing

CACHE_KEYWORDS = ("cache", "past_key_values")  # the forward's cache argument, newest name first


def cache_keyword(model) -> str:
    """The name `model.forward` takes its KV cache by. A PEFT-wrapped model forwards `**kwargs` to the model it
    wraps: that one's signature decides."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return next(
        (name for name in CACHE_KEYWORDS if name in inspect.signature(model.forward).parameters), CACHE_KEYWORDS[-1]
    )


def takes_argument(model, name: str) -> bool:
    """Whether `model.forward` (or the model a PEFT wrapper wraps) has an argument `name`."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return name in inspect.signature(model.forward).parameters


def passed_cache(model_kwargs: dict):
    """The cache `generate` was given, under either name, or None."""
    return next((model_kwargs[name] for name in CACHE_KEYWORDS if model_kwargs.get(name) is not None), None)


def croppable_cache(cache_implementation: str | None) -> bool:
    """Whether transformers' cache of `generation_config.cache_implementation` can drop rejected drafts."""
    if cache_implementation in (None, "dynamic"):
        return True
    return cache_implementation == "static" and getattr(StaticLayer, "is_croppable", False)


def new_dynamic_cache(config) -> DynamicCache:
    """A `DynamicCache` whose sliding-window layers can be cropped back after a verify pass."""
    cache = DynamicCache(config=config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def tapped_hidden_states(layer_ids: list[int]) -> bool | list[int]:
    """The `output_hidden_states` that returns the outputs of layers `layer_ids` as `hidden_states[i + 1]`: those
    alone (the others `None`) where the release selects by index, else every layer's. Keeping 31 layers' states of
    a batched prefill alive costs a CPU as much as a tenth of the prefill."""
    if hasattr(output_capturing, "selected_hidden_states"):
        return [i + 1 for i in layer_ids]
    return True


__all__ = [
    "cache_keyword",
    "croppable_cache",
    "new_dynamic_cache",
    "passed_cache",
    "takes_argument",
    "tapped_hidden_states",
]
