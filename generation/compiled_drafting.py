"""Compiled drafting: the drafting hot path (the backbone pass and the greedy head) under `torch.compile`.

Part of the package, not of a checkpoint's code: `compile_drafting(draft)` works as well on a draft loaded with
`trust_remote_code`. The compiled functions are a plain attribute of the draft (`_compiled_drafting`, which
`DominoDraftModel.block_logits` and `draft_from_block` read), not modules: nothing is saved, and pickling or copying
a draft leaves them out.
"""

from collections.abc import Callable

import torch

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


class CompiledDrafting:
    """What `compile_drafting` builds: the compiled backbone, and each greedy head the draft runs, compiled on first
    use (`head_domino.greedy_head`, or the fused one of `fuse_head_step`, whichever the draft has at the time)."""

    def __init__(self, backbone: Callable[..., torch.Tensor], mode: str, dynamic_backbone: bool):
        # With dynamic shapes, CUDA graphs would still be recorded once per context length: compile without them.
        backbone_mode = _WITHOUT_CUDA_GRAPHS.get(mode, mode) if dynamic_backbone else mode
        self._backbone_graphs = backbone_mode in _WITHOUT_CUDA_GRAPHS
        self._backbone = torch.compile(backbone, mode=backbone_mode, dynamic=dynamic_backbone)
        self._mode = mode
        self._greedy_heads: dict[Callable, Callable] = {}

    def backbone(self, *args) -> torch.Tensor:
        """`DominoDraftModel.backbone`, compiled."""
        if not self._backbone_graphs:
            return self._backbone(*args)
        torch.compiler.cudagraph_mark_step_begin()
        return self._backbone(*args).clone()  # the head's graph must not read a buffer a later replay rewrites

    def greedy_head(self, eager: Callable[..., tuple]) -> Callable[..., tuple]:
        """The greedy head `eager`, compiled; the function returned gives tensors the caller owns."""
        if eager not in self._greedy_heads:
            self._greedy_heads[eager] = torch.compile(eager, mode=self._mode, dynamic=False)
        compiled = self._greedy_heads[eager]

        def greedy(base_logits, draft_hidden, anchor_embeds, weights, *static) -> tuple[torch.Tensor, ...]:
            for tensor in weights:
                if isinstance(tensor, torch.Tensor):
                    # Weights keep their address across calls: CUDA graphs read them in place instead of copying
                    # them into the graph's input buffers every call (parameters are marked so by torch.compile).
                    torch._dynamo.mark_static_address(tensor)
            torch.compiler.cudagraph_mark_step_begin()  # a new drafting round: earlier graph outputs may be rewritten
            outputs = compiled(base_logits, draft_hidden, anchor_embeds, weights, *static)
            return tuple(output.clone() for output in outputs)  # the next replay overwrites a CUDA graph's outputs

        return greedy


def compile_drafting(draft, mode: str | None = "reduce-overhead", dynamic_backbone: bool = True):
    """Compile `draft`'s drafting hot path with `torch.compile`: the backbone pass and the greedy head. Returns the
    draft.

    The greedy head (`greedy_head`: per-block setup and the slot loop, unrolled over the block; the fused one of
    `fuse_head_step`, before or after this call) has static shapes, so `mode="reduce-overhead"` captures it in one
    CUDA graph on CUDA: one launch instead of about ten per slot. The backbone's key length grows every round, so
    with `dynamic_backbone=True` it is compiled for dynamic shapes and without CUDA graphs (which would record one
    graph per context length);
    `dynamic_backbone=False` specializes it to each shape in `mode`, CUDA graphs included: for fixed-shape benchmarks
    only, as every new context length recompiles.

    `draft_block` then runs the compiled backbone on every call and the compiled head for plain greedy drafting (no
    logits processor, no sampling); other calls keep the eager loop. Compiled kernels may round differently, so a
    near-tie can flip a draft token; verification keeps decoding lossless either way. Compilation happens on first
    use (seconds to minutes), again per batch size and drafting options. `mode=None` goes back to eager.
    """
    if mode is None:
        draft.__dict__.pop("_compiled_drafting", None)
        return draft
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile_drafting: mode must be one of {list(COMPILE_MODES)} or None, got {mode!r}.")
    draft.__dict__["_compiled_drafting"] = CompiledDrafting(draft.backbone, mode, dynamic_backbone)
    return draft


def is_drafting_compiled(draft) -> bool:
    """Whether `compile_drafting` is on for `draft`."""
    return "_compiled_drafting" in draft.__dict__


__all__ = ["COMPILE_MODES", "CompiledDrafting", "compile_drafting", "is_drafting_compiled"]
