"""Tiny random targets and drafts, built with the real constructors; everything runs on CPU in seconds."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels (the fused head step) then run in Triton's interpreter, on CPU;
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is imported, which transformers' models do


@pytest.fixture(autouse=True)
def _kernel_plans_in_a_temporary_file(tmp_path, monkeypatch):
    """`optimize_for_cpu` keeps its plans per test, not in the home folder of whoever runs the tests."""
    monkeypatch.setenv("DOMINO_CPU_PLANS", str(tmp_path / "cpu_plans.json"))


@pytest.fixture(autouse=True)
def _draft_costs_in_a_temporary_file(tmp_path, monkeypatch):
    """Each test learns its round costs from the prior, whatever an earlier test or process stored."""
    monkeypatch.setenv("DOMINO_DRAFT_COSTS", str(tmp_path / "draft_costs.json"))


@pytest.fixture(autouse=True)
def _torch_threads_kept(monkeypatch):
    """Outputs compared across calls come from one thread count, whatever else runs on the machine
    (`threads_fitted_to_load`'s own tests turn it back on)."""
    monkeypatch.setenv("DOMINO_FIT_THREADS", "0")


def _index_1_element_scalars_in_triton_interpreter() -> None:
    """Triton's interpreter up to 3.6 (the GPU machine's) holds a kernel's int arguments as 1-element arrays and
    converts them with `int(array)`, which NumPy >= 2.4 refuses, so every `range(0, rank, ...)` loop of the fused head
    step fails there (triton-lang/triton#9171). Applies Triton's own later fix (#9172: squeeze first) to older ones."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # no Triton: its tests skip
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_scalars", False):
        return  # a Triton that no longer has this hook; or already wrapped

    def patch_tensor_squeezing_scalars(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_tensor_squeezing_scalars.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_tensor_squeezing_scalars


if os.environ.get("TRITON_INTERPRET") == "1":
    _index_1_element_scalars_in_triton_interpreter()

from transformers import (  # noqa: E402
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from domino_spec import DominoDraftModel  # noqa: E402
from domino_spec.draft_building import from_target  # noqa: E402

# Tiny models gain nothing from threads, and on a shared 2-core machine OpenMP threads fighting other processes
# slow everything down by orders of magnitude.
torch.set_num_threads(1)

TINY_TARGET_FIELDS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def tiny_target(family: str = "qwen3", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random causal LM of the given family (`qwen3`, `llama`, `qwen2` or `gemma3`) with a 128-token vocabulary."""
    torch.manual_seed(seed)
    fields = {**TINY_TARGET_FIELDS, **overrides}
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **fields))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **fields))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**fields))
    elif family == "gemma3":  # its embedding module scales the rows by sqrt(hidden): not a plain lookup
        model = Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, **fields))
    else:
        raise ValueError(f"unknown family {family!r}")
    return model.to(dtype).eval()


def tiny_draft(target, seed: int = 1, **overrides) -> DominoDraftModel:
    """A random draft for `target`: 2 layers, block 4, tapping target layers 1 and 3."""
    torch.manual_seed(seed)
    fields = dict(num_hidden_layers=2, block_size=4, target_layer_ids=[1, 3], gru_hidden_dim=32, residual_rank=16)
    fields.update(overrides)
    return from_target(target, **fields).eval()


@pytest.fixture(params=["qwen3", "llama"])
def family(request) -> str:
    return request.param


CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer():
    """A character-level tokenizer with a chat template, ids < 128 (fits the tiny targets), built offline."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    characters = sorted(set(string.printable) - set("\x0b\x0c"))
    vocab = {token: index for index, token in enumerate(specials + characters)}
    assert len(vocab) <= TINY_TARGET_FIELDS["vocab_size"]
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=specials[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def word_tokenizer():
    """An offline word-level tokenizer over the tiny vocabulary: token i reads `w{i:03d}`, decoded without spaces.

    Token 127 is `abcdef`, the probe string transformers' StopStringCriteria tokenizes to learn token texts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i:03d}": i for i in range(127)}
    vocab["abcdef"] = 127
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w000"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w000")


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (the folder is not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"domino_benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
