"""Batches for DominoTrainer: right-padded sequences plus the anchors of the blocks to train."""

import hashlib
from dataclasses import dataclass

import torch

from .features import FeatureStore


def seeded_generator(seed: int, *keys: int | torch.Tensor) -> torch.Generator:
    """A generator fixed by `seed` and `keys` (numbers, tensors): the same keys draw the same numbers in any process
    or DataLoader worker, whatever was drawn before."""
    digest = hashlib.sha256(b"".join(torch.as_tensor(key).cpu().numpy().tobytes() for key in keys)).digest()
    return torch.Generator().manual_seed(seed ^ int.from_bytes(digest[:7], "little"))


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | list[torch.Generator] | None = None
) -> torch.Tensor:
    """`num_anchors` anchor positions `[B, N]` inside each response, drawn with `generator`: one for the batch, or
    one per row (a row's anchors then do not depend on the rows batched with it, only on N).

    An anchor is a response token followed by a response token: at inference the first anchor is the target's
    first response token (its prefill output), so the prompt's last token never anchors a block. Positions are
    drawn without replacement while a response has enough of them, else with replacement (blocks may overlap).
    N is at most the most positions a response of the batch has: beyond, every row would only repeat blocks, at
    the memory cost of their logits (N x block x vocabulary per row).
    """
    batch_size = loss_mask.shape[0]
    candidates = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidates[:, :-1] = loss_mask[:, 1:].bool() & loss_mask[:, :-1].bool()
    num_anchors = max(1, min(num_anchors, int(candidates.sum(-1).max())))
    anchors = torch.zeros(batch_size, num_anchors, dtype=torch.long)
    generators = generator if isinstance(generator, list) else [generator] * batch_size
    for row, row_generator in enumerate(generators):
        positions = candidates[row].nonzero().flatten()
        if positions.numel() == 0:
            raise ValueError(f"sequence {row} has no response position to anchor a block (response too short)")
        replace = positions.numel() < num_anchors
        weights = torch.ones(positions.numel())
        picks = torch.multinomial(weights, num_anchors, replacement=replace, generator=row_generator)
        anchors[row] = positions[picks].sort().values
    return anchors


@dataclass
class DominoDataCollator:
    """Pads `input_ids`/`loss_mask` examples on the right and samples `num_anchors` anchors per sequence (unless
    `draw_anchors` is False: `DominoTrainer.training_step` draws the anchors it trains on).

    With a `feature_store`, each example's precomputed target features (looked up by its `index`) come along as
    `target_hidden`, and with `soft_targets` its stored soft targets of that many tokens as `target_top_ids` and
    `target_top_probs`, so the trainer skips the target pass. Examples without an `index` (held-out data, which the
    store does not hold) come without: the trainer computes theirs. `DominoTrainer` sets `num_anchors`,
    `anchor_seed`, `draw_anchors` and `soft_targets` from its arguments.
    """

    pad_token_id: int
    num_anchors: int = 256
    feature_store: FeatureStore | None = None
    soft_targets: int = 0
    anchor_seed: int | None = None  # None: anchors from torch's global generator; else fixed by the seed and batch
    draw_anchors: bool = True  # False: batches without `anchor_positions`

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(example["input_ids"]) for example in examples)
        input_ids = torch.full((len(examples), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
        loss_mask = torch.zeros((len(examples), length), dtype=torch.long)
        for row, example in enumerate(examples):
            size = len(example["input_ids"])
            input_ids[row, :size] = torch.as_tensor(example["input_ids"])
            attention_mask[row, :size] = 1
            loss_mask[row, :size] = torch.as_tensor(example["loss_mask"])
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
        if self.draw_anchors:
            batch["anchor_positions"] = sample_anchors(loss_mask, self.num_anchors, self._anchor_generator(input_ids))
        if self.feature_store is not None and "index" in examples[0]:
            features = torch.zeros(len(examples), length, self.feature_store.width)
            for row, example in enumerate(examples):
                stored = self.feature_store[example["index"]]
                if stored.shape[0] != len(example["input_ids"]):
                    raise ValueError(
                        f"example {example['index']} has {len(example['input_ids'])} tokens, "
                        f"its stored features {stored.shape[0]}"
                    )
                features[row, : stored.shape[0]] = stored.float()
            batch["target_hidden"] = features
            if self.soft_targets:
                batch["target_top_ids"] = torch.zeros(len(examples), length, self.soft_targets, dtype=torch.long)
                batch["target_top_probs"] = torch.zeros(len(examples), length, self.soft_targets)
                for row, example in enumerate(examples):
                    ids, probs = self.feature_store.soft_targets(example["index"], self.soft_targets)
                    batch["target_top_ids"][row, : ids.shape[0]] = ids
                    batch["target_top_probs"][row, : probs.shape[0]] = probs.float()
        return batch

    def _anchor_generator(self, input_ids: torch.Tensor) -> torch.Generator | None:
        """With `anchor_seed`, a generator seeded by it and the batch's tokens: the same batch gets the same anchors
        in any process, worker or evaluation, whatever was drawn before."""
        return None if self.anchor_seed is None else seeded_generator(self.anchor_seed, input_ids)
