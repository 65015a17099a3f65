"""The fused head step (`fuse_head_step(draft)`, one Triton kernel per slot) drafts what the unfused pooled loop
drafts. Without CUDA the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_head_loop import _target_and_draft

from domino_spec import DraftingOptions
from domino_spec.generation import compile_drafting, fuse_head_step, speculative_generate
from domino_spec.generation import fused_head_step as head_step_triton

from speculative_helpers import draft_from_scratch

pytest.importorskip("triton", reason="the fused head step is a Triton kernel")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def target_and_draft():
    return _target_and_draft(DEVICE)


def _fused_and_unfused(draft, target, input_ids, pool, **options):
    draft.drafting_options = DraftingOptions(candidate_pool=pool, **options)
    unfused = draft_from_scratch(draft, target, input_ids)
    return draft_from_scratch(fuse_head_step(draft), target, input_ids), unfused


@pytest.mark.parametrize("pool", [1, 5, 128])
@pytest.mark.parametrize("first_corrected", [0, 1, 6])
def test_fused_step_drafts_the_unfused_tokens_and_logits(target_and_draft, pool, first_corrected):
    target, draft = target_and_draft
    draft.head.first_corrected_slot = first_corrected
    fused, unfused = _fused_and_unfused(draft, target, torch.randint(0, 128, (3, 14), device=DEVICE), pool)
    assert torch.equal(fused.tokens, unfused.tokens)
    torch.testing.assert_close(fused.logits, unfused.logits)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the autotuner picks the config")
@pytest.mark.parametrize("launch", head_step_triton.LAUNCH_CONFIGS, ids=lambda config: "-".join(map(str, config)))
def test_every_launch_config_drafts_the_unfused_tokens_and_logits(launch, monkeypatch):
    """Each config the autotuner may pick, at a GRU state and rank that span several chunks with a remainder."""
    monkeypatch.setattr(head_step_triton, "LAUNCH_CONFIGS", (launch,))  # the interpreter runs the first
    target, draft = _target_and_draft(DEVICE, gru_hidden_dim=260, residual_rank=70, first_corrected_slot=1)
    fused, unfused = _fused_and_unfused(draft, target, torch.randint(0, 128, (1, 10), device=DEVICE), 5)
    assert torch.equal(fused.tokens, unfused.tokens)
    torch.testing.assert_close(fused.logits, unfused.logits)


def test_fused_step_without_the_gate_table_projects_each_pool_token(target_and_draft):
    target, draft = target_and_draft
    input_ids = torch.randint(0, 128, (2, 11), device=DEVICE)
    fused, unfused = _fused_and_unfused(draft, target, input_ids, 8, gate_table_max_bytes=0)
    assert "gate_table" not in draft.head.derived
    assert torch.equal(fused.tokens, unfused.tokens)
    torch.testing.assert_close(fused.logits, unfused.logits)


def test_fused_step_is_lossless_in_greedy_decoding(target_and_draft):
    target, draft = target_and_draft
    draft.drafting_options = DraftingOptions(candidate_pool=4)
    fuse_head_step(draft)
    for seed in range(3):
        input_ids = torch.randint(0, 100, (1, 5 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        input_ids = input_ids.to(DEVICE)
        expected = target.generate(input_ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
        output = speculative_generate(target, draft, input_ids, max_new_tokens=20, eos_token_id=[])
        assert torch.equal(output.sequences, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_fused_step_on_cpu_without_the_interpreter_names_the_fix(target_and_draft, monkeypatch):
    target, draft = target_and_draft
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="draft without fuse_head_step there"):
        fuse_head_step(draft)
    assert "_greedy_head" not in draft.__dict__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile runs user Triton kernels on GPUs only")
def test_compiled_fused_step_drafts_the_eager_fused_tokens(target_and_draft):
    target, draft = target_and_draft
    draft.drafting_options = DraftingOptions(candidate_pool=8)
    fuse_head_step(draft)
    contexts = [torch.randint(0, 128, (2, n), device=DEVICE) for n in (9, 14)]
    eager = [draft_from_scratch(draft, target, input_ids) for input_ids in contexts]
    compile_drafting(draft)
    try:
        for input_ids, expected in zip(contexts, eager):
            compiled = draft_from_scratch(draft, target, input_ids)
            assert torch.equal(compiled.tokens, expected.tokens)
            torch.testing.assert_close(compiled.logits, expected.logits, rtol=1e-4, atol=1e-4)
    finally:
        compile_drafting(draft, None)
        torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the autotuner times launches on GPUs only")
def test_autotuner_picks_one_of_the_launch_configs_per_shape(target_and_draft):
    target, draft = target_and_draft
    draft.drafting_options = DraftingOptions(candidate_pool=6)
    draft_from_scratch(fuse_head_step(draft), target, torch.randint(0, 128, (1, 9), device=DEVICE))
    tuned = head_step_triton.tuned_launch_configs().items()
    picks = {key: config for key, config in tuned if key.startswith("32, 16, 6, ")}  # G, R, pool of this draft
    assert len(picks) == 3  # slot 0 (STEP only), the slots in between (PICK and STEP), the last (PICK only)
    assert set(picks.values()) <= set(head_step_triton.LAUNCH_CONFIGS)


# torch.compile of the fused greedy head as `compile_drafting` runs it on an H100/H200, through functionalization (what
# inductor receives), without a GPU. Two stand-ins, in their own process: dynamo makes Triton kernels graph nodes only
# where it finds a GPU, and torch reads which arguments a kernel writes from its Triton IR for the current target (a
# driver that names sm_90). Prints, per kernel node of the one graph, the arguments torch.compile treats as written.
CAPTURE_FOR_SM90 = """
import json
import torch
import torch.utils._triton
import triton
from conftest import tiny_draft, tiny_target
from torch._dynamo.backends.common import aot_autograd
from triton.backends.compiler import GPUTarget
from domino_spec import DraftingOptions
from domino_spec.generation.fused_head_step import fused_greedy_head


class SM90Driver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class Captured(Exception):
    pass


triton.runtime.driver.set_active(SM90Driver())
torch.utils._triton.has_triton = lambda: True
graphs = []


def capture(graph, example_inputs):
    graphs.append(graph)
    raise Captured  # nothing runs: the kernel has no CPU backend


target = tiny_target("qwen3")
draft = tiny_draft(target, block_size=6)
weights = draft.head.weights(target.get_input_embeddings(), None, torch.float32, DraftingOptions(candidate_pool=5))
size, vocab = draft.config.hidden_size, draft.config.vocab_size
inputs = (torch.randn(2, 6, vocab), torch.randn(2, 6, size), torch.randn(2, size), weights, 1, 5)
head = torch.compile(fused_greedy_head, backend=aot_autograd(fw_compiler=capture), fullgraph=True, dynamic=False)
try:
    with torch.no_grad():
        head(*inputs)
except torch._dynamo.exc.BackendCompilerFailed as error:
    assert isinstance(error.inner_exception, Captured), error
(graph,) = graphs
kernels = [node for node in graph.graph.nodes if "triton_kernel_wrapper" in str(node.target)]
print(json.dumps([sorted(node.kwargs["tensors_to_clone"]) for node in kernels]))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the compiled fused step runs for real (test above)")
def test_torch_compile_captures_one_kernel_per_slot_that_writes_only_its_outputs():
    """The fused head is one graph with one kernel per slot, and torch.compile copies none of the pool's tensors."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    environment["TRITON_INTERPRET"] = "0"  # conftest's default would be the interpreter, which dynamo cannot capture
    environment["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", CAPTURE_FOR_SM90],
        env=environment,
        cwd=os.path.dirname(__file__),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written_per_slot = json.loads(result.stdout.splitlines()[-1])
    first_corrected, num_slots = 1, 6
    expected = []
    for slot in range(num_slots):
        picked = ["pool_logits_ptr", "tokens_ptr"] if slot >= first_corrected else []
        stepped = ["next_projected_ptr", "next_state_ptr"] if slot + 1 < num_slots else []
        expected.append(sorted(picked + stepped))
    assert written_per_slot == expected


# Compiles every variant of the kernel (PICK x STEP x launch config) for an H100/H200 (sm_90) with the ptxas bundled in
# Triton, in a process without TRITON_INTERPRET, for a pool of 64 (BLOCK_K): bf16 with every launch config, fp32 with
# the first. Prints one line per variant: dtype, PICK, STEP, config index and the stack bytes (register spills) of the
# cubin, read with Triton's cuobjdump.
COMPILE_FOR_SM90 = """
import re
import subprocess
import tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from domino_spec.generation import fused_head_step as head_step_triton

kernel = head_step_triton._head_step_kernel
names = kernel.arg_names
for dtype, configs in (("bf16", head_step_triton.LAUNCH_CONFIGS), ("fp32", head_step_triton.LAUNCH_CONFIGS[:1])):
    for index, config in enumerate(configs):
        for pick in (True, False):
            for step in (True, False):
                signature = {name: "i32" for name in names}
                signature.update({name: f"*{dtype}" for name in names if name.endswith("_ptr")})
                signature.update(tokens_ptr="*i64", pool_ids_ptr="*i64")
                constants = dict(PICK=pick, STEP=step, BLOCK_K=64, **head_step_triton._constexprs(config))
                signature.update({name: "constexpr" for name in constants})
                constexprs = {(names.index(name),): value for name, value in constants.items()}
                source = ASTSource(kernel, signature, constexprs)
                options = dict(num_warps=config.num_warps)
                compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
                with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                    cubin.write(compiled.asm["cubin"])
                    cubin.flush()
                    command = [triton.knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name]
                    usage = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                print(dtype, pick, step, index, re.search(r"STACK:(\\d+)", usage).group(1))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the tests above compile it for the GPU at hand")
def test_kernel_compiles_for_an_h100_without_a_gpu_and_no_launch_config_spills_registers():
    """Triton's interpreter accepts code its GPU compiler refuses: compile the kernel for sm_90 without a GPU. A config
    that spills registers to memory would lose to the others when tuned, and is no use as a candidate."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    environment["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default so far; set, it silences Triton 3.9's warning
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=environment, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    variants = [line.split() for line in result.stdout.splitlines()]
    configs = {"bf16": len(head_step_triton.LAUNCH_CONFIGS), "fp32": 1}
    flags = ("True", "False")
    expected = [
        [dtype, pick, step, str(index), "0"]
        for dtype, count in configs.items()
        for index in range(count)
        for pick in flags
        for step in flags
    ]
    assert variants == expected
