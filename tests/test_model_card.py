"""Model cards: Hub metadata, usage, training details and the acceptance table; written on save and by `card`."""

import json
import subprocess
import sys

from huggingface_hub import ModelCard

from domino_spec.cli import main as cli_main
from domino_spec.training import export, model_card
from domino_spec.training.collator import DominoDataCollator
from domino_spec.training.trainer import DominoTrainer, DominoTrainingArguments

from conftest import tiny_draft, tiny_target

BENCH = {
    "results": [
        {
            "eval_set": "gsm-symbolic",
            "method": "plain",
            "mean_acceptance_length": 1.0,
            "tokens_per_s": 50.0,
            "speedup": 1.0,
            "identical": 5,
            "prompts": 5,
        },
        {
            "eval_set": "gsm-symbolic",
            "method": "domino",
            "mean_acceptance_length": 3.25,
            "tokens_per_s": 120.5,
            "speedup": 2.41,
            "speedup_over_eager": 3.02,
            "drafts_per_round": 4.5,
            "looked_up_fraction": 0.25,
            "identical": 5,
            "prompts": 5,
        },
    ],
    "config": {
        "prompts": {"gsm-symbolic": 5},
        "max_new_tokens": 256,
        "greedy": True,
        "methods": ["plain", "prompt-lookup", "domino"],
        "method_descriptions": {"plain": "the target alone", "domino": "the Domino draft in the native engine"},
    },
    "machine": {"device": "cpu"},
    "versions": {"transformers": "5.24.0"},
}


def _draft_folder(tmp_path, **overrides):
    folder = tmp_path / "draft"
    tiny_draft(tiny_target("qwen3"), **overrides).save_pretrained(folder)
    return folder


def test_card_has_metadata_usage_training_and_acceptance(tmp_path):
    folder = _draft_folder(tmp_path, target_model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    (folder / "bench_results.json").write_text(json.dumps(BENCH))
    summary = {"global_step": 100, "learning_rate": 6e-4, "datasets": ["org/prompts"], "last_logged": {"loss": 1.5}}
    path = model_card.write_model_card(str(folder), training=summary, repo_id="me/smollm2-domino")

    card = ModelCard.load(path)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (card.data.library_name, card.data.pipeline_tag, card.data.license) == (
        "transformers",
        "text-generation",
        "apache-2.0",
    )
    assert card.data.tags == ["speculative-decoding", "domino", "dflash"] and card.data.datasets == ["org/prompts"]
    text = card.text
    assert 'AutoModel.from_pretrained("me/smollm2-domino", trust_remote_code=True' in text
    assert "assistant_model=draft" in text and "speculative_generate(\n    target, draft" in text
    # SGLang cannot serve our own format: the card points it at the exported folder.
    assert "--speculative-algorithm DFLASH" in text and "--speculative-draft-model-path OUT" in text
    assert "domino-spec export --format sglang DRAFT_DIR OUT" in text
    assert "| gsm-symbolic | domino | 3.25 | 4.50 | 0.25 | 120.50 | 2.41x | 3.02x | 5/5 |" in text
    assert "at most 256 new tokens, the first 5 prompts of each set" in text
    assert "Methods: plain (the target alone), prompt-lookup, domino (the Domino draft in the native engine)." in text
    assert "| global_step | 100 |" in text and "| last logged loss | 1.5 |" in text
    assert 'draft.push_to_hub("me/smollm2-domino")' in text
    assert json.loads((folder / "training_summary.json").read_text())["global_step"] == 100


def test_card_states_every_training_session_and_its_snippets_are_formatted(tmp_path):
    """A warm-started draft's own run counts only its session's steps: the card adds the totals of its learning curve,
    and its code is formatted as the repository's (the test command checks the shipped card with ruff)."""
    folder = _draft_folder(tmp_path, target_model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    curve = {"step": 7500, "examples": 15000, "cpu_hours": 1.42, "results": "curves/learning_curve.json"}
    path = model_card.write_model_card(str(folder), training={"global_step": 2500, "curve": curve})
    text = ModelCard.load(path).text
    assert "| global_step | 2500 |" in text and "| steps, all sessions | 7500 |" in text
    assert "| training examples seen, all sessions | 15000 |" in text
    assert "| CPU-hours of training, all sessions | 1.42 |" in text
    assert "| learning curve | `curves/learning_curve.json` |" in text and "| curve |" not in text
    ruff = subprocess.run([sys.executable, "-m", "ruff", "format", "--diff", path], capture_output=True, text=True)
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr


def test_card_of_an_exported_folder_says_to_upload_it_as_is(tmp_path):
    """`push_to_hub` of a draft loaded from an exported folder would save our own format, which SGLang cannot serve."""
    folder = _draft_folder(tmp_path)
    own = model_card.build_model_card(str(folder)).text
    assert 'draft.push_to_hub("your-name/your-draft")' in own and "transformers 5.24" not in own
    export.export_sglang(str(folder), str(tmp_path / "sglang"))
    exported = ModelCard.load(tmp_path / "sglang" / "README.md").text
    assert "push_to_hub(" not in exported and "upload it as is" in exported
    assert "--speculative-draft-model-path DRAFT_REPO_OR_DIR" in exported
    assert "`domino-spec card DRAFT_DIR --push-to-hub your-name/your-draft`" in exported
    assert 'upload_folder(folder_path="DRAFT_DIR", repo_id="your-name/your-draft")' in exported
    assert 'draft = load_draft("DRAFT_REPO_OR_DIR", dtype=target.dtype)' in exported
    assert "trust_remote_code" not in exported  # the model code refuses the published format


def test_local_target_is_not_claimed_as_base_model(tmp_path):
    folder = _draft_folder(tmp_path, target_model_name=str(tmp_path))
    card = model_card.build_model_card(str(folder))
    assert card.data.base_model is None and "## Acceptance" not in card.text and "## Training" not in card.text


def test_trainer_writes_the_card_into_its_output_folder(tmp_path):
    target = tiny_target("qwen3")
    target.name_or_path = "org/tiny-target"
    draft = tiny_draft(target).float()
    examples = [{"input_ids": list(range(5, 21)), "loss_mask": [0] * 4 + [1] * 12}] * 2
    arguments = DominoTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=1,
        save_strategy="no",
        report_to="none",
        num_anchors=4,
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = DominoTrainer(
        model=draft,
        target=target,
        args=arguments,
        train_dataset=examples,
        data_collator=DominoDataCollator(pad_token_id=0, num_anchors=4),
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    card = ModelCard.load(tmp_path / "final" / "README.md")
    assert card.data.base_model == "org/tiny-target"
    summary = json.loads((tmp_path / "final" / "training_summary.json").read_text())
    assert summary["global_step"] == 1 and summary["num_anchors"] == 4 and "loss" in summary["last_logged"]


def test_card_command_writes_and_pushes_through_huggingface_hub(tmp_path, monkeypatch):
    folder = _draft_folder(tmp_path)
    bench = tmp_path / "bench_results.json"
    bench.write_text(json.dumps(BENCH))
    calls = []
    monkeypatch.setattr(model_card.HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id)))
    monkeypatch.setattr(
        model_card.HfApi, "upload_folder", lambda self, **kw: calls.append(("upload", kw["repo_id"], kw["folder_path"]))
    )
    cli_main(["card", str(folder), "--bench", str(bench), "--push-to-hub", "me/draft", "--license", "mit"])
    card = ModelCard.load(folder / "README.md")
    assert card.data.license == "mit" and "| gsm-symbolic | plain |" in card.text
    assert calls == [("create", "me/draft"), ("upload", "me/draft", str(folder))]


def test_pushing_a_train_output_folder_uploads_the_draft_and_never_a_pickle(tmp_path, monkeypatch):
    """A `domino-spec train` output folder also holds Trainer's `training_args.bin` (a pickle holding `--hub_token` in
    clear text), resume state and checkpoint-N folders: the upload is an allowlist of the draft's root files."""
    import torch
    from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS
    from huggingface_hub.utils import filter_repo_objects
    from transformers import TrainingArguments

    fake_token = "hf_FAKEtokenThatMustNeverBeUploaded"
    folder = _draft_folder(tmp_path)
    (folder / "bench_results.json").write_text(json.dumps(BENCH))
    model_card.write_model_card(str(folder), training={"global_step": 2})
    draft_files = {path.name for path in folder.iterdir()}
    expected = {"README.md", "config.json", "model.safetensors", "modeling_domino.py", "training_summary.json"}
    assert expected <= draft_files
    # What Trainer writes next to the draft: the pickled arguments (token included), resume state, checkpoints.
    torch.save(TrainingArguments(output_dir=str(tmp_path / "run"), hub_token=fake_token), folder / "training_args.bin")
    assert fake_token.encode() in (folder / "training_args.bin").read_bytes()
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "extra_state.pkl"):
        (folder / name).write_text(fake_token)
    (folder / "checkpoint-1").mkdir()
    for name in ("model.safetensors", "config.json", "trainer_state.json", "training_args.bin", "optimizer.pt"):
        (folder / "checkpoint-1" / name).write_text(fake_token)
    uploads = []

    def upload_folder(self, folder_path, repo_id, allow_patterns=None, ignore_patterns=None, **kwargs):
        # The files huggingface_hub's upload_folder would send: its own listing and pattern filter.
        files = [path.relative_to(folder_path).as_posix() for path in sorted(folder.glob("**/*")) if path.is_file()]
        ignored = list(ignore_patterns or []) + DEFAULT_IGNORE_PATTERNS
        uploads.append(list(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignored)))

    monkeypatch.setattr(model_card.HfApi, "create_repo", lambda self, repo_id, **kw: None)
    monkeypatch.setattr(model_card.HfApi, "upload_folder", upload_folder)
    cli_main(["card", str(folder), "--push-to-hub", "me/draft"])
    (uploaded,) = uploads
    assert set(uploaded) == draft_files
    assert not [name for name in uploaded if fake_token.encode() in (folder / name).read_bytes()]
