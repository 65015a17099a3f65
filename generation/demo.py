"""`domino-spec demo`: stream an answer with speculative decoding and report acceptance and speedup."""

import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, TextStreamer

from ..modeling_domino import DominoDraftModel


def run_tiny_demo(max_new_tokens: int = 64, seed: int = 0) -> None:
    """Self-contained check that needs nothing downloaded: random tiny target and draft, greedy decoding."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    target = Qwen3ForCausalLM(config).eval()
    draft = DominoDraftModel.from_target(target, num_hidden_layers=1, block_size=8).eval()
    prompt = torch.randint(0, 250, (1, 12))
    start = time.perf_counter()
    plain = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
    plain_time = time.perf_counter() - start
    start = time.perf_counter()
    speculative = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft)
    speculative_time = time.perf_counter() - start
    same = torch.equal(plain, speculative)
    print(f"tiny random target, random draft: {speculative.shape[1] - prompt.shape[1]} tokens")
    print(f"identical to plain greedy decoding: {same}")
    print(f"plain {plain_time:.2f}s, Domino {speculative_time:.2f}s (an untrained draft accepts little)")
    if not same:
        raise SystemExit("speculative output differs from plain decoding")
