"""`domino-spec export`: write a draft in another serving stack's checkpoint format.

    domino-spec export --format sglang DIR OUT

`sglang` writes the published Domino layout (`published_format.py`): bf16 weights under the published names and a
`config.json` with `model_type: "qwen3"` and `dflash_config` (`projector_type: "domino"`), or the z-lab DFlash layout
when the draft has no Domino head. SGLang serves it with `--speculative-algorithm DFLASH`. The folder also keeps our
model files; `domino_spec.published_format.load_draft(OUT)` reads it back (the model files alone refuse the
published config, naming it). Its model card says to upload the folder as is.
"""

import argparse
import os
import shutil
import warnings
from collections.abc import Callable

import torch
from transformers.dynamic_module_utils import get_relative_import_files

from .. import modeling_domino, published_format
from ..published_format import check_draft_folder, load_draft
from .model_card import write_model_card

# Files of the source folder the model card reads; copied so `domino-spec card OUT` finds them too.
CARD_INPUTS = ("training_summary.json", "bench_results.json")


def sglang_problems(config) -> list[str]:
    """Why SGLang's DFLASH loader would refuse or misread this draft (empty when it serves it as is)."""
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (SGLang's DFlash MLP supports silu only)")
    if config.use_domino_head and config.first_corrected_slot != 1:
        problems.append(
            f"first_corrected_slot={config.first_corrected_slot} (SGLang's Domino requires pure_draft_prefix_len 1)"
        )
    if not config.use_domino_head and config.shift_label:
        problems.append(
            "no Domino head but shift_label=True: the DFlash layout has no shift_label field and SGLang reads block "
            "position 0 as the anchor; train the head-less draft with `--shift_label false`, or keep the head"
        )
    return problems


def export_sglang(draft_dir: str, output_dir: str) -> str:
    """Export the draft at `draft_dir` to `output_dir` in the published layout SGLang serves; returns `output_dir`."""
    draft = load_draft(draft_dir)
    problems = sglang_problems(draft.config)
    if problems:
        raise ValueError(f"{draft_dir} cannot be served by SGLang as exported: " + "; ".join(problems) + ".")
    if draft.config.draft_vocab_size is not None:
        warnings.warn(
            f"{draft_dir} drafts from a vocabulary of {draft.config.draft_vocab_size} tokens, which the published "
            "format cannot hold: the export drafts over the whole vocabulary (its residual zero outside the draft's), "
            "so it may propose tokens this draft never does, and its acceptance can differ.",
            stacklevel=2,
        )
    auto_map = {"AutoModel": "modeling_domino.DominoDraftModel"}
    published_format.save_published(draft, output_dir, dtype=torch.bfloat16, auto_map=auto_map)
    # The files `trust_remote_code` loading needs: the model file and the root files it imports, as save_pretrained
    # finds them.
    modeling_file = os.path.abspath(modeling_domino.__file__)
    for path in [modeling_file, *get_relative_import_files(modeling_file)]:
        shutil.copyfile(path, os.path.join(output_dir, os.path.basename(path)))
    for name in CARD_INPUTS:
        source = os.path.join(draft_dir, name)
        if os.path.isfile(source) and os.path.abspath(source) != os.path.abspath(os.path.join(output_dir, name)):
            shutil.copyfile(source, os.path.join(output_dir, name))
    write_model_card(output_dir)
    return output_dir


EXPORTERS: dict[str, Callable[[str, str], str]] = {"sglang": export_sglang}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="domino-spec export", description="Write a draft in another serving stack's checkpoint format."
    )
    parser.add_argument("--format", required=True, help=f"target format: {', '.join(EXPORTERS)}")
    parser.add_argument("draft_dir", metavar="DIR", help="a draft folder (ours, or published Domino / DFlash)")
    parser.add_argument("output_dir", metavar="OUT", help="folder to write")
    args = parser.parse_args(argv)
    if args.format not in EXPORTERS:
        parser.error(f"unknown --format {args.format!r}; supported formats: {', '.join(EXPORTERS)}")
    check_draft_folder(args.draft_dir)
    output_dir = EXPORTERS[args.format](args.draft_dir, args.output_dir)
    print(f"wrote the {args.format} checkpoint to {output_dir}")


if __name__ == "__main__":
    main()
