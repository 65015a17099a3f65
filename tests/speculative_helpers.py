"""Test-only helpers for speculative decoding: prompts, an oracle draft, a peaked target, exact distributions."""

import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import LogitsProcessorList

from domino_spec import DominoContextCache, DominoDraftModel
from domino_spec.modeling_domino import DominoDraft


def random_prompts(count: int, seed: int, vocab_size: int = 120, min_length: int = 3, max_length: int = 20):
    """`count` random 1-row prompts of varied lengths (token ids below `vocab_size`)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_length, max_length + 1, (count,), generator=generator)
    return [torch.randint(0, vocab_size, (1, int(length)), generator=generator) for length in lengths]


class OracleDraft(DominoDraftModel):
    """A draft whose proposals are the target's own greedy continuation (precomputed), with peaked logits.

    It keeps the real context-cache bookkeeping (`extend_context`), so both decoding paths see a normal draft; only
    the proposals are looked up in `sequences` (full greedy sequences: prompt and continuation), by the anchor's
    position and token. Where none matches, it proposes token 0: lower acceptance, never a wrong output.
    """

    sequences: list[list[int]] = []

    def set_sequences(self, sequences: list[list[int]]) -> None:
        self.sequences = [list(sequence) for sequence in sequences]

    @torch.no_grad()
    def draft_block(
        self,
        anchor_ids,
        anchor_position_ids,
        past_key_values: DominoContextCache,
        embed_tokens,
        lm_head,
        target_hidden=None,
        context_position_ids=None,
        context_mask=None,
        **kwargs,
    ) -> DominoDraft:
        if target_hidden is not None:
            self.extend_context(past_key_values, target_hidden, context_position_ids, context_mask)
        assert past_key_values.get_seq_length() > 0, "the oracle also needs the prompt's features first"
        num_drafts = self.config.num_draft_tokens
        proposals = []
        for token, position in zip(anchor_ids.tolist(), anchor_position_ids.tolist()):
            match = next((s for s in self.sequences if len(s) > position and s[position] == token), [])
            continuation = match[position + 1 : position + 1 + num_drafts]
            proposals.append(continuation + [0] * (num_drafts - len(continuation)))
        tokens = torch.tensor(proposals, dtype=torch.long, device=anchor_ids.device)  # [B, S]
        logits = torch.full((*tokens.shape, self.config.vocab_size), -30.0, device=anchor_ids.device)
        logits.scatter_(-1, tokens[..., None], 30.0)
        return DominoDraft(tokens=tokens, logits=logits, confidence=torch.ones(tokens.shape, device=tokens.device))


@torch.no_grad()
def draft_from_scratch(draft: DominoDraftModel, target, input_ids: torch.Tensor, **kwargs) -> DominoDraft:
    """The draft's block after `input_ids` (`[B, T]`, its last token the anchor) from an empty context cache, with
    the features of one full target forward: what incremental decoding must reproduce round after round."""
    context, device = input_ids.shape[1] - 1, input_ids.device
    features = draft.fuse_target_hidden_states(target(input_ids, output_hidden_states=True).hidden_states)
    return draft.draft_block(
        input_ids[:, -1],
        torch.full((input_ids.shape[0],), context, device=device),
        DominoContextCache(),
        target.get_input_embeddings(),
        target.get_output_embeddings(),
        target_hidden=features[:, :context],
        context_position_ids=torch.arange(context, device=device).expand(input_ids.shape[0], -1),
        **kwargs,
    )


LIVE_TOKENS = [3, 17, 42, 77, 101]


def make_peaked(target: nn.Module, scale: float = 5.0, live_tokens: list[int] = LIVE_TOKENS) -> nn.Module:
    """Concentrate the target's next-token distributions on a few tokens, with context-dependent probabilities.

    The LM head becomes `Linear(scale * W, bias)` with bias 0 on `live_tokens` and -12 elsewhere. The draft shares
    the target's LM head, so its proposals live on the same tokens with different probabilities: acceptance is
    neither 0 nor 1, and the joint distribution of a few tokens has few outcomes (a sampling test with power).
    """
    old = target.get_output_embeddings()
    head = nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight * scale)
        head.bias.fill_(-12.0)
        head.bias[live_tokens] = 0.0
    target.set_output_embeddings(head)
    return target


@torch.no_grad()
def exact_joint_distribution(
    target,
    prompt: torch.Tensor,
    num_tokens: int,
    processors: LogitsProcessorList,
    eos_token_id: int | None = None,
    min_probability: float = 1e-7,
) -> dict[tuple[int, ...], float]:
    """Exact probabilities of the first `num_tokens` sampled tokens after `prompt` (`[1, P]`) under `processors`.

    With `eos_token_id`, a continuation ends at its EOS, as generation does: shorter outcomes. Enumerates
    continuations whose probability is at least `min_probability`; the rest of the mass is left out (callers pool
    it into an "other" outcome).
    """
    finished, frontier = {}, {(): 1.0}
    for _ in range(num_tokens):
        prefixes = list(frontier)
        continuations = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)
        input_ids = torch.cat([prompt.expand(len(prefixes), -1), continuations], dim=-1)
        logits = target(input_ids=input_ids).logits[:, -1].float()
        processed = [processors(input_ids[i : i + 1], logits[i : i + 1])[0] for i in range(len(prefixes))]
        probs = torch.stack(processed).softmax(-1)
        frontier = {
            prefix + (token,): frontier[prefix] * float(probs[i, token])
            for i, prefix in enumerate(prefixes)
            for token in (probs[i] * frontier[prefix] >= min_probability).nonzero().flatten().tolist()
        }
        if eos_token_id is not None:
            finished |= {outcome: p for outcome, p in frontier.items() if outcome[-1] == eos_token_id}
            frontier = {outcome: p for outcome, p in frontier.items() if outcome[-1] != eos_token_id}
        if not frontier:
            break
    return finished | frontier


def first_tokens_distribution(exact: dict[tuple[int, ...], float], num_tokens: int) -> dict[tuple[int, ...], float]:
    """The exact distribution of the outcomes' first `num_tokens` tokens (`outcome[:num_tokens]`)."""
    marginal: dict[tuple[int, ...], float] = {}
    for outcome, probability in exact.items():
        marginal[outcome[:num_tokens]] = marginal.get(outcome[:num_tokens], 0.0) + probability
    return marginal


def until_eos(tokens: list[int], eos_token_id: int) -> tuple[int, ...]:
    """`tokens` up to and including the first EOS: the outcome `exact_joint_distribution` counts."""
    return tuple(tokens[: tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens)


def chi_square_critical(degrees_of_freedom: int, z: float) -> float:
    """Upper quantile of the chi-square distribution (Wilson-Hilferty approximation), `z` standard-normal quantile."""
    k = degrees_of_freedom
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


# alpha = 1e-4: a correct sampler fails a test about once in 10,000 seeds; the statistic is deterministic per seed.
Z_ALPHA = 3.719


def chi_square_statistic(
    samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float], min_expected: float = 5.0
) -> tuple[float, int]:
    """Pearson's chi-square statistic of `samples` against `exact`, pooling outcomes expected fewer than
    `min_expected` times (and unlisted outcomes) into one cell. Returns `(statistic, degrees of freedom)`."""
    total = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    cells = [outcome for outcome, p in exact.items() if p * total >= min_expected]
    pooled_probability = 1.0 - sum(exact[outcome] for outcome in cells)
    pooled_count = total - sum(counts.get(outcome, 0) for outcome in cells)
    statistic = sum(
        (counts.get(outcome, 0) - exact[outcome] * total) ** 2 / (exact[outcome] * total) for outcome in cells
    )
    degrees_of_freedom = len(cells) - 1
    if pooled_probability * total >= 1.0 or pooled_count > 0:
        # An expected count below 1 is rounded up to 1: a few stray samples cost little, thousands fail loudly.
        expected = max(pooled_probability * total, 1.0)
        statistic += (pooled_count - expected) ** 2 / expected
        degrees_of_freedom += 1
    return statistic, degrees_of_freedom


def chi_square_test(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float], min_expected: float = 5.0):
    """Pearson's chi-square goodness of fit of `samples` to `exact` (`chi_square_statistic`). Returns
    `(statistic, critical value at Z_ALPHA)`."""
    statistic, degrees_of_freedom = chi_square_statistic(samples, exact, min_expected)
    return statistic, chi_square_critical(degrees_of_freedom, Z_ALPHA)


def drawn_from_test(tokens: torch.Tensor, logits: torch.Tensor, min_group: int = 50) -> tuple[float, float]:
    """Chi-square test that each drafted token was drawn from the softmax of the logits reported with it: the q that
    exact speculative sampling divides by.

    `tokens` `[N, S]` and `logits` `[N, S, V]` come from N independent drafts of the same context. Rows that drafted
    the same tokens before slot s share slot s's distribution, so per slot the rows are grouped by that prefix and
    each group of at least `min_group` rows is compared with its reported probabilities; the statistics and degrees
    of freedom of all groups add up to one test. Returns `(statistic, critical value at Z_ALPHA)`.
    """
    statistic, degrees_of_freedom = 0.0, 0
    for slot in range(tokens.shape[1]):
        groups: dict[tuple[int, ...], list[int]] = {}
        for row, prefix in enumerate(tokens[:, :slot].tolist()):
            groups.setdefault(tuple(prefix), []).append(row)
        for rows in groups.values():
            if len(rows) < min_group:
                continue
            group_logits = logits[rows, slot].float()  # [G, V]: one distribution, or the rows did not share one
            torch.testing.assert_close(group_logits, group_logits[:1].expand_as(group_logits), atol=1e-4, rtol=0)
            probs = group_logits[0].softmax(-1)
            exact = {(token,): float(probs[token]) for token in probs.nonzero().flatten().tolist()}
            group_statistic, group_freedom = chi_square_statistic([(int(t),) for t in tokens[rows, slot]], exact)
            statistic, degrees_of_freedom = statistic + group_statistic, degrees_of_freedom + group_freedom
    return statistic, chi_square_critical(degrees_of_freedom, Z_ALPHA)


def run_offline(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`script` in a fresh Python process with `args`, the Hub offline; asserts it exited cleanly."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result
