"""Tests of the Domino draft model on tiny random Qwen3 / Llama / Qwen2 targets (CPU, seconds).

Shapes: B batch, N blocks, K block size (4 here), S drafts per block, T context length, D hidden, V vocabulary,
G GRU state, R rank of the logit residual.
"""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from domino_spec import DominoConfig, DominoContextCache, DominoDraftModel, assets
from domino_spec.assets import record_hub_id
from domino_spec.configuration_domino import default_target_layer_ids
from domino_spec.draft_building import from_target
from domino_spec.published_format import load_draft
from domino_spec.transformers_compat import tapped_hidden_states

from conftest import tiny_draft, tiny_target

SEQUENCE_LENGTH = 24
ANCHOR = 15  # a block anchor with context on both sides, and room for the whole block before the end
HEAD_PREFIXES = ("head.",)
DRAFT_KEYS = (
    "fc.weight",
    "hidden_norm.weight",
    "layers.0.self_attn.q_proj.weight",
    "norm.weight",
    "head.prefix_gru.weight_ih_l0",
    "head.embed_proj.0.weight",
    "head.embed_proj.2.weight",
)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request) -> torch.dtype:
    return request.param


def tolerances(dtype: torch.dtype) -> dict:
    """`assert_close` tolerances: bf16 keeps 8 significant bits; the logits here are below 1 (2 ulp at 0.5: 8e-3)."""
    if dtype == torch.bfloat16:
        return dict(atol=8e-3, rtol=1.6e-2)
    return dict(atol=1e-5, rtol=1e-5)


@dataclass
class Setup:
    """A tiny target, its draft, one random sequence and the target's tapped features of it."""

    target: PreTrainedModel
    draft: DominoDraftModel
    input_ids: torch.LongTensor  # [1, T]
    target_hidden: torch.Tensor  # [1, T, n_layers * D]

    @property
    def position_ids(self) -> torch.LongTensor:
        return torch.arange(self.input_ids.shape[1])[None]

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.target.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.target.get_output_embeddings()

    def forward(self, anchors: list[int], input_ids: torch.Tensor | None = None, target_hidden=None, **kwargs):
        """The teacher-forced training forward with one block at each of `anchors`."""
        with torch.no_grad():
            return self.draft(
                self.input_ids if input_ids is None else input_ids,
                self.target_hidden if target_hidden is None else target_hidden,
                torch.tensor([anchors]),
                self.embed_tokens,
                self.lm_head,
                **kwargs,
            )

    def cache(self, chunks: list[tuple[int, int]]) -> DominoContextCache:
        """A context cache fed the target features of `[start, end)` ranges, one `extend_context` call each."""
        cache = DominoContextCache()
        for start, end in chunks:
            self.draft.extend_context(cache, self.target_hidden[:, start:end], self.position_ids[:, start:end])
        return cache

    def draft_block(self, cache: DominoContextCache, anchor: int = ANCHOR):
        return self.draft.draft_block(
            self.input_ids[:, anchor], self.position_ids[:, anchor], cache, self.embed_tokens, self.lm_head
        )


def make_setup(family: str = "qwen3", dtype: torch.dtype = torch.float32, **draft_overrides) -> Setup:
    target = tiny_target(family, dtype=dtype)
    draft = tiny_draft(target, **draft_overrides)
    generator = torch.Generator().manual_seed(2)
    # Stay below the mask token (the last row), which never occurs in real text.
    input_ids = torch.randint(0, draft.config.mask_token_id, (1, SEQUENCE_LENGTH), generator=generator)
    with torch.no_grad():
        outputs = target(input_ids, output_hidden_states=True)
    return Setup(target, draft, input_ids, draft.fuse_target_hidden_states(outputs.hidden_states))


def changed(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether `a` and `b` differ by more than the tolerance of `dtype` (so "unchanged" checks can fail)."""
    return not torch.allclose(a.float(), b.float(), **tolerances(dtype))


# ---------------------------------------------------------------------- inference equals training


def test_context_in_rounds_equals_context_at_once(family, dtype):
    setup = make_setup(family, dtype)
    at_once = setup.draft_block(setup.cache([(0, ANCHOR)]))
    rounds = setup.draft_block(setup.cache([(0, 5), (5, 6), (6, 11), (11, ANCHOR)]))
    assert torch.equal(rounds.tokens, at_once.tokens)
    torch.testing.assert_close(rounds.logits, at_once.logits, **tolerances(dtype))


def test_a_block_of_fewer_slots_drafts_the_whole_blocks_first_tokens(family):
    setup = make_setup(family)
    whole = setup.draft_block(setup.cache([(0, ANCHOR)]))
    cache = setup.cache([(0, ANCHOR)])
    anchor, position = setup.input_ids[:, ANCHOR], setup.position_ids[:, ANCHOR]
    first = setup.draft.draft_block(anchor, position, cache, setup.embed_tokens, setup.lm_head, num_slots=3)
    assert first.tokens.shape == (1, 3) and torch.equal(first.tokens, whole.tokens[:, :3])
    torch.testing.assert_close(first.logits, whole.logits[:, :3])


def test_the_tapped_layers_alone_give_the_features_every_layer_gives(family, dtype):
    setup = make_setup(family, dtype)
    layer_ids = setup.draft.config.target_layer_ids
    with torch.no_grad():
        outputs = setup.target(setup.input_ids, output_hidden_states=tapped_hidden_states(layer_ids))
    assert torch.equal(setup.draft.fuse_target_hidden_states(outputs.hidden_states), setup.target_hidden)


def test_draft_block_equals_teacher_forced_forward(family, dtype):
    """With the drafts written in as ground truth, the training forward reproduces draft_block's logits."""
    setup = make_setup(family, dtype)
    draft = setup.draft_block(setup.cache([(0, ANCHOR)]))
    num_drafts = setup.draft.config.num_draft_tokens
    input_ids = setup.input_ids.clone()
    input_ids[:, ANCHOR + 1 : ANCHOR + 1 + num_drafts] = draft.tokens
    output = setup.forward([ANCHOR], input_ids=input_ids)
    torch.testing.assert_close(output.logits[:, 0].float(), draft.logits, **tolerances(dtype))
    # first_corrected_slot = 1: the first draft is the backbone's alone, later ones carry the head's residual.
    torch.testing.assert_close(output.base_logits[:, 0, 0].float(), draft.logits[:, 0], **tolerances(dtype))
    assert changed(output.base_logits[:, 0, 1:], output.logits[:, 0, 1:], dtype)


def test_head_forward_equals_step(family, dtype):
    """Teacher-forced `forward` (the head over a whole block) equals the slot loop (one GRU step per slot) fed the
    truth."""
    setup = make_setup(family, dtype)
    anchors = [3, 9, ANCHOR]
    output = setup.forward(anchors)
    block_size = setup.draft.config.block_size
    for index, anchor in enumerate(anchors):
        cache = setup.cache([(0, anchor)])
        position_ids = setup.position_ids[:, anchor : anchor + block_size]
        block_ids = torch.full_like(position_ids, setup.draft.config.mask_token_id)
        block_ids[:, 0] = setup.input_ids[:, anchor]
        block_embeds = setup.embed_tokens(block_ids)
        with torch.no_grad():
            hidden = setup.draft.backbone(block_embeds, position_ids, list(zip(cache.keys, cache.values)))
            draft_hidden = setup.draft._draft_slots(hidden)  # [1, S, D]
            base_logits = setup.draft.base_logits(draft_hidden, setup.lm_head)  # [1, S, V]
            truth = setup.input_ids[:, anchor + 1 :]

            def choose_truth(slot, slot_logits, truth=truth):
                return truth[:, slot], slot_logits

            tokens, logits, _ = setup.draft.head.draft(
                base_logits, draft_hidden, block_embeds[:, 0], setup.embed_tokens, None, choose=choose_truth
            )
        torch.testing.assert_close(base_logits, output.base_logits[:, index], **tolerances(dtype))
        torch.testing.assert_close(logits, output.logits[:, index], **tolerances(dtype))


def test_forward_reading_predictions_equals_greedy_draft_block(family):
    """The training-time-test forward (GRU reads greedy drafts) is exactly a greedy drafting round."""
    setup = make_setup(family)
    draft = setup.draft_block(setup.cache([(0, ANCHOR)]))
    output = setup.forward([ANCHOR], head_reads_predictions=True)
    torch.testing.assert_close(output.logits[:, 0], draft.logits, **tolerances(torch.float32))


# ---------------------------------------------------------------------- what a block sees


def test_block_ignores_target_features_from_its_anchor_on(family):
    """The anchor's own feature is unknown at inference, so the training block must not read it."""
    setup = make_setup(family)
    reference = setup.forward([ANCHOR])
    noise = 10 * torch.randn_like(setup.target_hidden)

    later = setup.target_hidden.clone()
    later[:, ANCHOR:] += noise[:, ANCHOR:]
    perturbed = setup.forward([ANCHOR], target_hidden=later)
    torch.testing.assert_close(perturbed.logits, reference.logits, atol=0, rtol=0)

    earlier = setup.target_hidden.clone()
    earlier[:, ANCHOR - 1] += noise[:, ANCHOR - 1]
    assert changed(setup.forward([ANCHOR], target_hidden=earlier).base_logits, reference.base_logits)


def test_attention_inside_a_block_is_bidirectional(family):
    """Perturbing any block position's embedding changes the hidden states and logits of every other position."""
    setup = make_setup(family)
    cache = setup.cache([(0, ANCHOR)])
    context = list(zip(cache.keys, cache.values))
    block_size = setup.draft.config.block_size
    position_ids = setup.position_ids[:, ANCHOR : ANCHOR + block_size]
    block_ids = torch.full_like(position_ids, setup.draft.config.mask_token_id)
    block_ids[:, 0] = setup.input_ids[:, ANCHOR]
    with torch.no_grad():
        block_embeds = setup.embed_tokens(block_ids)  # [1, K, D]
        reference = setup.lm_head(setup.draft.backbone(block_embeds, position_ids, context))  # [1, K, V]
        for perturbed_position in range(block_size):
            embeds = block_embeds.clone()
            embeds[:, perturbed_position] += torch.randn_like(embeds[:, perturbed_position])
            logits = setup.lm_head(setup.draft.backbone(embeds, position_ids, context))
            for position in range(block_size):
                assert changed(logits[:, position], reference[:, position]), (perturbed_position, position)


def test_blocks_never_see_each_other(family):
    """Several (even overlapping) blocks in one forward give each block's logits alone."""
    setup = make_setup(family)
    anchors = [4, 6, ANCHOR]  # blocks at 4 and 6 overlap
    together = setup.forward(anchors)
    for index, anchor in enumerate(anchors):
        alone = setup.forward([anchor])
        torch.testing.assert_close(together.logits[:, index], alone.logits[:, 0], **tolerances(torch.float32))

    # A new anchor token for the block at 6 changes that block only. The block at 4 reads position 6 as its own
    # ground truth (teacher forcing) from slot 2 on, so only its backbone logits must stay.
    input_ids = setup.input_ids.clone()
    input_ids[:, 6] = (input_ids[:, 6] + 1) % setup.draft.config.mask_token_id
    perturbed = setup.forward(anchors, input_ids=input_ids)
    assert changed(perturbed.base_logits[:, 1], together.base_logits[:, 1])
    torch.testing.assert_close(perturbed.base_logits[:, 0], together.base_logits[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(perturbed.logits[:, 2], together.logits[:, 2], atol=0, rtol=0)


# ---------------------------------------------------------------------- the head


def head_parameter_count(draft: DominoDraftModel) -> int:
    return sum(p.numel() for name, p in draft.named_parameters() if name.startswith(HEAD_PREFIXES))


def test_head_parameter_count_matches_its_formula(family):
    setup = make_setup(family)
    config = setup.draft.config
    hidden, state, rank, vocab = config.hidden_size, config.gru_hidden_dim, config.residual_rank, config.vocab_size
    gru = 3 * state * (hidden + state)  # input and recurrent weights of 3 gates, no bias
    low_rank = (hidden + state) * rank + rank * vocab
    assert head_parameter_count(setup.draft) == gru + low_rank
    without_head = tiny_draft(setup.target, use_domino_head=False)
    assert setup.draft.num_parameters() - without_head.num_parameters() == gru + low_rank


def test_without_head_final_logits_are_base_logits(family):
    setup = make_setup(family, use_domino_head=False)
    assert head_parameter_count(setup.draft) == 0
    assert setup.draft.head is None
    output = setup.forward([4, ANCHOR])
    assert torch.equal(output.logits, output.base_logits)
    draft = setup.draft_block(setup.cache([(0, ANCHOR)]))
    torch.testing.assert_close(draft.logits, output.base_logits[:, 1], **tolerances(torch.float32))


# ---------------------------------------------------------------------- checkpoints

# Runs in a fresh interpreter outside the repository: it must find everything in the checkpoint folders.
LOAD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from domino_spec import DominoContextCache  # a plain container; the model itself comes from the checkpoint

    draft_dir, target_dir, inputs_path, outputs_path = sys.argv[1:]
    config = AutoConfig.from_pretrained(draft_dir, trust_remote_code=True)
    draft = AutoModel.from_pretrained(draft_dir, trust_remote_code=True).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    inputs = torch.load(inputs_path)
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        output = draft(inputs["input_ids"], inputs["target_hidden"], inputs["anchors"], embed_tokens, lm_head)
    torch.save(
        {
            "config_class": type(config).__module__ + "." + type(config).__name__,
            "model_class": type(draft).__module__ + "." + type(draft).__name__,
            "dtype": str(draft.dtype),
            "logits": output.logits,
            "base_logits": output.base_logits,
        },
        outputs_path,
    )
    """
)


def load_in_fresh_process(draft_dir: Path, target_dir: Path, inputs: dict, workdir: Path) -> dict:
    torch.save(inputs, workdir / "inputs.pt")
    (workdir / "load.py").write_text(LOAD_SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(workdir / "hf_home")}
    env.pop("PYTHONPATH", None)
    command = [sys.executable, "load.py", str(draft_dir), str(target_dir), "inputs.pt", "outputs.pt"]
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(workdir / "outputs.pt")


def test_save_pretrained_loads_in_a_fresh_process(tmp_path):
    setup = make_setup("qwen3", torch.bfloat16)  # SGLang serves bf16 checkpoints
    draft_dir, target_dir = tmp_path / "draft", tmp_path / "target"
    setup.draft.save_pretrained(draft_dir)
    setup.target.save_pretrained(target_dir)
    anchors = torch.tensor([[4, ANCHOR]])
    inputs = {"input_ids": setup.input_ids, "target_hidden": setup.target_hidden, "anchors": anchors}
    loaded = load_in_fresh_process(draft_dir, target_dir, inputs, tmp_path)

    # The remote code copied into the checkpoint was used, not the installed package.
    assert loaded["model_class"].startswith("transformers_modules.") and loaded["model_class"].endswith(
        "modeling_domino.DominoDraftModel"
    )
    assert loaded["config_class"].endswith("configuration_domino.DominoConfig")
    assert loaded["dtype"] == "torch.bfloat16"
    reference = setup.forward([4, ANCHOR])
    assert torch.equal(loaded["logits"], reference.logits)
    assert torch.equal(loaded["base_logits"], reference.base_logits)


def test_checkpoint_holds_the_draft_only(tmp_path):
    setup = make_setup("qwen3")
    setup.draft.save_pretrained(tmp_path)
    files = {path.name for path in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_domino.py", "configuration_domino.py"} <= files
    assert not [name for name in files if name.endswith((".bin", ".pt", ".pth", ".ckpt"))]

    with safe_open(tmp_path / "model.safetensors", framework="pt") as weights:
        shapes = {key: weights.get_slice(key).get_shape() for key in weights.keys()}
    assert set(DRAFT_KEYS) <= set(shapes)
    assert not [key for key in shapes if "embed_tokens" in key or "lm_head" in key]
    assert set(shapes) == {name for name, _ in setup.draft.named_parameters()}
    assert sum(torch.Size(shape).numel() for shape in shapes.values()) == setup.draft.num_parameters()

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_domino.DominoConfig",
        "AutoModel": "modeling_domino.DominoDraftModel",
    }
    assert config["architectures"] == ["DominoDraftModel"]


# ---------------------------------------------------------------------- building from a target


def word_level_tokenizer(num_tokens: int) -> PreTrainedTokenizerFast:
    """A real (word-level) tokenizer with `num_tokens` entries, shorter than the tiny targets' 128 embedding rows."""
    vocab = {f"word{i}": i for i in range(num_tokens)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="word0")))


@pytest.mark.parametrize("target_family", ["qwen3", "qwen2", "llama"])
def test_from_target_matches_the_target(target_family):
    target = tiny_target(target_family, num_hidden_layers=12)
    draft = from_target(target, num_hidden_layers=4, block_size=4)
    config, target_config = draft.config, target.config
    assert config.hidden_size == config.target_hidden_size == target_config.hidden_size
    assert config.vocab_size == target.get_input_embeddings().weight.shape[0] == 128
    assert config.num_target_layers == 12
    assert config.num_attention_heads == target_config.num_attention_heads
    assert config.num_key_value_heads == target_config.num_key_value_heads
    assert config.head_dim == target_config.hidden_size // target_config.num_attention_heads
    assert config.rope_parameters["rope_theta"] == target_config.rope_parameters["rope_theta"]
    # Evenly spaced from layer 1 to the third from the end.
    assert config.target_layer_ids == default_target_layer_ids(12, 4) == [1, 4, 6, 9]
    # Without a tokenizer the mask is the last embedding row; with a shorter tokenizer the first row past it.
    assert config.mask_token_id == 127
    with_tokenizer = from_target(target, tokenizer=word_level_tokenizer(100))
    assert with_tokenizer.config.mask_token_id == 100
    full_tokenizer = from_target(target, tokenizer=word_level_tokenizer(128))
    assert full_tokenizer.config.mask_token_id == 127
    draft.check_target(target)


def test_from_target_follows_the_target_dtype_but_keeps_rope_in_fp32():
    """Weights in the target's dtype; RoPE frequencies in fp32 as after from_pretrained (training = serving)."""
    draft = from_target(tiny_target("qwen3", dtype=torch.bfloat16))
    assert draft.dtype == torch.bfloat16
    assert draft.rotary_emb.inv_freq.dtype == torch.float32


def test_published_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert DominoConfig(num_target_layers=36, num_hidden_layers=5).target_layer_ids == [1, 9, 17, 25, 33]


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "target_overrides, message",
    [
        (dict(hidden_size=32), r"hidden size 32 \(draft expects 64\)"),
        (dict(vocab_size=256), r"vocabulary of 256 rows \(draft expects 128\)"),
        (dict(num_hidden_layers=3), r"3 layers, too few for the draft's target_layer_ids \[1, 3\]"),
    ],
)
def test_check_target_rejects_another_target(target_overrides, message):
    draft = tiny_draft(tiny_target("qwen3"))
    with pytest.raises(ValueError, match=message):
        draft.check_target(tiny_target("qwen3", **target_overrides))


def test_check_target_warns_of_a_same_shaped_target_of_another_name():
    draft = tiny_draft(tiny_target("qwen3"))
    draft.config.target_model_name = "Qwen/Qwen3-8B"
    target = tiny_target("qwen3")
    target.name_or_path = "/models/qwen3-8b/"  # a local copy of the same model: no warning
    draft.check_target(target)
    target.name_or_path = "Qwen/Qwen3-8B-Base"
    with pytest.warns(UserWarning, match="built for Qwen/Qwen3-8B, and the target is Qwen/Qwen3-8B-Base"):
        draft.check_target(target)


def test_check_target_knows_a_converted_folder_by_the_hub_id_it_records(tmp_path):
    """A GGUF conversion is named after the asset (`targets/smollm2-135m`), not the Hub model it came from."""
    folder = tmp_path / "targets" / "tiny"
    tiny_target("qwen3").save_pretrained(folder)
    record_hub_id(str(folder), "org/Tiny-Instruct")
    target = AutoModelForCausalLM.from_pretrained(folder)
    draft = tiny_draft(tiny_target("qwen3"), target_model_name="org/Tiny-Instruct")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draft.check_target(target)
    assert tiny_draft(target).config.target_model_name == "org/Tiny-Instruct"  # a draft trained on the folder
    draft.config.target_model_name = "org/Tiny-Base"
    with pytest.warns(UserWarning, match=r"built for org/Tiny-Base, and the target is .*targets/tiny"):
        draft.check_target(target)


def test_a_folder_converted_before_hub_ids_were_recorded_gets_one_keeping_its_config_readable(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "CACHE_DIR", str(tmp_path))
    folder = tmp_path / "targets" / "smollm2-135m"
    tiny_target("qwen3").save_pretrained(folder)  # as an earlier version converted it: no `converted_from`
    (folder / "config.json").chmod(0o644)
    files = sorted(os.listdir(folder))
    assert assets.target_dir("smollm2-135m") == str(folder)  # found converted: no GGUF package needed
    config = json.loads((folder / "config.json").read_text())
    assert config["converted_from"] == assets.TARGETS["smollm2-135m"].hub_id
    # Written through a private temporary file: the config must stay readable by the other users of a shared cache.
    assert stat.S_IMODE((folder / "config.json").stat().st_mode) == 0o644
    assert sorted(os.listdir(folder)) == files


@contextmanager
def _read_only(folder: Path):
    """`folder` read-only: by its mode, or for root, whom modes do not bind, by its config's immutable attribute."""
    config = folder / "config.json"
    folder.chmod(0o555)
    immutable = False
    try:
        if os.access(folder, os.W_OK):
            immutable = shutil.which("chattr") and subprocess.run(["chattr", "+i", config]).returncode == 0
            if not immutable:
                pytest.skip("cannot make a folder read-only for this user")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", config], check=True)
        folder.chmod(0o755)


def test_recording_the_hub_id_in_a_read_only_cache_leaves_the_folder_as_it_was(tmp_path):
    """A shared cache may be read-only: the folder still loads, and drafts only warn of a name mismatch."""
    folder = tmp_path / "tiny"
    tiny_target("qwen3").save_pretrained(folder)
    files, config = sorted(os.listdir(folder)), (folder / "config.json").read_text()
    with _read_only(folder):
        record_hub_id(str(folder), "org/Tiny-Instruct")
    assert sorted(os.listdir(folder)) == files and (folder / "config.json").read_text() == config


def test_check_target_rejects_a_draft_on_another_device():
    """Without a second accelerator here, the meta device stands in for one; decoding refuses before any compute."""
    target = tiny_target("qwen3")
    draft = tiny_draft(target).to("meta")
    with pytest.raises(ValueError, match=r"the draft is on meta, the target's embedding layer is on cpu.*draft\.to\("):
        target.generate(torch.randint(0, 100, (1, 6)), assistant_model=draft, max_new_tokens=4, do_sample=False)
    assert not target.config.tie_word_embeddings  # an LM head of its own, placed apart by a device_map
    target.lm_head.to("meta")
    with pytest.raises(
        ValueError,
        match=r"the draft is on cpu, the target's embedding layer is on cpu, the target's "
        r"LM head is on meta",
    ):
        tiny_draft(target).check_target(target)


def test_target_features_without_positions_or_as_a_tuple_name_the_fix():
    setup = make_setup()
    with pytest.raises(ValueError, match="pass context_position_ids"):
        setup.draft.extend_context(DominoContextCache(), setup.target_hidden, None)
    with pytest.raises(TypeError, match=r"not a tuple: pass draft.fuse_target_hidden_states\(outputs.hidden_states\)"):
        setup.draft.extend_context(DominoContextCache(), (setup.target_hidden,), setup.position_ids)


def test_context_cache_crops_as_transformers_caches_do():
    """`crop(-n)` drops the last n slots, as transformers' cache `crop` (none for n = 0); `crop(n)` keeps the first
    n."""
    setup = make_setup()
    cache = setup.cache([(0, ANCHOR)])
    keys, mask = cache.keys[0].clone(), torch.ones(1, ANCHOR, dtype=torch.bool)
    mask[0, 3] = False
    cache.attention_mask = mask.clone()
    cache.crop(-2)
    assert cache.get_seq_length() == ANCHOR - 2 and torch.equal(cache.keys[0], keys[..., : ANCHOR - 2, :])
    cache.crop(5)
    assert cache.get_seq_length() == 5 and cache.values[0].shape[-2] == 5
    assert torch.equal(cache.keys[0], keys[..., :5, :]) and torch.equal(cache.attention_mask, mask[:, :5])
    cache.crop(9)  # longer than the cache: nothing to drop
    assert cache.get_seq_length() == 5
    cache.crop(-0)  # crop(-num_rejected) with nothing rejected
    assert cache.get_seq_length() == 5


def test_draft_block_without_context_raises():
    setup = make_setup()
    with pytest.raises(ValueError, match="draft_block needs target context"):
        setup.draft_block(DominoContextCache())


def test_draft_block_rejects_block_inputs():
    """draft_block builds the block from one anchor per row: a block (or any 2-D input) is refused, not misread."""
    setup = make_setup()
    cache = setup.cache([(0, ANCHOR)])
    block_size = setup.draft.config.block_size
    too_long = slice(ANCHOR, ANCHOR + block_size + 1)
    with pytest.raises(ValueError, match=r"one anchor token per row.*got \(1, 5\)"):
        setup.draft.draft_block(
            setup.input_ids[:, too_long], setup.position_ids[:, too_long], cache, setup.embed_tokens, setup.lm_head
        )
    assert cache.get_seq_length() == ANCHOR  # refused before touching the cache


@pytest.mark.parametrize("anchor", [-1, SEQUENCE_LENGTH])
def test_forward_rejects_anchors_outside_the_sequence(anchor):
    setup = make_setup()
    with pytest.raises(ValueError, match=r"anchor_positions must index the sequence: values in \[0, 23\]"):
        setup.forward([4, anchor])


def test_forward_rejects_an_empty_batch():
    setup = make_setup()
    anchors = torch.zeros(0, 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids must be a \[batch_size, length\] tensor .* got shape \(0, 24\)"):
        setup.draft(setup.input_ids[:0], setup.target_hidden[:0], anchors, setup.embed_tokens, setup.lm_head)


@pytest.mark.parametrize("token", [-1, 128])
def test_forward_rejects_a_token_outside_the_vocabulary(token):
    setup = make_setup()
    input_ids = setup.input_ids.clone()
    input_ids[0, ANCHOR + 1] = token
    with pytest.raises(ValueError, match=f"input_ids holds token id {token}, outside the target's vocabulary of 128"):
        setup.forward([ANCHOR], input_ids=input_ids)


def test_target_features_of_the_wrong_width_raise():
    setup = make_setup()
    narrow = setup.target_hidden[..., :-1]
    message = r"target features have width 127, expected 128 \(2 tapped layers x hidden 64\)"
    with pytest.raises(ValueError, match=message):
        setup.draft.extend_context(DominoContextCache(), narrow, setup.position_ids)
    with pytest.raises(ValueError, match=message):
        setup.forward([ANCHOR], target_hidden=narrow)


SMALL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=100,
    num_target_layers=4,
    mask_token_id=99,
)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(block_size=1), r"DominoConfig.block_size=1 is invalid: expected an integer >= 2"),
        (dict(target_layer_ids=[1, 4]), r"DominoConfig.target_layer_ids=\[1, 4\] is invalid.*\[0, 3\]"),
        (dict(target_layer_ids=[-1]), r"DominoConfig.target_layer_ids=\[-1\] is invalid"),
        (dict(target_layer_ids=[True, 3]), r"DominoConfig.target_layer_ids=\[True, 3\] is invalid"),
        (dict(hidden_size=True), r"DominoConfig.hidden_size=True is invalid: expected a positive integer"),
        (dict(use_domino_head="false"), r"DominoConfig.use_domino_head='false' is invalid: expected a boolean"),
        (dict(draft_vocab_size=101), r"DominoConfig.draft_vocab_size=101 is invalid: .* \[1, 100\]"),
        (dict(first_corrected_slot=20), r"DominoConfig.first_corrected_slot=20 is invalid: .* \[0, 16\]"),
        (
            dict(num_target_layers=2, num_hidden_layers=2),
            r"2 layers is too shallow .* 2-layer draft.*pass target_layer",
        ),
        (dict(mask_token_id=100), r"DominoConfig.mask_token_id=100 is invalid: expected a token id in \[0, 99\]"),
        (dict(num_key_value_heads=3), r"DominoConfig.num_key_value_heads=3 is invalid: expected a divisor of"),
        (dict(target_hidden_size=32), r"DominoConfig.target_hidden_size=32 is invalid: expected hidden_size=64"),
        (dict(rope_parameters="abc"), r"DominoConfig.rope_parameters='abc' is invalid: expected null or a dict with"),
        (dict(rope_parameters=5), r"DominoConfig.rope_parameters=5 is invalid: .* a positive rope_theta"),
        (dict(rope_parameters={"rope_theta": "1e6"}), r"DominoConfig.rope_parameters=\{'rope_theta': '1e6'\} is inv"),
        (dict(rms_norm_eps="1e-6"), r"DominoConfig.rms_norm_eps='1e-6' is invalid: expected a positive float"),
        (dict(rms_norm_eps=0.0), r"DominoConfig.rms_norm_eps=0.0 is invalid: expected a positive float"),
        (dict(hidden_act=3), r"DominoConfig.hidden_act=3 is invalid: expected an activation of transformers' ACT2FN"),
        (dict(hidden_act="not_an_activation"), r"DominoConfig.hidden_act='not_an_activation' is invalid: .* silu"),
    ],
)
def test_config_rejects_invalid_fields(overrides, message):
    DominoConfig(**SMALL_CONFIG)  # the base config itself is valid
    with pytest.raises(ValueError, match=message):
        DominoConfig(**{**SMALL_CONFIG, **overrides})


@pytest.mark.parametrize("field, value", [("rope_parameters", "abc"), ("rms_norm_eps", "1e-6"), ("hidden_act", 3)])
def test_a_saved_config_of_a_wrongly_typed_field_is_named_on_loading(tmp_path, field, value):
    tiny_draft(tiny_target("qwen3")).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=re.escape(f"DominoConfig.{field}={value!r} is invalid")):
        DominoDraftModel.from_pretrained(tmp_path)


def test_the_shipped_checkpoint_runs_the_root_code():
    """Its code files are links to the root files `save_pretrained` copies (the model file and what it imports), so
    a change to the model can never leave the shipped copy behind."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from domino_spec import modeling_domino
    from domino_spec.generation.demo import SHIPPED_DRAFT

    model_file = Path(modeling_domino.__file__)
    expected = {path.name for path in map(Path, [model_file, *get_relative_import_files(str(model_file))])}
    shipped = sorted(Path(SHIPPED_DRAFT).glob("*.py"))
    assert {path.name for path in shipped} == expected
    for path in shipped:
        assert path.read_bytes() == (model_file.parent / path.name).read_bytes(), path.name


def test_a_checkpoint_of_the_older_layout_loads_its_head_and_config_names(tmp_path):
    """Older folders hold the head's weights at the top level (the published names) and the published config names:
    both read, no weight left random."""
    from safetensors.torch import load_file, save_file

    draft = tiny_draft(tiny_target("qwen3"))
    draft.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({key.removeprefix("head."): value for key, value in weights.items()}, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["emb_dim"], config["pure_draft_prefix_len"] = config.pop("residual_rank"), config.pop("first_corrected_slot")
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_draft(tmp_path)  # the package converts them; the model files alone do not
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.config.to_dict().keys().isdisjoint(["emb_dim", "pure_draft_prefix_len"])
