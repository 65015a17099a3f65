"""Interop with the published Domino / z-lab DFlash checkpoint format, SGLang export, and bad checkpoint folders."""

import json
import os

import pytest
import torch
import transformers
from packaging import version
from safetensors import safe_open
from safetensors.torch import save_file

from domino_spec import DominoConfig, DominoDraftModel
from domino_spec.published_format import load_draft
from domino_spec.training import export

from conftest import tiny_draft, tiny_target
from speculative_helpers import run_offline

TINY_LAYER_FIELDS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    hidden_act="silu",
    attention_bias=False,
)


def published_domino_config(**dflash_overrides) -> dict:
    """A published Domino config.json for the tiny target, written as the published checkpoints spell it."""
    dflash_config = {
        "mask_token_id": 127,
        "target_layer_ids": [1, 3],
        "projector_type": "domino",
        "emb_dim": 16,
        "gru_hidden_dim": 32,
        "pure_draft_prefix_len": 1,
        "shift_label": True,
        **dflash_overrides,
    }
    return {
        "architectures": ["DominoDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "domino.DominoDraftModel"},
        "block_size": 4,
        "num_target_layers": 6,
        "emb_dim": 16,
        "dflash_config": dflash_config,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "torch_dtype": "float32",
        **TINY_LAYER_FIELDS,
    }


def published_dflash_config() -> dict:
    """A z-lab DFlash config.json: no head fields, one draft layer and no target_layer_ids (DFlash's default rule)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 4,
        "num_target_layers": 6,
        "dflash_config": {"mask_token_id": 127},
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        **{**TINY_LAYER_FIELDS, "num_hidden_layers": 1},
    }


def direct_draft(seed: int = 7, **overrides) -> DominoDraftModel:
    """The draft a published config describes, built directly with our constructor."""
    torch.manual_seed(seed)
    fields = dict(TINY_LAYER_FIELDS, num_target_layers=6, target_layer_ids=[1, 3], mask_token_id=127, block_size=4)
    fields.update(gru_hidden_dim=32, residual_rank=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    fields.update(overrides)
    return DominoDraftModel(DominoConfig(**fields)).eval()


PUBLISHED_KEY_LAYOUTS = {  # our key -> the layout's
    "current": lambda key: key.removeprefix("head."),
    "logit_head": lambda key: "logit_head." + key.removeprefix("head.") if key.startswith("head.") else key,
    "model_prefix": lambda key: "model." + key.removeprefix("head."),
}


def write_published_folder(folder, config: dict, state_dict: dict, layout: str = "current") -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file)
    rename = PUBLISHED_KEY_LAYOUTS[layout]
    save_file(
        {rename(key): value.contiguous() for key, value in state_dict.items()},
        os.path.join(folder, "model.safetensors"),
    )
    return str(folder)


def block_logits(draft: DominoDraftModel, target) -> torch.Tensor:
    """Teacher-forced logits `[1, N, S, V]` of three blocks of a fixed random sequence (backbone and head)."""
    input_ids = torch.randint(0, 120, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = draft.fuse_target_hidden_states(target(input_ids, output_hidden_states=True).hidden_states)
        output = draft(
            input_ids,
            features,
            torch.tensor([[3, 9, 14]]),
            target.get_input_embeddings(),
            target.get_output_embeddings(),
        )
    return output.logits


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


# ---------------------------------------------------------------------- import


@pytest.mark.parametrize("layout", list(PUBLISHED_KEY_LAYOUTS))
def test_published_domino_folder_loads_with_its_weights(tmp_path, target, layout):
    reference = direct_draft()
    folder = write_published_folder(tmp_path / "published", published_domino_config(), reference.state_dict(), layout)
    draft = load_draft(folder)
    assert draft.config.use_domino_head and draft.config.shift_label and draft.config.first_corrected_slot == 1
    assert (draft.config.gru_hidden_dim, draft.config.residual_rank, draft.config.target_layer_ids) == (32, 16, [1, 3])
    assert draft.dtype == torch.float32
    torch.testing.assert_close(block_logits(draft, target), block_logits(reference, target), rtol=0, atol=0)


def test_published_dflash_folder_loads_head_off_with_default_layers(tmp_path, target):
    reference = direct_draft(num_hidden_layers=1, use_domino_head=False, shift_label=False, target_layer_ids=[3])
    folder = write_published_folder(tmp_path / "dflash", published_dflash_config(), reference.state_dict())
    draft = load_draft(folder)
    config = draft.config
    assert not config.use_domino_head and not config.shift_label
    assert config.target_layer_ids == [6 // 2]  # DFlash's rule for a single draft layer
    assert config.num_draft_tokens == 3  # position 0 is the anchor
    assert draft.head is None
    torch.testing.assert_close(block_logits(draft, target), block_logits(reference, target), rtol=0, atol=0)


def test_published_config_with_conflicting_emb_dim_is_refused(tmp_path):
    config = published_domino_config()
    config["emb_dim"] = 8
    folder = write_published_folder(tmp_path / "bad", config, direct_draft().state_dict())
    with pytest.raises(ValueError, match="emb_dim"):
        load_draft(folder)


def test_published_shift_label_must_be_a_boolean(tmp_path):
    config = published_domino_config(shift_label="false")  # a string would read as true
    folder = write_published_folder(tmp_path / "bad", config, direct_draft().state_dict())
    with pytest.raises(ValueError, match=r"shift_label='false' is invalid: expected a boolean: true or false"):
        load_draft(folder)


def test_published_folder_honours_the_loading_options(tmp_path):
    """The options our own folders honour apply to a published one too; one it cannot use is named in a warning."""
    folder = write_published_folder(tmp_path / "published", published_domino_config(), direct_draft().state_dict())
    draft = load_draft(folder, torch_dtype=torch.float16, attn_implementation="eager")
    assert draft.dtype == torch.float16 and draft.config._attn_implementation == "eager"
    # AutoModel passes the folder's config with the caller's attn_implementation on it, and trust_remote_code.
    config = transformers.Qwen3Config(attn_implementation="eager")
    draft = load_draft(folder, config=config, trust_remote_code=True)
    assert draft.dtype == torch.float32 and draft.config._attn_implementation == "eager"
    with pytest.warns(UserWarning, match=r"ignores the from_pretrained options \['low_cpu_mem_usage'\]"):
        load_draft(folder, low_cpu_mem_usage=True)


def test_published_weights_that_do_not_match_the_config_are_named(tmp_path):
    state_dict = direct_draft().state_dict()
    del state_dict["head.embed_proj.2.weight"]
    state_dict["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    folder = write_published_folder(tmp_path / "bad", published_domino_config(), state_dict)
    with pytest.raises(ValueError, match=r"embed_proj\.2\.weight.*layers\.0\.mlp\.up_proj\.weight"):
        load_draft(folder)


# ---------------------------------------------------------------------- export


def test_sglang_export_round_trip_is_bf16_and_published(tmp_path, target):
    draft = tiny_draft(target, target_model_name="org/tiny-target")
    source = tmp_path / "ours"
    draft.save_pretrained(source)
    exported = tmp_path / "sglang"
    export.main(["--format", "sglang", str(source), str(exported)])

    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DominoDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": draft.config.mask_token_id,
        "target_layer_ids": [1, 3],
        "projector_type": "domino",
        "gru_hidden_dim": 32,
        "emb_dim": 16,
        "pure_draft_prefix_len": 1,
        "shift_label": True,
    }
    assert config["emb_dim"] == 16 and config["block_size"] == 4 and config["num_target_layers"] == 6
    assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == draft.config.rope_parameters["rope_theta"]
    with safe_open(exported / "model.safetensors", "pt") as file:
        # the published names are ours, the head's at the top level
        assert set(file.keys()) == {key.removeprefix("head.") for key in draft.state_dict()}
        assert all(file.get_tensor(key).dtype == torch.bfloat16 for key in file.keys())
    assert {"README.md", "modeling_domino.py"} <= set(os.listdir(exported))

    reloaded = load_draft(exported)
    original_bf16 = load_draft(source, dtype=torch.bfloat16)
    assert reloaded.dtype == torch.bfloat16 and reloaded.config.target_model_name == "org/tiny-target"
    torch.testing.assert_close(block_logits(reloaded, target), block_logits(original_bf16, target), rtol=0, atol=0)


def test_export_without_head_writes_the_dflash_layout(tmp_path, target):
    draft = tiny_draft(target, use_domino_head=False, shift_label=False)
    draft.save_pretrained(tmp_path / "ours")
    export.export_sglang(str(tmp_path / "ours"), str(tmp_path / "sglang"))
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": draft.config.mask_token_id, "target_layer_ids": [1, 3]}
    reloaded = load_draft(tmp_path / "sglang")
    assert not reloaded.config.use_domino_head and not reloaded.config.shift_label
    original_bf16 = load_draft(tmp_path / "ours", dtype=torch.bfloat16)
    torch.testing.assert_close(block_logits(reloaded, target), block_logits(original_bf16, target), rtol=0, atol=0)


def test_export_refuses_what_sglang_would_misread(tmp_path, target):
    tiny_draft(target, use_domino_head=False, shift_label=True).save_pretrained(tmp_path / "ours")
    with pytest.raises(ValueError, match="shift_label"):
        export.export_sglang(str(tmp_path / "ours"), str(tmp_path / "sglang"))


def test_unknown_export_format_lists_the_supported_ones(tmp_path, capsys):
    with pytest.raises(SystemExit):
        export.main(["--format", "vllm", str(tmp_path), str(tmp_path / "out")])
    assert "unknown --format 'vllm'; supported formats: sglang" in capsys.readouterr().err


def test_remote_code_loading_in_a_fresh_process(tmp_path, target):
    """save_pretrained copies the root files the model imports; AutoModel loads ours from its own code. The export's
    folder loads with the package's `load_draft`; the model files alone refuse its published config, naming that."""
    draft = tiny_draft(target)
    draft.save_pretrained(tmp_path / "ours")
    assert {
        "configuration_domino.py",
        "modeling_domino.py",
        "head_domino.py",
        "generation_domino.py",
        "drafting.py",
        "cache_domino.py",
        "transformers_compat.py",
    } <= set(os.listdir(tmp_path / "ours"))
    assert not {"published_format.py", "head_step_triton.py"} & set(os.listdir(tmp_path / "ours"))
    export.export_sglang(str(tmp_path / "ours"), str(tmp_path / "sglang"))
    script = (
        "import sys\n"
        "from transformers import AutoModel\n"
        "from domino_spec.published_format import load_draft\n"
        "model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "print(type(model).__name__, type(model).__module__.startswith('transformers_modules'), model.dtype)\n"
        "model = load_draft(sys.argv[2])\n"
        "print(type(model).__name__, type(model).__module__.startswith('transformers_modules'), model.dtype)\n"
        "try:\n"
        "    AutoModel.from_pretrained(sys.argv[2], trust_remote_code=True)\n"
        "except ValueError as error:\n"
        "    print('refused', 'load_draft' in str(error))\n"
    )
    result = run_offline(script, str(tmp_path / "ours"), str(tmp_path / "sglang"), cwd=tmp_path)
    lines = result.stdout.split("\n")
    assert lines[:2] == ["DominoDraftModel True torch.float32", "DominoDraftModel False torch.bfloat16"]
    # transformers 5.17 refuses a remote model class for a config whose model_type is a built-in one ("qwen3", as the
    # published format requires) before our code runs; from 5.24 our config names the fix.
    if version.parse(transformers.__version__) >= version.parse("5.24"):
        assert lines[2] == "refused True", result.stdout + result.stderr[-3000:]


def test_the_model_class_alone_refuses_a_published_folder_naming_the_fix(tmp_path):
    folder = write_published_folder(tmp_path / "published", published_domino_config(), direct_draft().state_dict())
    with pytest.raises(ValueError, match=r"published Domino / DFlash checkpoint.*published_format\.load_draft"):
        DominoDraftModel.from_pretrained(folder)


# ---------------------------------------------------------------------- bad folders


@pytest.fixture
def saved_draft(tmp_path, target):
    folder = tmp_path / "draft"
    tiny_draft(target).save_pretrained(folder)
    return folder


def test_missing_config_is_named(saved_draft):
    os.remove(saved_draft / "config.json")
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        load_draft(saved_draft)


def test_missing_weights_are_named(saved_draft):
    os.remove(saved_draft / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no weights file \(model\.safetensors"):
        load_draft(saved_draft)


@pytest.mark.parametrize("keep_bytes", [40, -100])
def test_truncated_safetensors_is_named(saved_draft, keep_bytes):
    path = saved_draft / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep_bytes])
    with pytest.raises(ValueError, match=rf"{path}.*truncated or corrupt"):
        load_draft(saved_draft)


def test_unknown_checkpoint_format_lists_the_supported_ones(tmp_path):
    folder = write_published_folder(
        tmp_path / "llama", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, {}
    )
    with pytest.raises(
        ValueError, match="not a Domino draft checkpoint.*Supported formats: native.*published-domino.*dflash"
    ):
        load_draft(folder)
    config = published_domino_config(projector_type="dspark")
    folder = write_published_folder(tmp_path / "dspark", config, direct_draft().state_dict())
    with pytest.raises(ValueError, match="projector_type='dspark'.*Supported formats"):
        load_draft(folder)


def test_draft_for_another_target_names_both(tmp_path):
    draft = tiny_draft(tiny_target("qwen3"), target_model_name="org/target-a")
    other = tiny_target("qwen3", vocab_size=256)
    other.name_or_path = "org/target-b"
    with pytest.raises(ValueError, match="built for org/target-a, but the target org/target-b has vocabulary of 256"):
        draft.check_target(other)
