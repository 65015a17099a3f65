"""`target.generate(..., assistant_model=draft)`: the candidate generator and the generate hooks it needs.

Transformers' assisted decoding calls a candidate generator whose class sets `requires_model_outputs = True` with the
target's last output, and merges `model_kwargs_overrides` into the verify forward: the target's hidden states reach
the draft at no extra target cost. `generate` has no hook for an assistant to supply its own generator, so
`install_generate_hook` wraps the private `GenerationMixin._get_candidate_generator` once (guarded and duck-typed:
an assistant with a `get_candidate_generator` method supplies one; others are untouched).

Copied into every saved checkpoint with `modeling_domino.py` (`trust_remote_code`): imports only torch and
transformers, and the package's cost-aware draft length where the package is installed.
"""

import functools
import inspect
import itertools
import warnings

import torch
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

from .cache_domino import DominoContextCache
from .configuration_domino import check_input_ids
from .drafting import DeviceClock, DraftSampling, certain_logits, draft_round
from .transformers_compat import croppable_cache, passed_cache

try:  # transformers loads a checkpoint's code without this import, which is inside a try block
    from domino_spec.cost_aware import cost_aware_drafting
except ImportError:
    cost_aware_drafting = None


def candidate_generator(
    draft,
    target: PreTrainedModel,
    generation_config,
    input_ids: torch.LongTensor,
    logits_processor=None,
    model_kwargs: dict | None = None,
    tokenizer=None,
) -> "DominoCandidateGenerator":
    """The candidate generator of `target.generate(..., assistant_model=draft)`, after checking what `generate` was
    given: the draft's target, one prompt, no prefilled cache, a cache that can drop rejected drafts."""
    draft.check_target(target)
    if input_ids.shape[1] == 0:
        raise ValueError(
            "target.generate(assistant_model=draft) needs the prompt as `input_ids` (with or without "
            "`inputs_embeds`): the draft drafts from the target's features of the prompt's tokens."
        )
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"target.generate(assistant_model=draft) decodes one sequence at a time (got batch size "
            f"{input_ids.shape[0]}): transformers' assisted decoding is batch-1 only. For batches use "
            "`domino_spec.generation.speculative_generate(target, draft, input_ids, attention_mask=...)`."
        )
    check_input_ids(input_ids, draft.config.vocab_size)
    cache = passed_cache(model_kwargs or {})
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            "target.generate(assistant_model=draft) with a prefilled cache (a cached prompt prefix) is not supported: "
            "transformers' assisted decoding then gives wrong tokens, with any assistant, and the draft needs the "
            "target's features of the whole prompt. Pass the whole prompt without a cache."
        )
    if not croppable_cache(generation_config.cache_implementation):
        raise ValueError(
            f"Domino speculative decoding needs a cache it can crop after each verification; "
            f"cache_implementation={generation_config.cache_implementation!r} cannot be cropped here. Leave "
            "cache_implementation unset (dynamic cache), or use 'static' where transformers' static cache can be "
            "cropped (transformers_compat.croppable_cache)."
        )
    return DominoCandidateGenerator(draft, target, generation_config, logits_processor, tokenizer)


class DominoCandidateGenerator(CandidateGenerator):
    """Block candidates for transformers' assisted decoding, on its `requires_model_outputs` protocol.

    The target's verify forward returns all hidden states (`model_kwargs_overrides`), so the draft reads the
    features of the tokens just accepted with no extra target pass. Drafts are drawn from the same logits
    processors as the target and their logits returned, so transformers applies exact speculative sampling. With a
    cost-aware draft length (`draft.drafting_options`), only the drafts worth a longer verify pass are proposed.
    """

    requires_model_outputs = True
    model_kwargs_overrides = {"output_hidden_states": True}

    def __init__(self, draft, target, generation_config, logits_processor=None, tokenizer=None):
        self.draft = draft
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.cache = DominoContextCache()
        self.options = draft.drafting_options
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor else None
        self.max_length = generation_config.max_length
        eos = generation_config.eos_token_id
        self.eos_token_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.stop_strings = None
        # Sampled drafts are drawn from the draft's own distribution with the run's temperature, top-k and top-p
        # (`DraftSampling`): the target's processors shape p only, and speculative sampling stays exact for any q.
        self.sampling = None
        if self.do_sample:
            config = generation_config
            self.sampling = DraftSampling(config.temperature or 1.0, config.top_k, config.top_p)
        if generation_config.stop_strings:
            if tokenizer is None:
                raise ValueError("stop_strings need the tokenizer: call generate(..., tokenizer=tokenizer).")
            self.stop_strings = StopStringCriteria(tokenizer, generation_config.stop_strings)
            if self.do_sample:  # each slot then needs the processors with the drafts so far (`StopStringDraftMask`)
                mask = StopStringDraftMask(self.stop_strings)
                self.logits_processor = LogitsProcessorList([*(self.logits_processor or []), mask])
                self.sampling = None
        self.drafting = None
        if cost_aware_drafting is not None:
            self.drafting = cost_aware_drafting(target, draft, self.options, do_sample=self.do_sample)
        elif self.options.cost_aware(target.device):
            warnings.warn(
                "Domino verifies every draft here: the cost-aware draft length (the default on CPU, where a longer "
                "verify pass costs more) comes with the domino_spec package. Install it to verify only the drafts "
                "that pay.",
                stacklevel=2,
            )
        self.clock = DeviceClock(draft.device)
        self.verify_start: float | None = None  # when the last candidates went to the target

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a round proposes: a block's drafts. (transformers asks it to size what a cache with
        recurrent layers records for rolling back rejected tokens.)"""
        return self.draft.config.num_draft_tokens

    def get_candidates(
        self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, n_last_matches=0, **kwargs
    ):
        # The prefill is the target's own first step: it yields the prompt's features and the first anchor.
        if is_first_iteration:
            return self._prefill_candidates(input_ids)
        num_candidates = min(self.draft.config.num_draft_tokens, self.max_length - input_ids.shape[1] - 1)
        if num_candidates <= 0:
            return input_ids, None
        if model_outputs is None or model_outputs.hidden_states is None:
            raise ValueError("Domino drafting needs the target's hidden states from its last forward.")

        device = self.draft.device
        cached = self.cache.get_seq_length()
        num_new = input_ids.shape[1] - 1 - cached  # committed tokens (before the anchor) not yet in the cache
        target_hidden = self.draft.fuse_target_hidden_states(model_outputs.hidden_states)[:, :num_new]
        attention_mask = (model_kwargs or {}).get("attention_mask")
        if attention_mask is not None:
            attention_mask = attention_mask[:, : input_ids.shape[1]].to(device)
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            context_mask = attention_mask[:, cached:-1]
        else:
            positions = torch.arange(input_ids.shape[1], device=device)[None]
            context_mask = None
        drafted = draft_round(
            self.draft,
            self.drafting,
            self.cache,
            (target_hidden.to(device), positions[:, cached:-1], context_mask),
            anchor_ids=input_ids[:, -1].to(device),
            anchor_position_ids=positions[:, -1],
            sequences=lambda: [input_ids[0]],
            limit=num_candidates,
            embed_tokens=self.embed_tokens,
            lm_head=self.lm_head,
            do_sample=self.do_sample,
            sampling=self.sampling,
            logits_processor=self.logits_processor,
            prefix_ids=input_ids.to(device),
            options=self.options,
        )
        candidates = self._candidates(input_ids, drafted.tokens, drafted.logits, drafted.tokens.shape[1])
        self.verify_start = self.clock()
        return candidates

    def _candidates(self, input_ids, tokens, logits, num_candidates: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt with the first `num_candidates` of `tokens` `[1, S]` appended, cut at a stop, and their logits."""
        num_candidates = self._cut_at_stop(input_ids, tokens, num_candidates)
        if num_candidates == 0 or logits is None:
            # No candidates: return no logits either, transformers' speculative sampling cannot take an empty block.
            return torch.cat([input_ids, tokens[:, :num_candidates].to(input_ids.device)], dim=-1), None
        tokens = tokens[:, :num_candidates].to(input_ids.device)
        return torch.cat([input_ids, tokens], dim=-1), logits[:, :num_candidates].to(input_ids.device)

    def _prefill_candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No drafts before the target has run, except a placeholder where the prompt itself ends in a stop.

        Some releases check the stopping criteria on the candidates' last token (`transformers_compat`): with none
        that is the prompt's, and a prompt ending in EOS (or a stop string) then got no new token. The placeholder is a
        token that completes no stop string (EOS where there is one: every release cuts after it), with all of the
        draft's probability; the target verifies it like any draft (greedy matching, or rejection sampling against a
        one-hot q), so the output stays exact on every release.
        """
        ends_in_stop = int(input_ids[0, -1]) in self.eos_token_ids
        if self.stop_strings is not None:
            ends_in_stop = ends_in_stop or bool(self.stop_strings(input_ids, None).any())
        if not ends_in_stop:
            return input_ids, None
        vocab_size = self.lm_head.weight.shape[0]
        for token in itertools.chain(sorted(self.eos_token_ids), range(vocab_size)):  # EOS first, usually the one
            placeholder = torch.full_like(input_ids[:, -1:], token)  # [1, 1]
            if self._cut_at_stop(input_ids, placeholder, 1) == 1:
                break
        return torch.cat([input_ids, placeholder], dim=-1), certain_logits(placeholder, vocab_size)

    def update_candidate_strategy(self, input_ids, scores, num_matches) -> None:
        """The draft length follows the draft's confidence; looked-up tokens, verified or passed over, learn from the
        tokens the round committed (`input_ids`' last). `scores` `[1, candidates + 1, V]`: the target's logits."""
        if self.drafting is not None:
            seconds = self.clock() - self.verify_start if self.verify_start is not None else None
            committed = input_ids[:, -int(num_matches) - 1 :]
            self.drafting.accepted(scores.shape[1] - 1, [int(num_matches)], seconds, committed)
        self.verify_start = None

    def _cut_at_stop(self, input_ids: torch.Tensor, tokens: torch.Tensor, num_candidates: int) -> int:
        """Stop proposing after an EOS draft, and before a draft that would complete a stop string.

        Transformers checks stop strings only at the end of the sequence; ending the candidates just before the
        completing token makes the target's own token land there, so generation stops exactly where plain decoding
        does. Sampled drafts avoid such tokens (`StopStringDraftMask`): a cut that depended on the sampled value
        would bias sampling. Where they cannot, the cut happens whatever the draft, and sampling stays exact.
        """
        for index in range(num_candidates):
            token = int(tokens[0, index])
            if self.stop_strings is not None:
                sequence = torch.cat([input_ids, tokens[:, : index + 1].to(input_ids.device)], dim=-1)
                if bool(self.stop_strings(sequence, None).any()):
                    return index
            if token in self.eos_token_ids:
                return index + 1
        return num_candidates


class StopStringDraftMask:
    """A logits processor for sampled drafts: tokens that would complete a stop string get -inf.

    Speculative sampling corrects any draft distribution exactly, so the target still produces such a token where
    its own distribution says so, as its next token, and generation stops there. A row where every token would
    complete a stop string is left as it is: the block is then cut there whatever the draft (`_cut_at_stop`).
    """

    def __init__(self, stop_strings: StopStringCriteria):
        self.stop_strings = stop_strings
        # Per token, the lengths of the stop strings' ends it can hold; -1 pads. A token holding none ends no match.
        first_end_column = stop_strings.max_valid_positions * stop_strings.num_stop_strings
        end_lengths = stop_strings.embedding_vec[:, first_end_column:-1]
        self.final_tokens = (end_lengths > 0).any(dim=-1).nonzero().flatten()  # [F]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tokens = self.final_tokens[self.final_tokens < scores.shape[-1]].to(input_ids.device)
        if tokens.numel() == 0:
            return scores
        tail = input_ids[:, -self.stop_strings.maximum_token_len :]  # a match spans at most this many tokens
        masked = scores.clone()
        for row in range(input_ids.shape[0]):
            continued = torch.cat([tail[row].expand(len(tokens), -1), tokens[:, None]], dim=-1)  # [F, T + 1]
            completing = tokens[self.stop_strings(continued, None)].to(scores.device)
            masked[row, completing] = float("-inf")
            if bool(torch.isneginf(masked[row]).all()):
                masked[row] = scores[row]
        return masked


# ---------------------------------------------------------------------- generate(assistant_model=draft) hooks

_HOOK_PARAMETERS = ("generation_config", "input_ids", "logits_processor", "model_kwargs", "assistant_model")


def install_generate_hook() -> bool:
    """Let an assistant model supply its own candidate generator in `GenerationMixin.generate`.

    Wraps the private `_get_candidate_generator` once: when the assistant has a `get_candidate_generator` method,
    that is used; otherwise nothing changes. If the private signature is not the expected one, warn once and leave
    generate untouched. Returns whether the hook is installed.
    """
    original = GenerationMixin._get_candidate_generator
    if getattr(original, "_domino_hook", False):
        _install_validation_hook()  # a copy of this file (trust_remote_code) may have installed the first hook only
        return True
    parameters = inspect.signature(original).parameters
    if not all(name in parameters for name in _HOOK_PARAMETERS):
        warnings.warn(
            "domino: transformers' GenerationMixin._get_candidate_generator has an unexpected signature; "
            "generate(assistant_model=draft) will not use Domino drafting. Use "
            "domino_spec.generation.speculative_generate instead.",
            stacklevel=2,
        )
        return False

    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        bound = inspect.signature(original).bind(self, *args, **kwargs)
        arguments = bound.arguments
        factory = getattr(arguments.get("assistant_model"), "get_candidate_generator", None)
        if factory is None:
            return original(self, *args, **kwargs)
        return factory(
            target=self,
            generation_config=arguments["generation_config"],
            input_ids=arguments["input_ids"],
            logits_processor=arguments["logits_processor"],
            model_kwargs=arguments["model_kwargs"],
            tokenizer=arguments.get("target_tokenizer"),
        )

    _get_candidate_generator._domino_hook = True
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    _install_validation_hook()
    return True


def _install_validation_hook() -> None:
    """Run the assistant's own `check_target` before transformers rejects an assistant of another vocabulary.

    `generate` validates assistants (`_validate_generation_mode`) before building the candidate generator, and takes
    another vocabulary size for another tokenizer ("universal assisted decoding"). A Domino draft drafts with the
    target's own embeddings and LM head, so its `check_target` names the real mismatch. It runs only where
    transformers would raise, so a draft's name warning is not given twice. Other assistants, and releases without
    this method, are left as they are.
    """
    original = getattr(GenerationMixin, "_validate_generation_mode", None)
    if original is None or getattr(original, "_domino_hook", False):
        return
    signature = inspect.signature(original)
    if "generation_mode_kwargs" not in signature.parameters:
        return

    @functools.wraps(original)
    def _validate_generation_mode(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        assistant = (arguments.get("generation_mode_kwargs") or {}).get("assistant_model")
        check_target = getattr(assistant, "check_target", None)
        if callable(check_target) and hasattr(assistant, "get_candidate_generator"):
            target_vocab_size = self.config.get_text_config().vocab_size
            if target_vocab_size != assistant.config.get_text_config().vocab_size:
                check_target(self)
        return original(self, *args, **kwargs)

    _validate_generation_mode._domino_hook = True
    GenerationMixin._validate_generation_mode = _validate_generation_mode


install_generate_hook()

__all__ = ["DominoCandidateGenerator", "StopStringDraftMask", "candidate_generator", "install_generate_hook"]
