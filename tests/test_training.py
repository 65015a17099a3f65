"""Training: data pipeline, loss and curriculum, DominoTrainer, the CLI, and a 2-process accelerate run."""

import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import transformers
from packaging import version
from transformers import AutoModelForCausalLM, AutoTokenizer

from domino_spec import DominoDraftModel, DraftingOptions
from domino_spec.draft_building import from_target
from domino_spec.generation.engine import speculative_generate
from domino_spec.targets import prompt_token_ids
from domino_spec.training.collator import DominoDataCollator, sample_anchors
from domino_spec.training.data import check_vocabulary, load_prompts, load_training_dataset, summarize
from domino_spec.training.features import target_features
from domino_spec.training.loss import (
    IGNORE_INDEX,
    acceptance_length,
    block_labels,
    block_soft_targets,
    curriculum_lambda,
    domino_loss,
    soft_cross_entropy,
)
from domino_spec.training.train import parse_train_arguments
from domino_spec.training.trainer import DominoTrainer, DominoTrainingArguments

from conftest import tiny_draft, tiny_target, tiny_tokenizer
from speculative_helpers import draft_from_scratch

DOMINO_SPEC = shutil.which("domino-spec")
PLAIN_DECODING = functools.partial(speculative_generate, draft=None)  # what generate-data decodes with


# ---------------------------------------------------------------------- loss and curriculum


def test_curriculum_lambda_schedule():
    assert curriculum_lambda(0, 100) == 1.0
    assert curriculum_lambda(25, 100) == pytest.approx(0.75)
    assert curriculum_lambda(100, 100) == 0.0
    assert curriculum_lambda(25, 100, lambda_start=0.8, decay_ratio=0.5) == pytest.approx(0.4)
    assert curriculum_lambda(60, 100, decay_ratio=0.5) == 0.0
    assert curriculum_lambda(10, 100, lambda_start=0.0) == 0.0  # the no-curriculum ablation


def test_block_labels_and_acceptance_proxy():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    labels = block_labels(input_ids, loss_mask, torch.tensor([[2, 4]]), num_slots=3)
    assert labels.tolist() == [[[13, 14, 15], [15, IGNORE_INDEX, IGNORE_INDEX]]]
    logits = torch.full((1, 2, 3, 20), -1.0)
    for slot, token in enumerate([13, 19, 15]):  # block 0: hit, miss, hit -> accepts 1 draft
        logits[0, 0, slot, token] = 1.0
    logits[0, 1, 0, 15] = 1.0  # block 1: hit, then ignored slots stop the run
    assert acceptance_length(logits, labels).item() == pytest.approx((2 + 2) / 2)


def test_loss_interpolates_base_and_final():
    torch.manual_seed(0)
    labels = torch.randint(0, 7, (2, 3, 4))
    base, final = torch.randn(2, 3, 4, 7), torch.randn(2, 3, 4, 7)
    loss_base, metrics = domino_loss(final, base, labels, lam=1.0)
    loss_final, _ = domino_loss(final, base, labels, lam=0.0)
    mixed, _ = domino_loss(final, base, labels, lam=0.25)
    assert loss_base.item() == pytest.approx(metrics["loss_base"])
    assert mixed.item() == pytest.approx(0.25 * loss_base.item() + 0.75 * loss_final.item(), rel=1e-5)


def test_cross_entropy_weights_slots_by_exp_minus_k_over_gamma_normalised_per_sequence():
    torch.manual_seed(0)
    labels = torch.randint(0, 7, (2, 3, 4))
    labels[0, 1, 2:] = IGNORE_INDEX  # a block cut by the end of its response
    labels[1, 0] = IGNORE_INDEX
    logits = torch.randn(2, 3, 4, 7)
    gamma = 2.0
    per_sequence = []
    for sequence in range(2):
        weighted_sum = weight_sum = 0.0
        for block in range(3):
            for slot in range(4):
                label = int(labels[sequence, block, slot])
                if label == IGNORE_INDEX:
                    continue
                nll = -torch.log_softmax(logits[sequence, block, slot], -1)[label].item()
                weighted_sum += math.exp(-slot / gamma) * nll
                weight_sum += math.exp(-slot / gamma)
        per_sequence.append(weighted_sum / weight_sum)
    loss, _ = domino_loss(logits, logits, labels, lam=1.0, gamma=gamma)
    assert loss.item() == pytest.approx(sum(per_sequence) / 2, rel=1e-5)


def test_soft_cross_entropy_renormalises_over_the_draft_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    labels = torch.randint(0, 7, (2, 3))
    # All of the target's mass on the label: the hard cross-entropy.
    certain_ids = torch.stack([labels, (labels + 1) % 7], dim=-1)
    certain = soft_cross_entropy(logits, certain_ids, torch.tensor([1.0, 0.0]).expand(2, 3, 2))
    torch.testing.assert_close(
        certain, torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    )
    # A token outside the draft vocabulary (IGNORE_INDEX) drops out; the rest is renormalised.
    ids = torch.tensor([[[2, IGNORE_INDEX, 5]]])
    log_probs = logits[:1, :1].log_softmax(-1)
    expected = -(0.6 * log_probs[0, 0, 2] + 0.4 * log_probs[0, 0, 5])
    torch.testing.assert_close(
        soft_cross_entropy(logits[:1, :1], ids, torch.tensor([[[0.3, 0.5, 0.2]]]))[0, 0], expected
    )
    nothing = torch.full((1, 1, 2), IGNORE_INDEX)
    assert soft_cross_entropy(logits[:1, :1], nothing, torch.tensor([[[0.7, 0.3]]])).item() == 0.0


def test_block_soft_targets_score_the_token_each_slot_predicts():
    """Slot s predicts the token at anchor + s + 1: its soft target is the target's distribution at anchor + s."""
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    anchors = torch.tensor([[2, 4]])
    next_tokens = torch.cat([input_ids[:, 1:], torch.tensor([[0]])], dim=1)  # a target sure of every next token
    top_ids = torch.stack([next_tokens, next_tokens + 100], dim=-1)  # [1, 6, 2]
    top_probs = torch.tensor([0.9, 0.1]).expand(1, 6, 2)
    ids, probs = block_soft_targets(top_ids, top_probs, anchors, num_slots=3)
    assert ids.shape == probs.shape == (1, 2, 3, 2)
    labels = block_labels(input_ids, loss_mask, anchors, num_slots=3)
    labelled = labels != IGNORE_INDEX
    assert torch.equal(ids[..., 0][labelled], labels[labelled])
    assert torch.equal(ids[..., 1][labelled], labels[labelled] + 100)
    assert torch.equal(probs[..., 0], torch.full((1, 2, 3), 0.9))


def test_anchors_lie_inside_the_response():
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1, 1]])
    anchors = sample_anchors(loss_mask, num_anchors=3)
    for row, positions in enumerate(anchors.tolist()):
        for position in positions:
            assert loss_mask[row, position] == 1 and loss_mask[row, position + 1] == 1
    assert sorted(set(anchors[0].tolist())) == [3, 4, 5]  # exactly the 3 candidates, without replacement
    anchors = sample_anchors(loss_mask, num_anchors=256)  # no more than the longest response's 6 positions
    assert anchors.shape == (2, 6) and anchors[1].tolist() == [1, 2, 3, 4, 5, 6]
    assert set(anchors[0].tolist()) <= {3, 4, 5}  # drawn with replacement to fill the row


def test_seeded_anchors_are_fixed_per_batch_and_differ_between_batches():
    """Evaluation anchors: the same batch gets the same anchors whatever was drawn before, and batches of the same
    shape do not all score the same positions."""
    examples = _random_examples(count=8, length=16, prompt_length=4)
    collator = DominoDataCollator(pad_token_id=0, num_anchors=2, anchor_seed=0)
    anchors = [collator([example])["anchor_positions"] for example in examples]
    torch.rand(3)  # the global generator moves on
    assert torch.equal(collator([examples[0]])["anchor_positions"], anchors[0])
    assert len({tuple(positions[0].tolist()) for positions in anchors}) > 1


def test_training_draws_each_examples_anchors_from_the_seed_and_the_step(tmp_path):
    """Whatever the global generator drew before: a resumed run trains on the blocks the uninterrupted one trained on.
    The next step (another epoch) draws others. The step draws them, once: the training batches come without."""
    target = tiny_target("llama")
    examples = _random_examples(count=2, length=16, prompt_length=4)
    trainer = _trainer(tmp_path, target, tiny_draft(target).float(), examples, num_anchors=2)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "anchor_positions" not in batch
    trainer.current_gradient_accumulation_steps = 1  # as Trainer's loop sets it before each step
    losses = []
    for step in (0, 0, 1):
        trainer.state.global_step = step
        torch.rand(3)  # the global generator moves on
        losses.append(trainer.training_step(trainer.model, batch).item())
    assert losses[0] == losses[1] != losses[2]


# ---------------------------------------------------------------------- what a block sees


def _features(target, draft, input_ids):
    with torch.no_grad():
        return draft.fuse_target_hidden_states(target(input_ids, output_hidden_states=True).hidden_states)


def _train_forward(draft, target, input_ids, target_hidden, anchors, **kwargs):
    with torch.no_grad():
        return draft(
            input_ids, target_hidden, anchors, target.get_input_embeddings(), target.get_output_embeddings(), **kwargs
        )


def test_block_sees_only_context_before_its_anchor_and_its_own_block(family):
    target = tiny_target(family)
    draft = tiny_draft(target)
    input_ids = torch.randint(0, 100, (1, 24))
    anchors = torch.tensor([[6, 12, 15]])
    features = _features(target, draft, input_ids)
    reference = _train_forward(draft, target, input_ids, features, anchors)

    later = features.clone()
    later[:, 12:] += torch.randn_like(later[:, 12:])  # at and after block 1's anchor
    changed = _train_forward(draft, target, input_ids, later, anchors)
    torch.testing.assert_close(changed.logits[:, :2], reference.logits[:, :2])  # blocks 0 and 1 see none of it
    assert not torch.allclose(changed.logits[:, 2], reference.logits[:, 2])  # block 2 (anchor 15) sees 12..14

    other_anchor = input_ids.clone()
    other_anchor[0, 6] = (input_ids[0, 6] + 1) % 100  # block 0's anchor token; features kept fixed
    changed = _train_forward(draft, target, other_anchor, features, anchors)
    assert not torch.allclose(changed.logits[:, 0], reference.logits[:, 0])
    torch.testing.assert_close(changed.logits[:, 1:], reference.logits[:, 1:])


def test_flex_attention_mask_matches_sdpa():
    target = tiny_target("qwen3")
    draft = tiny_draft(target)
    input_ids = torch.randint(0, 100, (2, 20))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 15:] = 0
    anchors = torch.tensor([[3, 8, 12], [2, 5, 11]])
    features = _features(target, draft, input_ids)
    sdpa = _train_forward(draft, target, input_ids, features, anchors, attention_mask=attention_mask)
    draft.config._attn_implementation = "flex_attention"
    flex = _train_forward(draft, target, input_ids, features, anchors, attention_mask=attention_mask)
    torch.testing.assert_close(flex.logits, sdpa.logits, rtol=1e-4, atol=1e-5)


def test_flex_attention_refuses_attention_dropout_in_training():
    """flex_attention has no dropout: training with it would silently ignore config.attention_dropout."""
    target = tiny_target("qwen3")
    draft = tiny_draft(target, attention_dropout=0.1).train()
    draft.config._attn_implementation = "flex_attention"
    input_ids = torch.randint(0, 100, (1, 20))
    features = _features(target, draft, input_ids)
    with pytest.raises(ValueError, match="flex_attention has no attention dropout.*attn_implementation='sdpa'"):
        _train_forward(draft, target, input_ids, features, torch.tensor([[3, 8]]))
    draft.eval()  # no dropout at inference: nothing to refuse
    _train_forward(draft, target, input_ids, features, torch.tensor([[3, 8]]))


def test_teacher_forcing_reads_ground_truth_and_training_time_test_reads_predictions():
    target = tiny_target("llama")
    draft = tiny_draft(target, first_corrected_slot=1)
    input_ids = torch.randint(0, 100, (1, 20))
    anchors = torch.tensor([[8]])
    features = _features(target, draft, input_ids)
    edited = input_ids.clone()
    edited[0, 10] = (input_ids[0, 10] + 3) % 100  # ground truth inside the block: slot 2's GRU input (anchor + 2)
    for reads_predictions in (False, True):
        reference = _train_forward(
            draft, target, input_ids, features, anchors, head_reads_predictions=reads_predictions
        )
        changed = _train_forward(draft, target, edited, features, anchors, head_reads_predictions=reads_predictions)
        torch.testing.assert_close(changed.base_logits, reference.base_logits)  # the backbone never sees it
        torch.testing.assert_close(changed.logits[:, :, :2], reference.logits[:, :, :2])
        if reads_predictions:
            torch.testing.assert_close(changed.logits, reference.logits)
        else:
            assert not torch.allclose(changed.logits[:, :, 2:], reference.logits[:, :, 2:])


def test_training_time_test_scores_every_token_whatever_the_inference_pool():
    """A candidate pool is a drafting option: with it, training-time test still gives finite logits over the whole
    vocabulary, the ones it gives without a pool."""
    target = tiny_target("llama")
    draft = tiny_draft(target, first_corrected_slot=1)
    input_ids = torch.randint(0, 100, (1, 20))
    anchors = torch.tensor([[3, 9]])
    features = _features(target, draft, input_ids)
    whole = _train_forward(draft, target, input_ids, features, anchors, head_reads_predictions=True)
    draft.drafting_options = DraftingOptions(candidate_pool=4)
    pooled = _train_forward(draft, target, input_ids, features, anchors, head_reads_predictions=True)
    assert torch.isfinite(pooled.logits).all()
    torch.testing.assert_close(pooled.logits, whole.logits)


# ---------------------------------------------------------------------- DominoTrainer


def _random_examples(count: int, length: int, prompt_length: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        input_ids = torch.randint(5, 100, (length,), generator=generator).tolist()
        examples.append({"input_ids": input_ids, "loss_mask": [0] * prompt_length + [1] * (length - prompt_length)})
    return examples


def _trainer(tmp_path, target, draft, examples, num_anchors, **arguments):
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=1,
        learning_rate=1e-2,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        num_anchors=num_anchors,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    defaults.update(arguments)
    return DominoTrainer(
        model=draft,
        target=target,
        args=DominoTrainingArguments(**defaults),
        train_dataset=examples,
        data_collator=DominoDataCollator(pad_token_id=0, num_anchors=num_anchors),
    )


def test_tiny_draft_overfits_and_target_is_untouched(tmp_path):
    target = tiny_target("qwen3")
    target_before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    draft = tiny_draft(target).float()
    examples = _random_examples(count=2, length=24, prompt_length=4)
    trainer = _trainer(tmp_path, target, draft, examples, num_anchors=8, max_steps=100, learning_rate=3e-2)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.25 * losses[0], losses
    assert {"loss_base", "loss_final", "lam", "acceptance_base", "acceptance_final"} <= set(
        trainer.state.log_history[0]
    )
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, target_before[name]), f"target weight {name} changed"
    assert not any(name.startswith(("model.", "lm_head")) for name in trainer.model.state_dict())


def test_trainer_follows_the_curriculum_and_its_loss_options(tmp_path):
    target = tiny_target("llama")
    examples = _random_examples(count=2, length=16, prompt_length=4)
    trainer = _trainer(
        tmp_path, target, tiny_draft(target).float(), examples, num_anchors=4, max_steps=4, learning_rate=0.0
    )
    trainer.train()
    assert [entry["lam"] for entry in trainer.state.log_history if "lam" in entry] == [1.0, 0.75, 0.5, 0.25]

    batch = DominoDataCollator(pad_token_id=0, num_anchors=4)(examples)
    draft = tiny_draft(target).float().eval()

    def loss_and_logits(**arguments) -> tuple[float, torch.Tensor]:  # at lambda 0: the final logits' loss alone
        trainer = _trainer(tmp_path, target, draft, examples, num_anchors=4, lambda_start=0.0, **arguments)
        with torch.no_grad():
            loss, outputs = trainer.compute_loss(draft, batch, return_outputs=True)
        return loss.item(), outputs.logits

    features = _features(target, draft, batch["input_ids"])  # equal lengths: no padding to mask
    outputs = _train_forward(draft, target, batch["input_ids"], features, batch["anchor_positions"])
    labels = block_labels(batch["input_ids"], batch["loss_mask"], batch["anchor_positions"], outputs.logits.shape[2])
    for gamma in (7.0, 0.5):
        expected, _ = domino_loss(outputs.logits, outputs.base_logits, labels, lam=0.0, gamma=gamma)
        assert loss_and_logits(loss_gamma=gamma)[0] == pytest.approx(expected.item(), rel=1e-5)
    reading_predictions = _train_forward(
        draft, target, batch["input_ids"], features, batch["anchor_positions"], head_reads_predictions=True
    ).logits
    assert not torch.allclose(reading_predictions, outputs.logits)
    torch.testing.assert_close(loss_and_logits(training_time_test=True)[1], reading_predictions)


def test_evaluation_draws_the_same_anchors_each_time_and_its_workers_ignore_stop_signals(tmp_path):
    target = tiny_target("llama")
    examples = _random_examples(count=4, length=16, prompt_length=4)
    trainer = _trainer(
        tmp_path,
        target,
        tiny_draft(target).float(),
        examples[:2],
        num_anchors=3,
        dataloader_num_workers=1,
        per_device_eval_batch_size=1,
    )
    scores = [trainer.evaluate(examples)["eval_loss"] for _ in range(2)]
    assert scores[0] == scores[1]  # 3 of 11 positions per row: random anchors would differ
    batches = iter(trainer.get_eval_dataloader(examples))
    next(batches)  # the worker runs
    (worker,) = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
    os.kill(int(worker), signal.SIGTERM)  # as a scheduler's stop reaches every process of the job
    time.sleep(0.5)
    assert len(list(batches)) == 3  # the worker lives on to deliver the rest
    persistent = _trainer(
        tmp_path,
        target,
        trainer.model,
        examples[:2],
        num_anchors=3,
        dataloader_num_workers=1,
        per_device_eval_batch_size=1,
        dataloader_persistent_workers=True,
    )
    assert [persistent.evaluate(examples)["eval_loss"] for _ in range(2)] == scores  # workers keep their collator


def test_a_run_that_raises_gives_back_the_signal_handlers(tmp_path):
    target = tiny_target("llama")
    examples = _random_examples(count=2, length=16, prompt_length=15)  # one response token: no block to anchor
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match="no response position to anchor a block"):
        _trainer(tmp_path, target, tiny_draft(target).float(), examples, num_anchors=3).train()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_first_ctrl_c_asks_for_a_checkpoint_and_a_second_interrupts_at_once():
    from domino_spec.training.trainer import StopOnSignal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever ran before this test
    stop_on_signal = StopOnSignal()
    stop_on_signal.on_train_begin(None, None, None)
    try:
        signal.raise_signal(signal.SIGINT)
        assert stop_on_signal.received is signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stop_on_signal.restore_handlers()
        signal.signal(signal.SIGINT, before)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    target = tiny_target("llama")
    # Each example's anchors come from the seed, the step and its tokens: both runs train the same blocks.
    examples = _random_examples(count=2, length=12, prompt_length=4)
    examples[1]["input_ids"] = examples[1]["input_ids"][:10]  # different lengths: padding and per-sequence means
    examples[1]["loss_mask"] = examples[1]["loss_mask"][:10]
    weights = []
    for batch_size, accumulation in ((2, 1), (1, 2)):
        draft = tiny_draft(target, seed=3).float()
        examples_now = [dict(example) for example in examples]
        trainer = _trainer(
            tmp_path,
            target,
            draft,
            examples_now,
            num_anchors=5,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            optim="sgd",
            max_grad_norm=0.0,
            seed=0,
        )
        trainer.train()
        weights.append({name: tensor.detach().clone() for name, tensor in draft.named_parameters()})
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_trains_the_same_weights(tmp_path):
    fields = {field.name for field in dataclasses.fields(DominoTrainingArguments)}
    flag = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"  # 5.24
    target = tiny_target("llama")
    examples = _random_examples(count=2, length=16, prompt_length=4)
    weights = []
    for checkpointing in (False, True):
        draft = tiny_draft(target, seed=3).float()
        trainer = _trainer(
            tmp_path,
            target,
            draft,
            [dict(e) for e in examples],
            num_anchors=4,
            max_steps=2,
            optim="sgd",
            max_grad_norm=0.0,
            seed=0,
            **{flag: checkpointing},
        )
        trainer.train()
        assert draft.layers[0].gradient_checkpointing == checkpointing
        weights.append({name: tensor.detach().clone() for name, tensor in draft.named_parameters()})
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------- data and CLI


def _write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record) + "\n")


def test_prompt_sources_and_deduplication(tmp_path):
    import datasets

    _write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "prompt": "hello"},
            {"id": "b", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"id": "c", "prompt": "hello"},  # duplicate of a
        ],
    )
    prompts = load_prompts(str(tmp_path / "p.jsonl"))
    assert [p.id for p in prompts] == ["a", "b"]
    assert prompts[1].messages == [{"role": "user", "content": "hi"}]

    sharegpt = '[{"id": "x", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},'
    sharegpt += ' {"id": "y", "conversations": [{"from": "human", "value": "q2"'  # truncated mid-record
    (tmp_path / "s.json").write_text(sharegpt)
    assert [(p.id, p.messages[0]["content"]) for p in load_prompts(str(tmp_path / "s.json"))] == [("x", "q1")]

    datasets.Dataset.from_list([{"id": "d", "prompt": "from a folder"}]).save_to_disk(str(tmp_path / "folder"))
    assert load_prompts(str(tmp_path / "folder"))[0].messages[0]["content"] == "from a folder"
    with pytest.raises(ValueError, match="has no prompt"):
        _write_jsonl(tmp_path / "bad.jsonl", [{"text": "no prompt field"}])
        load_prompts(str(tmp_path / "bad.jsonl"))


def test_training_dataset_masks_response_and_drops_duplicates(tmp_path):
    record = {"id": "a", "prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}
    _write_jsonl(tmp_path / "d.jsonl", [record, {**record, "id": "b"}, {**record, "id": "c", "response_ids": [9]}])
    dataset = load_training_dataset(str(tmp_path / "d.jsonl"), max_length=6)
    assert len(dataset) == 1  # the duplicate and the 1-token response are dropped
    assert dataset[0]["input_ids"] == [1, 2, 3, 4, 5, 6]
    assert dataset[0]["loss_mask"] == [0, 0, 0, 1, 1, 1]
    assert summarize(dataset)["response_tokens"] == 3
    check_vocabulary(dataset, vocab_size=7, data_path="d.jsonl")
    with pytest.raises(ValueError, match="tokenized for another model"):
        check_vocabulary(dataset, vocab_size=6, data_path="d.jsonl")


def test_training_data_that_trains_nothing_is_refused_with_the_reason(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl is empty: make training data with `domino-spec generate-data`"):
        load_training_dataset(str(tmp_path / "empty.jsonl"))
    _write_jsonl(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "hello"}])
    with pytest.raises(ValueError, match="no prompt_ids or response_ids field .* `domino-spec generate-data`"):
        load_training_dataset(str(tmp_path / "prompts.jsonl"))
    _write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}])
    with pytest.raises(ValueError, match="none of its 1 records is kept: .* max_length=4"):
        load_training_dataset(str(tmp_path / "d.jsonl"), max_length=4)


def test_a_malformed_jsonl_line_is_named_by_its_file_and_line(tmp_path):
    from domino_spec.training.data import check_regenerated_by, finished_ids

    record = {"id": "a", "prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}
    text = "\n".join([json.dumps(record), "", '{"id": "b", "prompt_ids": [1, 2,', json.dumps({**record, "id": "c"})])
    (tmp_path / "d.jsonl").write_text(text + "\n")  # line 3 is cut, after a blank line 2
    message = re.escape(f"{tmp_path / 'd.jsonl'}, line 3: not valid JSON")
    with pytest.raises(ValueError, match=message):
        load_training_dataset(str(tmp_path / "d.jsonl"))
    with pytest.raises(ValueError, match=message):  # resuming generate-data: a cut line mid-file is no kill's doing
        finished_ids(str(tmp_path / "d.jsonl"))
    assert (tmp_path / "d.jsonl").read_text() == text + "\n"  # and the records after it are kept
    (tmp_path / "d.jsonl").write_text('{"id": "a", "response_ids": [4, 5\n')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'd.jsonl'}, line 1: not valid JSON")):
        check_regenerated_by(str(tmp_path / "d.jsonl"), tiny_target("llama"), tiny_tokenizer())
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello"}\n\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'p.jsonl'}, line 4: a JSON list, not an object")):
        load_prompts(str(tmp_path / "p.jsonl"))


def test_data_of_another_tokenizer_is_refused_even_where_its_ids_fit(tmp_path):
    from domino_spec.training.data import check_regenerated_by

    target, tokenizer = tiny_target("llama"), tiny_tokenizer()
    response_ids = tokenizer("the answer is 4", add_special_tokens=False)["input_ids"]
    record = {"id": "a", "prompt_ids": [3], "response_ids": response_ids, "response": "the answer is 4"}
    _write_jsonl(tmp_path / "d.jsonl", [record])
    check_regenerated_by(str(tmp_path / "d.jsonl"), target, tokenizer)
    shifted = [(token + 1) % 100 for token in response_ids]  # another tokenizer's ids for the same text
    _write_jsonl(tmp_path / "d.jsonl", [record, {**record, "id": "b", "response_ids": shifted}])
    with pytest.raises(ValueError, match="record 'b'.*tokenized by another tokenizer"):
        check_regenerated_by(str(tmp_path / "d.jsonl"), target, tokenizer)


def test_regenerated_data_records_its_target_and_settings_and_refuses_to_mix_them(tmp_path, caplog):
    from domino_spec.training.data import Prompt, check_regenerated_by, regenerate_responses

    target, tokenizer = tiny_target("llama"), tiny_tokenizer()
    prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"question {i}"}]) for i in range(3)]
    output = str(tmp_path / "data.jsonl")
    assert regenerate_responses(target, tokenizer, prompts[:2], output, PLAIN_DECODING, max_new_tokens=6) == 2
    with pytest.raises(ValueError, match=r"temperature 0.0 \(now 0.7\)"):
        regenerate_responses(target, tokenizer, prompts, output, PLAIN_DECODING, max_new_tokens=6, temperature=0.7)
    with pytest.raises(ValueError, match="target '[0-9a-f]{16}' \\(now '[0-9a-f]{16}'\\)"):
        regenerate_responses(tiny_target("llama", seed=4), tokenizer, prompts, output, PLAIN_DECODING, max_new_tokens=6)
    resumed = regenerate_responses(target, tokenizer, prompts, output, PLAIN_DECODING, max_new_tokens=6)
    assert resumed == 1  # the same settings: resumes
    check_regenerated_by(output, target, tokenizer)
    assert "another target" not in caplog.text
    check_regenerated_by(output, tiny_target("llama", seed=4), tokenizer)
    assert "regenerated by another target" in caplog.text


def test_regenerated_responses_are_the_targets_own_greedy_answers(tmp_path):
    """Batched with left padding, rows leaving the batch at their EOS: each response is what `generate` gives the
    prompt alone, EOS included, or `max_new_tokens` tokens."""
    from domino_spec.training.data import Prompt, regenerate_responses

    target, tokenizer = tiny_target("llama"), tiny_tokenizer()
    prompts = [Prompt(f"p{i}", [{"role": "user", "content": "why?" * (i + 1)}]) for i in range(5)]
    alone = [torch.tensor([prompt_token_ids(tokenizer, prompt.messages, None)]) for prompt in prompts]
    first = target.generate(alone[0], max_new_tokens=12, do_sample=False)[0, alone[0].shape[1] :]
    target.generation_config.eos_token_id = int(first[3])  # the first prompt stops inside the run
    output = tmp_path / "data.jsonl"
    assert (
        regenerate_responses(target, tokenizer, prompts, str(output), PLAIN_DECODING, max_new_tokens=12, batch_size=3)
        == 5
    )
    responses = {record["id"]: record["response_ids"] for record in map(json.loads, output.read_text().splitlines())}
    lengths = set()
    for prompt, ids in zip(prompts, alone):
        expected = target.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
        assert responses[prompt.id] == expected
        lengths.add(len(expected))
    assert min(lengths) <= 4 and max(lengths) == 12  # stopped at EOS and at the length limit


def test_the_draft_folder_says_which_mode_its_data_was_regenerated_in(tmp_path, tiny_target_dir):
    """Drafts are trained per mode (greedy or sampled, thinking on or off): the checkpoint records which."""
    from domino_spec.cli import main

    _write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": f"question {i}?"} for i in range(6)])
    main(
        [
            "generate-data",
            "--target",
            tiny_target_dir,
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--output",
            str(tmp_path / "data.jsonl"),
            "--max-new-tokens",
            "12",
            "--temperature",
            "0.7",
            "--thinking",
            "off",
        ]
    )
    main(
        [
            "train",
            "--target",
            tiny_target_dir,
            "--data",
            str(tmp_path / "data.jsonl"),
            "--output",
            str(tmp_path / "d"),
            "--draft_layers",
            "1",
            "--block_size",
            "4",
            "--num_anchors",
            "4",
            "--max_steps",
            "1",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
        ]
    )
    data = json.loads((tmp_path / "d" / "training_summary.json").read_text())["data"]
    assert data["generation"] == {"max_new_tokens": 12, "temperature": 0.7, "thinking": False}
    assert data["examples"] == len(load_training_dataset(str(tmp_path / "data.jsonl")))
    card = (tmp_path / "d" / "README.md").read_text()
    assert "| responses | regenerated by the target, sampled at temperature 0.7, at most 12 tokens |" in card
    assert "| thinking | off |" in card


def test_train_arguments_from_yaml_and_command_line(tmp_path):
    (tmp_path / "recipe.yaml").write_text("target: t\nlearning_rate: 0.001\nnum_anchors: 32\nblock_size: 8\n")
    argv = ["--data", "d.jsonl", "--output", str(tmp_path / "o"), "--config", str(tmp_path / "recipe.yaml")]
    draft_args, training_args = parse_train_arguments(argv + ["--num_anchors", "64"])
    assert training_args.learning_rate == 0.001 and training_args.num_anchors == 64  # the command line wins
    assert draft_args.target == "t"  # a required flag given by the file
    assert draft_args.block_size == 8 and training_args.output_dir == str(tmp_path / "o")
    assert training_args.lr_scheduler_type == "cosine" and training_args.lambda_start == 1.0  # recipe defaults


def test_resuming_picks_the_highest_complete_checkpoint(tmp_path, capsys):
    from domino_spec.training.checkpoints import checkpoint_to_resume

    argv = ["--target", "t", "--data", "d", "--output", str(tmp_path)]
    assert checkpoint_to_resume(parse_train_arguments(argv)[1]) is None  # nothing to resume yet
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint_to_resume(parse_train_arguments(argv + ["--resume_from_checkpoint", "true"])[1])
    for step in (2, 10, 12, 14):  # 10 after 2 in step order, not in name order; 12 and 14 cut short
        (tmp_path / f"checkpoint-{step}").mkdir()
        if step != 12:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(
                '{"global_step": 1' if step == 14 else "{}"
            )
    for flags in ([], ["--resume_from_checkpoint", "true"], ["--resume_from_checkpoint", "last"]):
        assert checkpoint_to_resume(parse_train_arguments(argv + flags)[1]) == str(tmp_path / "checkpoint-10")
        err = capsys.readouterr().err
        assert f"skipping {tmp_path / 'checkpoint-14'}: incomplete" in err and "checkpoint-12: incomplete" in err
    chosen = ["--resume_from_checkpoint", str(tmp_path / "checkpoint-12")]
    with pytest.raises(FileNotFoundError, match="--resume_from_checkpoint .*checkpoint-12: not a complete Trainer"):
        checkpoint_to_resume(parse_train_arguments(argv + chosen)[1])
    assert checkpoint_to_resume(parse_train_arguments(argv + ["--restart", "true"])[1]) is None


def test_training_arguments_the_domino_loss_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="no label smoothing"):
        parse_train_arguments(["--target", "t", "--data", "d", "--label_smoothing_factor", "0.1"])
    with pytest.raises(ValueError, match="--soft_targets -1: a number of tokens, or 0"):
        parse_train_arguments(["--target", "t", "--data", "d", "--soft_targets", "-1"])


def test_train_arguments_from_yaml_refuse_unknown_keys_and_take_the_output_alias_and_layer_lists(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("target: t\nlearning_rte: 0.5\n")
    with pytest.raises(ValueError, match=r"learning_rte \(did you mean learning_rate\?\)"):
        parse_train_arguments(["--data", "d.jsonl", "--config", str(recipe)])
    recipe.write_text(f"target: t\noutput: {tmp_path / 'o'}\ntarget_layer_ids: [1, 3]\n")
    draft_args, training_args = parse_train_arguments(["--data", "d.jsonl", "--config", str(recipe)])
    assert training_args.output_dir == str(tmp_path / "o") and draft_args.target_layer_ids == "1,3"


def test_init_from_keeps_the_drafts_shape_or_its_backbone_refuses_other_shape_flags_and_trains_fp32_weights(tmp_path):
    from domino_spec.training.train import DraftArguments, build_draft

    target = tiny_target("llama")
    tiny_draft(target, block_size=4).to(torch.bfloat16).save_pretrained(tmp_path / "draft")
    draft_args = DraftArguments(target="t", data="d", init_from=str(tmp_path / "draft"), block_size=4)
    draft = build_draft(draft_args, target, tiny_tokenizer())
    assert draft.config.block_size == 4 and draft.dtype == torch.float32  # master weights, as a fresh draft's
    draft_args.block_size = 8
    with pytest.raises(ValueError, match=r"block_size=8 \(the draft has 4\)\. Drop those flags"):
        build_draft(draft_args, target, tiny_tokenizer())
    # --use_domino_head false starts from the backbone alone: the DFlash-only twin of a Domino draft.
    draft_args.block_size, draft_args.use_domino_head = 4, False
    backbone = build_draft(draft_args, target, tiny_tokenizer())
    assert backbone.head is None and not backbone.config.use_domino_head and backbone.dtype == torch.float32
    kept = {name: value for name, value in draft.state_dict().items() if not name.startswith("head.")}
    assert backbone.state_dict().keys() == kept.keys()
    assert all(torch.equal(backbone.state_dict()[name], value) for name, value in kept.items())
    backbone.save_pretrained(tmp_path / "backbone")
    draft_args.init_from, draft_args.use_domino_head = str(tmp_path / "backbone"), True
    with pytest.raises(ValueError, match=r"use_domino_head=True \(the draft has False\)"):
        build_draft(draft_args, target, tiny_tokenizer())


def test_init_from_with_more_draft_layers_grows_a_draft_that_drafts_as_before_and_then_trains_every_layer(tmp_path):
    from domino_spec.training.train import DraftArguments, build_draft

    target = tiny_target("qwen3")
    draft = tiny_draft(target)  # 2 layers
    draft.save_pretrained(tmp_path / "draft")
    draft_args = DraftArguments(target="t", data="d", init_from=str(tmp_path / "draft"), draft_layers=4)
    grown = build_draft(draft_args, target, tiny_tokenizer())
    assert grown.config.num_hidden_layers == 4 and len(grown.layers) == 4
    input_ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    before, after = draft_from_scratch(draft, target, input_ids), draft_from_scratch(grown, target, input_ids)
    assert torch.equal(after.tokens, before.tokens)
    torch.testing.assert_close(after.logits, before.logits)
    # The new layers start as the last one with zero output projections; a step gives every weight a gradient.
    assert not grown.layers[3].self_attn.o_proj.weight.any() and not grown.layers[2].mlp.down_proj.weight.any()
    assert torch.equal(grown.layers[3].self_attn.q_proj.weight, draft.layers[1].self_attn.q_proj.weight)
    grown.train()
    features = grown.fuse_target_hidden_states(target(input_ids, output_hidden_states=True).hidden_states).detach()
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    optimizer = torch.optim.SGD(grown.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        output = grown(input_ids, features, torch.tensor([[2, 6], [3, 5]]), embed_tokens, lm_head)
        output.logits.logsumexp(-1).sum().backward()
        optimizer.step()
    assert grown.layers[3].self_attn.q_proj.weight.grad.any() and grown.layers[3].mlp.down_proj.weight.any()
    draft_args.draft_layers = 1
    with pytest.raises(ValueError, match=r"num_hidden_layers=1 \(the draft has 2\)"):
        build_draft(draft_args, target, tiny_tokenizer())


def test_a_head_less_draft_trained_with_shift_label_false_is_servable_by_sglang(tmp_path):
    from domino_spec.targets import load_target
    from domino_spec.training.export import sglang_problems
    from domino_spec.training.train import build_draft

    argv = ["--target", "t", "--data", "d", "--use_domino_head", "false", "--draft_layers", "1"]
    draft_args, _ = parse_train_arguments(argv)
    target = tiny_target("llama")
    assert sglang_problems(build_draft(draft_args, target, tiny_tokenizer()).config)  # the default: shift_label=True
    draft_args, _ = parse_train_arguments(argv + ["--shift_label", "false"])
    assert sglang_problems(build_draft(draft_args, target, tiny_tokenizer()).config) == []
    with pytest.raises(FileNotFoundError, match="no such folder, and not a known name"):
        load_target(str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    target = tiny_target("llama")
    target.generation_config.eos_token_id = 1
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def _run(args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)


def _two_processes() -> tuple[str, ...]:
    """A launcher of the CLI module on two local processes. accelerate spawns several through torchrun only in its
    --multi_gpu mode; without a GPU they train on the CPU (use_cpu defaults on) over gloo (`--ddp_backend gloo`). It
    runs the CLI as a module, the README's form: `accelerate launch domino-spec` would look for a file named
    domino-spec in the working directory. Each launch rendezvous on a port free now, not torchrun's fixed default,
    which a process another test left behind could still hold."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = ("accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1")
    launcher += ("--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no")
    return launcher + ("-m", "domino_spec.cli")


TRAINING_ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _tiny_train_command(
    tmp_path, target_dir: str, program: tuple[str, ...] = (DOMINO_SPEC,)
) -> tuple[list[str], object]:
    """`program train` (`program`: the domino-spec script, or a launcher of the CLI module) of a 1-layer draft on 8 tiny
    records, logging every step, saving no periodic checkpoint, with no step limit yet; and its output folder."""
    data = [
        {"id": f"s{i}", "prompt_ids": [3, 10 + i, 11, 4], "response_ids": list(range(20 + i, 40 + i))} for i in range(8)
    ]
    _write_jsonl(tmp_path / "data.jsonl", data)
    output = tmp_path / "draft"
    command = [*program, "train", "--target", target_dir, "--data", str(tmp_path / "data.jsonl")]
    command += ["--output", str(output), "--per_device_train_batch_size", "2", "--num_anchors", "4"]
    command += ["--draft_layers", "1", "--block_size", "4", "--report_to", "none", "--save_strategy", "no"]
    command += ["--logging_steps", "1", "--disable_tqdm", "true"]
    return command, output


def _started_training(command: list[str], **popen) -> subprocess.Popen:
    """`command` with no end in sight (`--max_steps 100000`), returned once its first step is logged."""
    popen = {"env": TRAINING_ENVIRONMENT, **popen}
    process = subprocess.Popen(command + ["--max_steps", "100000"], stdout=subprocess.PIPE, text=True, **popen)
    for line in process.stdout:
        if "'loss'" in line:
            break
    return process


def test_rerunning_train_refuses_another_shape_and_does_nothing_once_finished(tmp_path, tiny_target_dir, capsys):
    from domino_spec.cli import main

    _write_jsonl(
        tmp_path / "data.jsonl",
        [{"id": f"s{i}", "prompt_ids": [3, 10 + i, 11], "response_ids": list(range(20 + i, 34 + i))} for i in range(3)],
    )
    command = [
        "train",
        "--target",
        tiny_target_dir,
        "--data",
        str(tmp_path / "data.jsonl"),
        "--output",
        str(tmp_path / "draft"),
        "--block_size",
        "4",
        "--num_anchors",
        "4",
        "--draft_layers",
        "1",
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
    ]
    main(command + ["--max_steps", "2"])
    card = (tmp_path / "draft" / "README.md").read_text()  # hand-made records: no regeneration settings to cite
    assert "| responses | not regenerated by domino-spec: mode unknown |" in card
    with pytest.raises(
        ValueError, match=r"build for this --target differs: num_hidden_layers=2 \(the checkpoint has 1\)"
    ):
        main(command + ["--max_steps", "2", "--draft_layers", "2"])
    capsys.readouterr()
    main(command + ["--max_steps", "2"])
    out = capsys.readouterr().out
    assert "already holds the draft of a finished run" in out and "'loss'" not in out
    assert not (tmp_path / "draft" / "checkpoint-3").exists()
    main(command + ["--num_train_epochs", "2"])  # 2 epochs of one step: what the checkpoint holds
    assert "already holds the draft of a finished run" in capsys.readouterr().out
    (tmp_path / "draft" / "model.safetensors").unlink()  # as a kill after the last checkpoint, before the final save
    main(command + ["--max_steps", "2"])
    out = capsys.readouterr().out
    assert "'loss'" not in out and f"saved the draft to {tmp_path / 'draft'}" in out
    assert (tmp_path / "draft" / "model.safetensors").exists()


def _checkpointing_train_flags(tmp_path, target_dir: str, records: int) -> list[str]:
    """`train` flags of a 1-layer draft on `records` tiny records in batches of 2, saving a checkpoint and logging
    every step; no output folder or step limit yet."""
    data = [
        {"id": f"s{i}", "prompt_ids": [3, 10 + i, 11], "response_ids": list(range(20 + i, 34 + i))}
        for i in range(records)
    ]
    _write_jsonl(tmp_path / "data.jsonl", data)
    flags = ["--target", target_dir, "--data", str(tmp_path / "data.jsonl"), "--block_size", "4", "--num_anchors", "4"]
    flags += ["--draft_layers", "1", "--per_device_train_batch_size", "2", "--save_strategy", "steps"]
    return flags + ["--save_steps", "1", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true"]


def test_a_run_resumed_mid_epoch_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, tiny_target_dir):
    """The anchors of a step come from the seed, the step and its examples, not from what was drawn before it: the
    resumed run trains on the blocks the uninterrupted one trained on."""
    from safetensors.torch import load_file

    from domino_spec.cli import main

    command = ["train", *_checkpointing_train_flags(tmp_path, tiny_target_dir, records=6), "--max_steps", "5"]
    main(command + ["--output", str(tmp_path / "whole")])
    # Step 4 is the first of the second epoch (3 steps each): as a run stopped there, rerun.
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    main(command + ["--output", str(tmp_path / "resumed")])
    whole, resumed = (load_file(tmp_path / run / "model.safetensors") for run in ("whole", "resumed"))
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)


def test_a_truncated_checkpoint_file_is_skipped_with_a_warning_or_refused_when_named(tmp_path, tiny_target_dir, capsys):
    from domino_spec.cli import main
    from domino_spec.training.checkpoints import checkpoint_to_resume

    output = tmp_path / "draft"
    flags = [*_checkpointing_train_flags(tmp_path, tiny_target_dir, records=4), "--output", str(output)]
    main(["train", *flags, "--max_steps", "2"])
    newest, previous = output / "checkpoint-2", output / "checkpoint-1"
    for name in ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        intact = (newest / name).read_bytes()
        (newest / name).write_bytes(intact[: len(intact) // 2])  # as a disk fault or a cut-short copy leaves it
        capsys.readouterr()
        assert checkpoint_to_resume(parse_train_arguments(flags)[1]) == str(previous)
        assert capsys.readouterr().err.startswith(f"skipping {newest}: {newest / name} is not a readable")
        with pytest.raises(ValueError, match=f"--resume_from_checkpoint {newest}: {newest / name} is not a readable"):
            checkpoint_to_resume(parse_train_arguments([*flags, "--resume_from_checkpoint", str(newest)])[1])
        (newest / name).write_bytes(intact)

    intact = (newest / "optimizer.pt").read_bytes()
    (newest / "optimizer.pt").write_bytes(intact[:-100])
    capsys.readouterr()
    main(["train", *flags, "--max_steps", "3"])  # steps 2 and 3, from checkpoint-1
    out, err = capsys.readouterr()
    (warning,) = [line for line in err.splitlines() if "skipping" in line]
    assert warning.startswith(f"skipping {newest}: {newest / 'optimizer.pt'} is not a readable torch file")
    assert f"resuming from {previous}" in out and out.count("'loss'") == 2
    assert json.loads((output / "training_summary.json").read_text())["global_step"] == 3
    assert not (output / ".partial-save").exists()

    final = (output / "model.safetensors").read_bytes()
    (output / "model.safetensors").write_bytes(final[:-100])  # a save cut short: not the draft of a finished run
    main(["train", *flags, "--max_steps", "3"])  # step 3 ends mid-epoch: Trainer's `train` would train on
    out, err = capsys.readouterr()
    assert "already holds" not in out and "'loss'" not in out and f"saved the draft to {output}" in out
    assert f"{output / 'checkpoint-3'} ends the run, but {output / 'model.safetensors'} is not a readable" in err
    assert (output / "model.safetensors").read_bytes() == final
    main(["train", *flags, "--max_steps", "3"])
    assert "already holds the draft of a finished run" in capsys.readouterr().out


def test_a_final_draft_of_an_earlier_step_is_not_taken_for_the_finished_runs(tmp_path, tiny_target_dir, capsys):
    """Training on from a finished run, killed after its last checkpoint but before its final save: the folder still
    holds the earlier run's draft, which is not the draft of the run that now ends."""
    from domino_spec.cli import main

    output = tmp_path / "draft"
    command = ["train", *_checkpointing_train_flags(tmp_path, tiny_target_dir, records=2), "--output", str(output)]
    main(command + ["--max_steps", "1"])
    earlier = {path.name: path.read_bytes() for path in output.iterdir() if path.is_file()}
    main(command + ["--max_steps", "2"])
    for name, content in earlier.items():
        (output / name).write_bytes(content)
    capsys.readouterr()
    main(command + ["--max_steps", "2"])
    out, err = capsys.readouterr()
    assert "already holds" not in out and f"the draft in {output} is not of step 2" in err
    assert json.loads((output / "training_summary.json").read_text())["global_step"] == 2


def test_a_save_moves_its_weights_in_last_after_removing_the_ones_they_replace(tmp_path, monkeypatch):
    """Killed between two moves, the folder holds no weights (its final save is redone) or the new ones with every
    other file of their save; never truncated weights, nor old weights beside a new config."""
    from domino_spec.training.trainer import move_into_place

    folder, partial = tmp_path / "draft", tmp_path / "draft" / ".partial-save"
    partial.mkdir(parents=True)
    (folder / "model.safetensors").write_text("old")
    for name in ("config.json", "model.safetensors", "README.md", "training_summary.json"):
        (partial / name).write_text("new")
    states = []  # what a kill before each move would leave
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *paths: (states.append(sorted(os.listdir(folder))), replace(*paths)))
    move_into_place(str(partial), str(folder))
    assert [("model.safetensors" in state) for state in states] == [False] * 4
    assert states[-1] == [".partial-save", "README.md", "config.json", "training_summary.json"]
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors", "training_summary.json"]
    assert all((folder / name).read_text() == "new" for name in os.listdir(folder))


def test_command_line_mistakes_end_in_one_line_naming_them(tmp_path, tiny_target_dir):
    from domino_spec.cli import main

    result = _run([DOMINO_SPEC, "export", "--format", "sglang", str(tmp_path / "runs" / "typo"), str(tmp_path / "o")])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"domino-spec export: error: {tmp_path / 'runs' / 'typo'}: no such folder, so it is not a draft folder. "
        "(DOMINO_SPEC_TRACEBACK=1 shows where)"
    ]
    result = _run([DOMINO_SPEC, "trian"])
    assert result.returncode == 2 and "unknown command 'trian' (did you mean train?)" in result.stderr
    for argv, status in (([], 2), (["--help"], 0)):  # no command is a mistake; asking for help is not
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == status, argv
    draft_dir = tmp_path / "draft_with_head"
    tiny_draft(tiny_target("llama")).save_pretrained(draft_dir)
    with pytest.raises(ValueError, match="--dflash .* has a Domino head"):
        main(["bench", "--dflash", str(draft_dir), "--methods", "dflash"])
    with pytest.raises(FileNotFoundError, match="--init_from .*missing: no such folder"):
        (tmp_path / "data.jsonl").write_text("")
        main(
            ["train", "--target", "t", "--data", str(tmp_path / "data.jsonl"), "--init_from", str(tmp_path / "missing")]
        )
    with pytest.raises(FileNotFoundError, match="--eval_data .*held_out.jsonl: no such file"):  # before the target
        main(
            [
                "train",
                "--target",
                str(tmp_path / "no_target"),
                "--data",
                str(tmp_path / "data.jsonl"),
                "--eval_data",
                str(tmp_path / "held_out.jsonl"),
            ]
        )
    with pytest.raises(FileNotFoundError, match="--config .*recipe.yml: no such file"):
        main(["train", "--config", str(tmp_path / "recipe.yml")])
    with pytest.raises(FileNotFoundError, match="--prompts .*promts.jsonl: no such file or folder"):
        main(["generate-data", "--target", "t", "--prompts", str(tmp_path / "promts.jsonl"), "--output", "o.jsonl"])

    output = str(tmp_path / "out.jsonl")
    (tmp_path / "no_prompts.jsonl").write_text("\n")
    (tmp_path / "no_prompts.json").write_text("")
    for prompts, message in (("no_prompts.jsonl", "holds no prompt"), ("no_prompts.json", "holds no JSON array")):
        with pytest.raises(ValueError, match=f"{prompts} {message}"):  # not a run that writes nothing
            main(
                ["generate-data", "--target", tiny_target_dir, "--prompts", str(tmp_path / prompts), "--output", output]
            )
    assert not os.path.exists(output)
    prompts = str(tmp_path / "prompts.jsonl")
    _write_jsonl(prompts, [{"prompt": "hello"}])
    (tmp_path / "empty").mkdir()
    result = _run(
        [DOMINO_SPEC, "generate-data", "--target", str(tmp_path / "empty"), "--prompts", prompts, "--output", output]
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()  # not a missing tokenizer library
    assert line.startswith(
        f"domino-spec generate-data: error: target {tmp_path / 'empty'} holds no model: it has no "
        "config.json, no weights (model.safetensors or "
    ), line
    assert "no tokenizer files (tokenizer.json or " in line
    (tmp_path / "random_files").mkdir()
    (tmp_path / "random_files" / "notes.txt").write_text("not a model")
    tiny_target("llama").save_pretrained(tmp_path / "model_only")
    for folder, missing in (("random_files", "no config.json, no weights"), ("model_only", "no tokenizer files")):
        with pytest.raises(FileNotFoundError, match=f"{folder} holds no model: it has {missing} \\("):
            main(["generate-data", "--target", str(tmp_path / folder), "--prompts", prompts, "--output", output])


def test_a_missing_asset_package_ends_in_one_line_unless_the_traceback_is_asked_for(tmp_path, monkeypatch, capsys):
    from domino_spec import assets
    from domino_spec.cli import run

    monkeypatch.setattr(assets, "CACHE_DIR", str(tmp_path))  # not converted yet: its GGUF package is needed
    absent = assets.GGUFTarget("absent.gguf", "0" * 64, "org/absent", ("absent-asset==1.0",), "absent_asset")
    monkeypatch.setitem(assets.TARGETS, "absent", absent)
    (tmp_path / "data.jsonl").write_text("")
    argv = ["domino-spec", "train", "--target", "absent", "--data", str(tmp_path / "data.jsonl")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        run()
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "domino-spec train: error: the package providing `absent_asset` is not installed: run `pip install --no-deps "
        "absent-asset==1.0` (DOMINO_SPEC_TRACEBACK=1 shows where)\n"
    )
    monkeypatch.setenv("DOMINO_SPEC_TRACEBACK", "1")
    with pytest.raises(assets.MissingAssetError):
        run()


def test_regeneration_resumes_after_kill(tmp_path, tiny_target_dir):
    prompts = [{"id": f"p{i}", "prompt": f"question number {i}?"} for i in range(12)]
    _write_jsonl(tmp_path / "prompts.jsonl", prompts)
    output = tmp_path / "data.jsonl"
    command = [DOMINO_SPEC, "generate-data", "--target", tiny_target_dir, "--prompts", str(tmp_path / "prompts.jsonl")]
    command += ["--output", str(output), "--batch-size", "1", "--max-new-tokens", "48"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not output.exists() or output.read_text().count("\n") < 3):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written_before = output.read_text().count("\n")
    assert 3 <= written_before < len(prompts), "the kill should land mid-run"
    with open(output, "a", encoding="utf-8") as file:
        file.write('{"id": "p99", "respo')  # a line cut by the kill
    result = _run(command)
    assert result.returncode == 0, result.stderr
    ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    assert sorted(ids) == sorted(p["id"] for p in prompts)  # none lost, none twice, the cut line gone


def test_kept_responses_are_each_conversations_first_answer_and_train_on_the_targets_soft_targets(
    tmp_path, tiny_target_dir, capsys
):
    """`generate-data --keep-responses`: the first exchange of each conversation, its own answer tokenized as the chat
    template holds it (cut at --max-new-tokens), no target pass; `train` refuses it without soft targets."""
    from domino_spec.cli import main

    def conversation(record_id, *turns):
        return {"id": record_id, "conversations": [{"from": role, "value": text} for role, text in turns]}

    sharegpt = [
        conversation("a", ("human", "what is 2 + 2?"), ("gpt", "four"), ("human", "and 3 + 3?"), ("gpt", "six")),
        conversation("b", ("human", "what is 2 + 2?"), ("gpt", "4")),  # the same prompt again: dropped
        conversation("c", ("human", "no answer here")),
        conversation("d", ("system", "be brief"), ("human", "count"), ("gpt", "one two three four five six")),
        conversation("e", ("human", "empty answer"), ("gpt", "  ")),
    ]
    (tmp_path / "sharegpt.json").write_text(json.dumps(sharegpt))
    output = tmp_path / "kept.jsonl"
    command = ["generate-data", "--target", tiny_target_dir, "--prompts", str(tmp_path / "sharegpt.json")]
    main([*command, "--output", str(output), "--keep-responses", "--max-new-tokens", "12"])
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [record["id"] for record in records] == ["a", "d"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    first, second = records
    assert first["messages"] == [{"role": "user", "content": "what is 2 + 2?"}]
    assert first["prompt_ids"] == prompt_token_ids(tokenizer, first["messages"])
    assert first["response_ids"] == tokenizer("four", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert first["response"] == "four"
    assert second["messages"][0] == {"role": "system", "content": "be brief"}
    assert len(second["response_ids"]) == 12 and second["response"] == "one two thre"  # cut, no end of turn
    assert first["generation"]["responses"] == "kept" and first["generation"]["max_new_tokens"] == 12
    flags = ["--target", tiny_target_dir, "--data", str(output), "--draft_layers", "1", "--block_size", "4"]
    flags += ["--num_anchors", "4", "--report_to", "none", "--disable_tqdm", "true"]
    with pytest.raises(ValueError, match="own answers .*--soft_targets K"):
        main(["train", *flags, "--output", str(tmp_path / "refused")])
    main(["cache-features", *flags, "--output", str(tmp_path / "features"), "--soft_targets", "4"])
    flags += ["--features", str(tmp_path / "features"), "--soft_targets", "4"]
    main(["train", *flags, "--output", str(tmp_path / "draft"), "--max_steps", "1"])
    assert (tmp_path / "draft" / "model.safetensors").exists()


def test_cache_features_taps_the_layers_train_will_tap(tmp_path, tiny_target_dir):
    from domino_spec.cli import main
    from domino_spec.training.features import FeatureStore

    data = [
        {"id": f"s{i}", "prompt_ids": [3, 10 + i, 11], "response_ids": list(range(20 + i, 30 + i))} for i in range(3)
    ]
    _write_jsonl(tmp_path / "data.jsonl", data)
    flags = ["--target", tiny_target_dir, "--data", str(tmp_path / "data.jsonl"), "--draft_layers", "2"]
    main(["cache-features", *flags, "--output", str(tmp_path / "features")])
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    expected = from_target(target, num_hidden_layers=2).config.target_layer_ids
    store = FeatureStore(str(tmp_path / "features"))
    assert store.layer_ids == expected
    # its prefills ran the CPU kernels `optimize_for_cpu` planned, giving the eager target's features
    assert json.loads((tmp_path / "cpu_plans.json").read_text())
    for example, record in enumerate(data):
        input_ids = torch.tensor([record["prompt_ids"] + record["response_ids"]])
        eager = target_features(target, input_ids, None, expected).hidden
        torch.testing.assert_close(store[example].float(), eager[0].half().float(), atol=2e-3, rtol=2e-3)
    draft = tiny_draft(target, target_layer_ids=[0, 2], block_size=4)
    draft.save_pretrained(tmp_path / "draft")
    main(
        [
            "cache-features",
            "--target",
            tiny_target_dir,
            "--data",
            str(tmp_path / "data.jsonl"),
            "--init_from",
            str(tmp_path / "draft"),
            "--output",
            str(tmp_path / "features_of_draft"),
        ]
    )
    assert FeatureStore(str(tmp_path / "features_of_draft")).layer_ids == [0, 2]


def test_two_process_accelerate_run_saves_a_loadable_draft(tmp_path, tiny_target_dir):
    command, output = _tiny_train_command(tmp_path, tiny_target_dir, _two_processes())
    command += ["--ddp_backend", "gloo", "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "3"]
    result = _run(command + ["--log_level", "info"], env=TRAINING_ENVIRONMENT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Total train batch size (w. parallel, distributed & accumulation) = 4" in result.stdout + result.stderr
    assert "could not write the model card" not in result.stdout + result.stderr  # one process writes the folder
    check = (
        "from transformers import AutoModel;"
        f"m = AutoModel.from_pretrained({str(output)!r}, trust_remote_code=True);"
        "print(type(m).__name__, m.config.num_hidden_layers)"
    )
    loaded = _run([sys.executable, "-c", check], env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=str(tmp_path))
    assert loaded.stdout.split() == ["DominoDraftModel", "1"], loaded.stderr
    state = json.loads((output / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    # At lam = 1 the loss is the base loss: both logged as means over the two processes' batches, they agree.
    first = state["log_history"][0]
    assert first["lam"] == 1 and abs(first["loss"] - first["loss_base"]) < 1e-3, first


def test_a_signal_to_one_of_two_processes_stops_both_at_one_checkpoint_and_rerunning_resumes(tmp_path, tiny_target_dir):
    command, output = _tiny_train_command(tmp_path, tiny_target_dir, _two_processes())
    command += ["--ddp_backend", "gloo"]
    launcher = _started_training(
        command, stderr=subprocess.STDOUT, env={**TRAINING_ENVIRONMENT, "PYTHONFAULTHANDLER": "1"}
    )
    workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGTERM)  # as when a signal reaches one process a step before the other
    try:
        log, _ = launcher.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # the workers' Python stacks (faulthandler, on SIGABRT) say where they wait
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(worker), signal.SIGABRT)
        time.sleep(5)
        launcher.kill()
        pytest.fail("the two processes did not stop:\n" + launcher.communicate()[0][-20000:])
    stops = [line for line in log.splitlines() if "SIGTERM: saving a checkpoint at step" in line]
    assert len(stops) == 2 and stops[0] == stops[1], log[-3000:]  # both processes, the same step
    (checkpoint,) = [path for path in output.iterdir() if path.name.startswith("checkpoint-")]
    assert not (output / "model.safetensors").exists()  # no process saved a "final" draft
    assert "could not write the model card" not in log
    stopped_at = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    if version.parse(transformers.__version__) < version.parse("5.18"):
        pytest.skip(
            "transformers 5.17's Trainer restores a multi-process CPU run's optimizer state to 'cpu:N', which "
            "torch cannot load (fixed in 5.18; GPU runs map to 'cuda:N')"
        )

    result = _run(command + ["--max_steps", str(stopped_at + 1)], env=TRAINING_ENVIRONMENT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resuming from {checkpoint}" in result.stdout and (output / "model.safetensors").exists()


def test_sigterm_saves_a_checkpoint_and_rerunning_resumes_from_it(tmp_path, tiny_target_dir):
    command, output = _tiny_train_command(tmp_path, tiny_target_dir)
    process = _started_training(
        command + ["--dataloader_num_workers", "1"], stderr=subprocess.STDOUT, start_new_session=True
    )
    # As a scheduler stops a job: every process of the group, the DataLoader worker included; and the training
    # process once more while it saves (a launcher forwards the SIGTERM it got to workers that got it already).
    os.killpg(process.pid, signal.SIGTERM)
    for line in process.stdout:
        if "SIGTERM: saving a checkpoint" in line:
            process.send_signal(signal.SIGTERM)
            break
    log, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, log[-2000:]
    assert "rerun the same command to resume" in log
    (checkpoint,) = [path for path in output.iterdir() if path.name.startswith("checkpoint-")]
    stopped_at = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    assert 1 <= stopped_at < 100000 and not (output / "model.safetensors").exists()  # a checkpoint, not a final draft
    cut_short = output / f"checkpoint-{stopped_at + 1}"  # as a kill in the middle of a later save leaves it
    shutil.copytree(checkpoint, cut_short, ignore=shutil.ignore_patterns("trainer_state.json"))

    result = _run(
        command + ["--max_steps", str(stopped_at + 2), "--save_strategy", "steps", "--save_steps", "1"],
        env=TRAINING_ENVIRONMENT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resuming from {checkpoint}" in result.stdout and f"skipping {cut_short}: incomplete" in result.stderr
    final = json.loads((output / f"checkpoint-{stopped_at + 2}" / "trainer_state.json").read_text())
    assert final["global_step"] == stopped_at + 2 and (output / "model.safetensors").exists()
    assert result.stdout.count("'loss'") == 2  # the two steps after the checkpoint, not a run from step 0

    restarted = _run(command + ["--max_steps", "1", "--restart", "true"], env=TRAINING_ENVIRONMENT)
    assert restarted.returncode == 0 and "resuming" not in restarted.stdout, restarted.stderr[-2000:]
    assert "--restart: starting over" in restarted.stderr and restarted.stdout.count("'loss'") == 1


# ---------------------------------------------------------------------- precomputed target features


def test_feature_store_refuses_features_beyond_fp16(tmp_path):
    from domino_spec.training.features import FeatureStore

    _write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt_ids": [3, 10], "response_ids": list(range(20, 30))}])
    target = tiny_target("llama")
    with torch.no_grad():
        target.model.layers[0].mlp.down_proj.weight.mul_(1e7)  # activations of 1e5 and more
    with pytest.raises(ValueError, match="beyond fp16's range"):
        FeatureStore.build(target, load_training_dataset(str(tmp_path / "d.jsonl")), [1, 3], str(tmp_path / "store"))


def test_held_out_data_is_scored_during_and_after_training_with_features_from_a_store(
    tmp_path, tiny_target_dir, capsys
):
    from domino_spec.cli import main

    def records(first: int) -> list[dict]:
        return [
            {"id": f"s{i}", "prompt_ids": [3, 10 + i, 11], "response_ids": list(range(20 + i, 34 + i))}
            for i in range(first, first + 4)
        ]

    _write_jsonl(tmp_path / "data.jsonl", records(0))
    _write_jsonl(tmp_path / "held_out.jsonl", records(50))  # its indices are the store's, its tokens not
    flags = ["--target", tiny_target_dir, "--data", str(tmp_path / "data.jsonl"), "--draft_layers", "1"]
    flags += ["--block_size", "4", "--num_anchors", "4", "--report_to", "none", "--disable_tqdm", "true"]
    with pytest.raises(ValueError, match="--eval_strategy steps needs held-out data: add --eval_data"):
        main(["train", *flags, "--output", str(tmp_path / "o"), "--eval_strategy", "steps"])
    main(["cache-features", *flags, "--output", str(tmp_path / "features")])
    flags += ["--features", str(tmp_path / "features"), "--eval_data", str(tmp_path / "held_out.jsonl")]
    main(
        [
            "train",
            *flags,
            "--output",
            str(tmp_path / "draft"),
            "--max_steps",
            "4",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "2",
            "--per_device_eval_batch_size",
            "2",
            "--save_strategy",
            "steps",
            "--save_steps",
            "4",
        ]
    )
    history = json.loads((tmp_path / "draft" / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    evaluations = [entry for entry in history if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 4]
    for entry in evaluations:  # the training loss and its metrics (means over 2 batches), at the lambda of the step
        assert entry["eval_lam"] == curriculum_lambda(entry["step"], 4)
        mixed = entry["eval_lam"] * entry["eval_loss_base"] + (1 - entry["eval_lam"]) * entry["eval_loss_final"]
        assert abs(entry["eval_loss"] - mixed) < 1e-3 and entry["eval_acceptance_final"] >= 1, entry

    assert '"eval"' not in capsys.readouterr().out  # scored during training: not once more after it
    main(["train", *flags, "--output", str(tmp_path / "draft_scored_after"), "--max_steps", "1"])
    out = capsys.readouterr().out
    scores = json.loads(out[out.rindex('{\n  "eval"') :])["eval"]
    assert scores["eval_lam"] == 0 and scores["eval_loss"] > 0  # once, after the last step
    # The held-out examples' features are computed from them, not read from the store's examples of their indices.
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    draft = DominoDraftModel.from_pretrained(tmp_path / "draft_scored_after")
    held_out = load_training_dataset(str(tmp_path / "held_out.jsonl")).remove_columns("index")
    online = _trainer(tmp_path, target, draft, held_out, num_anchors=4).evaluate(held_out)
    for name in ("eval_loss_base", "eval_loss_final"):
        assert abs(online[name] - scores[name]) < 1e-3, (name, online[name], scores[name])


def test_train_on_soft_targets_from_the_command_line(tmp_path, tiny_target_dir, capsys):
    """`cache-features --soft_targets K` then `train --soft_targets K`: trained on the stored soft targets, held-out
    data scored on ones computed online, as a trainer without a store scores it."""
    from domino_spec.cli import main

    records = [
        {"id": f"s{i}", "prompt_ids": [3, 10 + i, 11], "response_ids": list(range(20 + i, 34 + i))} for i in range(8)
    ]
    _write_jsonl(tmp_path / "data.jsonl", records[:4])
    _write_jsonl(tmp_path / "held_out.jsonl", records[4:])
    flags = ["--target", tiny_target_dir, "--data", str(tmp_path / "data.jsonl"), "--draft_layers", "1"]
    flags += ["--block_size", "4", "--num_anchors", "4", "--report_to", "none", "--disable_tqdm", "true"]
    main(["cache-features", *flags, "--output", str(tmp_path / "features"), "--soft_targets", "6"])
    assert "soft targets of 6 tokens" in capsys.readouterr().out
    flags += ["--features", str(tmp_path / "features"), "--eval_data", str(tmp_path / "held_out.jsonl")]
    with pytest.raises(ValueError, match="holds soft targets of 6 tokens, training asks for 8"):
        main(["train", *flags, "--output", str(tmp_path / "refused"), "--soft_targets", "8"])
    main(["train", *flags, "--output", str(tmp_path / "draft"), "--max_steps", "2", "--soft_targets", "4"])
    out = capsys.readouterr().out
    scores = json.loads(out[out.rindex('{\n  "eval"') :])["eval"]
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    draft = DominoDraftModel.from_pretrained(tmp_path / "draft")
    held_out = load_training_dataset(str(tmp_path / "held_out.jsonl")).remove_columns("index")
    for soft_targets, expected_equal in ((4, True), (0, False)):
        online = _trainer(tmp_path, target, draft, held_out, num_anchors=4, soft_targets=soft_targets).evaluate(
            held_out
        )
        assert (abs(online["eval_loss"] - scores["eval_loss"]) < 1e-3) == expected_equal, (soft_targets, online, scores)


def test_bf16_autocast_on_cpu_trains_like_fp32_and_keeps_fp32_weights(tmp_path, tiny_target_dir):
    """The recipe's `--bf16` where the CPU computes bf16 natively: the same draft, updated the same way as in fp32,
    and saved with fp32 weights to go on training from."""
    from domino_spec.cli import main

    records = [
        {"id": f"b{i}", "prompt_ids": [3, 10 + i, 11], "response_ids": list(range(20 + i, 40 + i))} for i in range(6)
    ]
    _write_jsonl(tmp_path / "data.jsonl", records)
    flags = ["--target", tiny_target_dir, "--data", str(tmp_path / "data.jsonl"), "--draft_layers", "1", "--seed", "0"]
    flags += ["--block_size", "4", "--num_anchors", "4", "--report_to", "none", "--disable_tqdm", "true"]
    main(["train", *flags, "--output", str(tmp_path / "start"), "--max_steps", "1", "--learning_rate", "0"])
    start = DominoDraftModel.from_pretrained(tmp_path / "start").state_dict()
    updates = {}
    for precision in ("fp32", "bf16"):
        output = tmp_path / precision
        main(
            ["train", *flags, "--output", str(output), "--max_steps", "3", "--init_from", str(tmp_path / "start")]
            + (["--bf16"] if precision == "bf16" else [])
        )
        weights = DominoDraftModel.from_pretrained(output).state_dict()  # in the dtype saved
        assert all(value.dtype == torch.float32 for value in weights.values())
        updates[precision] = torch.cat([(weights[name] - start[name]).flatten() for name in start])
    assert not torch.equal(updates["bf16"], updates["fp32"])  # its matmuls did run in bf16
    assert torch.nn.functional.cosine_similarity(updates["bf16"], updates["fp32"], dim=0) > 0.99


def test_hooked_features_equal_output_hidden_states(family):
    """What training taps is what inference reads, the last layer included (transformers normalizes that one); soft
    targets are the target's own next-token distribution, cut to its likeliest tokens."""
    from domino_spec.training.features import target_features

    target = tiny_target(family)
    input_ids = torch.randint(0, 100, (2, 11))
    attention_mask = torch.ones_like(input_ids)
    for layer_ids in ([0, 2, 3], [1, target.config.num_hidden_layers - 1]):
        draft = tiny_draft(target, target_layer_ids=layer_ids)
        expected = _features(target, draft, input_ids)
        hard = target_features(target, input_ids, attention_mask, layer_ids)
        torch.testing.assert_close(hard.hidden, expected)
        assert hard.top_ids is None and hard.top_probs is None
        soft = target_features(target, input_ids, attention_mask, layer_ids, top_k=5)
        torch.testing.assert_close(soft.hidden, expected)
        probs = target(input_ids).logits.float().softmax(-1)
        assert soft.top_ids.shape == soft.top_probs.shape == (2, 11, 5)
        torch.testing.assert_close(soft.top_probs, probs.gather(-1, soft.top_ids))
        assert torch.equal(soft.top_ids[..., 0], probs.argmax(-1))
        assert (soft.top_probs[..., 4] >= probs.sort(-1, descending=True).values[..., 5]).all()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a --bf16 training step computing features online
            autocast = target_features(target, input_ids, attention_mask, layer_ids, top_k=5)
        assert autocast.hidden.dtype == torch.float32
        torch.testing.assert_close(autocast.hidden, expected)
        torch.testing.assert_close(autocast.top_probs, soft.top_probs)


def test_feature_store_trains_like_online_features_and_resumes(tmp_path):
    from domino_spec.training.features import FeatureStore, dataset_fingerprint

    records = [
        {"id": str(i), "prompt_ids": [3, 10 + i, 11], "response_ids": list(range(20 + i, 32 + i))} for i in range(5)
    ]
    _write_jsonl(tmp_path / "d.jsonl", records)
    dataset = load_training_dataset(str(tmp_path / "d.jsonl"))
    target = tiny_target("llama")
    draft = tiny_draft(target).float()
    store_dir = str(tmp_path / "store")
    store = FeatureStore.build(target, dataset.select(range(3)), draft.config.target_layer_ids, store_dir)
    with pytest.raises(ValueError, match="other training data: pass train the --data it was built from, or rebuild"):
        store.check(dataset, draft.config.target_layer_ids, target)
    # An interrupted build of the full set resumes after the examples already written.
    index = json.loads((tmp_path / "store" / "index.json").read_text())
    index["fingerprint"], index["complete"] = dataset_fingerprint(dataset), False
    (tmp_path / "store" / "index.json").write_text(json.dumps(index))
    first_example = store[0]
    store = FeatureStore.build(target, dataset, draft.config.target_layer_ids, store_dir)
    store.check(dataset, draft.config.target_layer_ids, copy.deepcopy(target).to(torch.bfloat16))  # any dtype
    assert len(store) == 5 and torch.equal(store[0], first_example)
    stored = ",".join(str(layer) for layer in draft.config.target_layer_ids)
    fix = f"`domino-spec cache-features` .* into another --output, or pass --target_layer_ids {stored} to train"
    with pytest.raises(ValueError, match=rf"taps target layers .*, the draft \[1, 2\]: rebuild it with {fix}"):
        store.check(dataset, [1, 2], target)
    with pytest.raises(ValueError, match="built by another target .*: pass train the --target it was built by"):
        store.check(dataset, draft.config.target_layer_ids, tiny_target("llama", seed=5))

    examples = [dataset[i] for i in range(len(dataset))]
    torch.manual_seed(0)
    online = DominoDataCollator(pad_token_id=0, num_anchors=4)(examples)
    torch.manual_seed(0)
    stored = DominoDataCollator(pad_token_id=0, num_anchors=4, feature_store=store)(examples)
    assert torch.equal(online["anchor_positions"], stored["anchor_positions"])
    trainer = _trainer(tmp_path, target, draft, examples, num_anchors=4)
    draft.eval()
    with torch.no_grad():
        loss_online = trainer.compute_loss(draft, online)
        loss_stored = trainer.compute_loss(draft, stored)
    torch.testing.assert_close(loss_stored, loss_online, rtol=2e-3, atol=2e-3)  # features stored in fp16


def test_soft_targets_from_a_feature_store_train_like_online_ones(tmp_path):
    """Soft targets cached with the features give the loss the target computes online; a store without them, or
    with fewer tokens, is refused with the flag that fixes it, and a store of more gives the likeliest."""
    from domino_spec.training.features import FeatureStore

    records = [
        {"id": str(i), "prompt_ids": [3, 10 + i, 11], "response_ids": list(range(20 + i, 32 + i))} for i in range(4)
    ]
    _write_jsonl(tmp_path / "d.jsonl", records)
    dataset = load_training_dataset(str(tmp_path / "d.jsonl"))
    target = tiny_target("llama")
    draft = tiny_draft(target, draft_vocab=torch.arange(0, 128, 2)).float()  # soft targets outside it drop out
    layer_ids = draft.config.target_layer_ids
    hard_store = FeatureStore.build(target, dataset, layer_ids, str(tmp_path / "hard"))
    with pytest.raises(
        ValueError,
        match=r"holds no soft targets, training asks for 4: train without --soft_targets, "
        r"or rebuild .*`domino-spec cache-features --soft_targets 4`",
    ):
        hard_store.check(dataset, layer_ids, target, top_k=4)
    with pytest.raises(ValueError, match="soft targets of 0 tokens, not 8: building this one there would discard"):
        FeatureStore.build(target, dataset, layer_ids, str(tmp_path / "hard"), top_k=8)
    store = FeatureStore.build(target, dataset, layer_ids, str(tmp_path / "soft"), top_k=8)
    store.check(dataset, layer_ids, target, top_k=4)

    examples = [dataset[i] for i in range(len(dataset))]
    torch.manual_seed(0)
    online = DominoDataCollator(pad_token_id=0, num_anchors=4)(examples)
    torch.manual_seed(0)
    stored = DominoDataCollator(pad_token_id=0, num_anchors=4, feature_store=store, soft_targets=4)(examples)
    assert stored["target_top_ids"].shape == (4, 15, 4)
    hard = _trainer(tmp_path, target, draft, examples, num_anchors=4)
    soft = _trainer(tmp_path, target, draft, examples, num_anchors=4, soft_targets=4)
    draft.eval()
    with torch.no_grad():
        loss_online = soft.compute_loss(draft, online)
        loss_stored = soft.compute_loss(draft, stored)
        loss_hard = hard.compute_loss(draft, online)
    torch.testing.assert_close(loss_stored, loss_online, rtol=2e-3, atol=2e-3)  # probabilities stored in fp16
    assert abs(loss_online.item() - loss_hard.item()) > 1e-3  # a random target is far from sure of its tokens

    # The trainer's arguments set what its collator brings, whatever the collator was built with.
    soft.data_collator = DominoDataCollator(pad_token_id=0, num_anchors=4, feature_store=store)
    assert next(iter(soft.get_train_dataloader()))["target_top_ids"].shape[-1] == 4
    hard.data_collator = DominoDataCollator(pad_token_id=0, num_anchors=4, feature_store=store, soft_targets=8)
    assert "target_top_ids" not in next(iter(hard.get_train_dataloader()))


def test_building_a_feature_store_over_another_is_refused_and_leaves_it_intact(tmp_path):
    """`cache-features --output DIR` over a store of other layers, data or target would discard it, and with it the
    resumability of every run trained on it; the same store again is a resume with nothing left to do."""
    from domino_spec.training.features import FeatureStore

    records = [{"id": str(i), "prompt_ids": [3, 10 + i], "response_ids": list(range(20 + i, 28 + i))} for i in range(3)]
    _write_jsonl(tmp_path / "d.jsonl", records)
    dataset = load_training_dataset(str(tmp_path / "d.jsonl"))
    target = tiny_target("llama")
    store_dir = tmp_path / "store"
    FeatureStore.build(target, dataset, [1, 3], str(store_dir))
    files = {name: (store_dir / name).read_bytes() for name in ("index.json", "features.bin")}
    fix = re.escape(f"pass another --output, or delete {store_dir} if nothing uses it")
    with pytest.raises(ValueError, match=rf"holds a feature store of target layers \[1, 3\], not \[0, 2\]: .*{fix}"):
        FeatureStore.build(target, dataset, [0, 2], str(store_dir))
    with pytest.raises(ValueError, match=f"holds a feature store of other training data: .*{fix}"):
        FeatureStore.build(target, dataset.select(range(2)), [1, 3], str(store_dir))
    with pytest.raises(ValueError, match=f"holds a feature store of another target .*{fix}"):
        FeatureStore.build(tiny_target("llama", seed=5), dataset, [1, 3], str(store_dir))
    assert {name: (store_dir / name).read_bytes() for name in files} == files
    FeatureStore(str(store_dir)).check(dataset, [1, 3], target)
    assert len(FeatureStore.build(target, dataset, [1, 3], str(store_dir))) == 3
    assert {name: (store_dir / name).read_bytes() for name in files} == files
    # A store that records no target cannot be checked against one: refused, naming the fix.
    index = json.loads(files["index.json"])
    del index["target"]
    (store_dir / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="records no target: recompute it with `domino-spec cache-features`"):
        FeatureStore(str(store_dir))
    with pytest.raises(ValueError, match=f"holds a feature store of an unrecorded target: .*{fix}"):
        FeatureStore.build(target, dataset, [1, 3], str(store_dir))


def test_a_store_of_grown_data_extends_the_store_of_its_first_examples(tmp_path, tiny_target_dir):
    """`cache-features --extend OLD`: the store of data that grew holds the old store's examples and the new ones,
    byte for byte what a build from scratch writes; a store of other data, layers or soft targets is refused."""
    from domino_spec.cli import main

    records = [
        {"id": str(i), "prompt_ids": [3, 10 + i], "response_ids": list(range(20 + i, 27 + 2 * i))} for i in range(5)
    ]
    _write_jsonl(tmp_path / "old.jsonl", records[:3])
    _write_jsonl(tmp_path / "grown.jsonl", records)
    flags = ["--target", tiny_target_dir, "--draft_layers", "2", "--soft_targets", "4"]
    main(["cache-features", *flags, "--data", str(tmp_path / "old.jsonl"), "--output", str(tmp_path / "old")])
    grown = [*flags, "--data", str(tmp_path / "grown.jsonl")]
    main(["cache-features", *grown, "--output", str(tmp_path / "extended"), "--extend", str(tmp_path / "old")])
    main(["cache-features", *grown, "--output", str(tmp_path / "scratch")])
    index = json.loads((tmp_path / "scratch" / "index.json").read_text())
    assert json.loads((tmp_path / "extended" / "index.json").read_text()) == index and len(index["offsets"]) == 6
    for name in ("features.bin", "top_ids.bin", "top_probs.bin"):
        assert (tmp_path / "extended" / name).read_bytes() == (tmp_path / "scratch" / name).read_bytes(), name
    _write_jsonl(tmp_path / "reordered.jsonl", records[::-1])
    refusals = {
        "data other examples, not the first 3 of --data": [*flags, "--data", str(tmp_path / "reordered.jsonl")],
        r"top_k 4, not 2": [*grown, "--soft_targets", "2"],
        r"layer_ids \[.*\], not \[0, 1\]": [*grown, "--target_layer_ids", "0,1"],
    }
    for reason, refused in refusals.items():
        with pytest.raises(ValueError, match=rf"--extend .* is not a store of the start of this data .*{reason}"):
            main(["cache-features", *refused, "--output", str(tmp_path / "refused"), "--extend", str(tmp_path / "old")])


def test_a_draft_vocabulary_trained_from_the_responses_and_narrowed_by_the_draft_vocab_command(
    tmp_path, tiny_target_dir
):
    from domino_spec.cli import main
    from domino_spec.training.data import draft_vocabulary

    flags = [*_checkpointing_train_flags(tmp_path, tiny_target_dir, records=4), "--max_steps", "2"]
    main(["train", *flags, "--draft_vocab_size", "12", "--output", str(tmp_path / "draft")])
    draft = DominoDraftModel.from_pretrained(tmp_path / "draft")
    expected = draft_vocabulary(load_training_dataset(str(tmp_path / "data.jsonl")), 12, draft.config.vocab_size)
    assert draft.draft_vocab.tolist() == expected and draft.head.embed_proj[2].weight.shape[0] == 12
    summary = json.loads((tmp_path / "draft" / "training_summary.json").read_text())
    assert math.isfinite(summary["last_logged"]["loss"]) and summary["global_step"] == 2
    main(
        [
            "draft-vocab",
            str(tmp_path / "draft"),
            str(tmp_path / "smaller"),
            "--data",
            str(tmp_path / "data.jsonl"),
            "--size",
            "6",
        ]
    )
    smaller = DominoDraftModel.from_pretrained(tmp_path / "smaller")
    assert smaller.draft_vocab.tolist() == expected[:6]
    rows = [expected.index(token) for token in expected[:6]]
    assert torch.equal(smaller.head.embed_proj[2].weight, draft.head.embed_proj[2].weight[rows])
