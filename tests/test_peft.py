"""A target wrapped in a PEFT LoRA adapter: decoding gives the wrapped model's own output; training reads its
features."""

import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from domino_spec.generation import speculative_generate
from domino_spec.training.collator import DominoDataCollator
from domino_spec.training.trainer import DominoTrainer, DominoTrainingArguments

from conftest import tiny_draft, tiny_target


def lora_target(seed: int = 3) -> PeftModel:
    """A tiny Llama with a random (non-zero) LoRA adapter, so the adapter changes its outputs and features."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "up_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(tiny_target("llama"), config).eval()


@pytest.fixture(scope="module")
def target_and_draft():
    target = lora_target()
    return target, tiny_draft(target)


def _greedy(model, input_ids, **kwargs):
    return model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12, do_sample=False, **kwargs
    )[0, input_ids.shape[1] :]


def test_check_target_accepts_the_wrapped_model(target_and_draft):
    target, draft = target_and_draft
    draft.check_target(target)
    assert draft.config.vocab_size == target.get_input_embeddings().weight.shape[0]


def test_generation_gives_the_wrapped_models_own_greedy_output(target_and_draft):
    target, draft = target_and_draft
    input_ids = torch.randint(0, 120, (1, 10), generator=torch.Generator().manual_seed(1))
    plain = _greedy(target, input_ids)
    with target.disable_adapter():
        without_lora = _greedy(target, input_ids)
    assert not torch.equal(plain, without_lora), "the adapter must matter for this test to mean anything"

    assert torch.equal(_greedy(target, input_ids, assistant_model=draft), plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = speculative_generate(target, draft, input_ids, max_new_tokens=12)
    assert torch.equal(output.sequences[0, input_ids.shape[1] :], plain)
    # The engine reads the wrapped model's forward signature, so it passes the current cache keyword.
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_training_reads_lora_features_and_leaves_target_and_adapter_unchanged(tmp_path):
    target = lora_target()
    draft = tiny_draft(target).float()
    weights_before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    assert any("lora_A" in name for name in weights_before)
    draft_before = {name: tensor.clone() for name, tensor in draft.state_dict().items()}
    examples = [{"input_ids": list(range(5 + i, 21 + i)), "loss_mask": [0] * 4 + [1] * 12} for i in range(2)]
    arguments = DominoTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        save_strategy="no",
        report_to="none",
        num_anchors=4,
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = DominoTrainer(
        model=draft,
        target=target,
        args=arguments,
        train_dataset=examples,
        data_collator=DominoDataCollator(pad_token_id=0, num_anchors=4),
    )

    input_ids = torch.randint(5, 100, (1, 16), generator=torch.Generator().manual_seed(2))
    features = trainer.target_features({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}).hidden
    with torch.no_grad():
        wrapped = draft.fuse_target_hidden_states(target(input_ids, output_hidden_states=True).hidden_states)
        with target.disable_adapter():
            base = draft.fuse_target_hidden_states(target(input_ids, output_hidden_states=True).hidden_states)
    torch.testing.assert_close(features, wrapped)
    assert not torch.allclose(features, base), "features must come from the model with its adapter"

    trainer.train()
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, weights_before[name]), f"target or adapter weight {name} changed"
    assert any(not torch.equal(t, draft_before[n]) for n, t in trainer.model.state_dict().items()), (
        "draft did not train"
    )
