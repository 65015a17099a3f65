"""Which checkpoint a rerun of `domino-spec train` resumes from, and whether a finished run's final draft is whole.

Trainer writes `trainer_state.json` last and not atomically, and a disk fault or a kill while copying can cut any
file short: a checkpoint counts only when every file Trainer loads back reads.
"""

import json
import os
import sys

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_pt_utils import safe_globals

from ..configuration_domino import DominoConfig
from ..published_format import check_checkpoint_folder, check_safetensors_file, read_config_dict
from .model_card import TRAINING_SUMMARY, read_json
from .trainer import DominoTrainingArguments


def checkpoint_to_resume(training_args: DominoTrainingArguments) -> str | None:
    """`--resume_from_checkpoint` (a folder, or `true`: the last in output_dir); without it the last checkpoint in
    output_dir, so that rerunning an interrupted command continues it, unless `--restart`. A folder named that is
    incomplete or holds an unreadable file is an error; `last_complete_checkpoint` skips such folders."""
    chosen = training_args.resume_from_checkpoint
    if chosen is not None and chosen.lower() not in ("true", "last"):
        if _trainer_state(chosen) is None:
            raise FileNotFoundError(
                f"--resume_from_checkpoint {chosen}: not a complete Trainer checkpoint (no "
                f"readable {TRAINER_STATE_NAME} in it)"
            )
        problem = unreadable_checkpoint_file(chosen)
        if problem is not None:
            raise ValueError(f"--resume_from_checkpoint {chosen}: {problem}; resume from another checkpoint")
        return chosen
    last = last_complete_checkpoint(training_args.output_dir)
    if chosen is not None:
        if last is None:
            raise FileNotFoundError(
                f"--resume_from_checkpoint {chosen}: no complete checkpoint in {training_args.output_dir}"
            )
        return last
    if last is not None and training_args.restart:
        print(
            f"--restart: starting over, but {last} of an earlier run stays, and a rerun without --restart would "
            "resume from the highest step; use another --output to keep the runs apart",
            file=sys.stderr,
        )
        return None
    if last is not None:
        print(f"resuming from {last} (--restart starts over)")
    return last


def check_resumable(checkpoint: str, draft) -> None:
    """Raise `ValueError` if the draft the flags built for this `--target` is not the checkpoint's: its weights would
    not load, or would train on as another draft."""
    saved, built = DominoConfig.from_pretrained(checkpoint), draft.config
    # The draft's own fields, but the target's name: a checkpoint trains on whatever the target folder is called.
    fields = sorted(set(DominoConfig.__annotations__) - {"target_model_name"})
    conflicts = [
        f"{name}={getattr(built, name)!r} (the checkpoint has {getattr(saved, name)!r})"
        for name in fields
        if getattr(saved, name) != getattr(built, name)
    ]
    if conflicts:
        raise ValueError(
            f"resuming from {checkpoint}, but the draft these flags build for this --target differs: "
            f"{'; '.join(conflicts)}. Rerun with that run's --target and shape flags, or pass --restart (or another "
            "--output) to train this draft from step 0."
        )


def final_draft_problem(output_dir: str, checkpoint: str) -> str | None:
    """What keeps `output_dir` from holding the final draft of the run that ended at `checkpoint`, or None: a missing
    or unreadable config or weights (a save moves the weights in last, after the rest of its files), or the draft of
    another step (an earlier run's, its final save not yet redone)."""
    try:
        check_checkpoint_folder(output_dir)
        summary = read_json(output_dir, TRAINING_SUMMARY) or {}
    except (FileNotFoundError, ValueError) as error:
        return str(error)
    step = _trainer_state(checkpoint)["global_step"]
    if summary.get("global_step") != step:
        return f"the draft in {output_dir} is not of step {step} ({TRAINING_SUMMARY}: {summary.get('global_step')})"
    return None


def finished_at(checkpoint: str, training_args: DominoTrainingArguments) -> bool:
    """Whether the checkpoint reached `--max_steps`, or `--num_train_epochs` without it: the run is over, and only its
    final draft may be left to save."""
    state = _trainer_state(checkpoint)
    if training_args.max_steps > 0:
        return state["global_step"] >= training_args.max_steps
    return (state.get("epoch") or 0) >= training_args.num_train_epochs


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The highest-step `checkpoint-N` folder of `output_dir` that Trainer finished writing (`trainer_state.json`
    comes last) and can read back. A newer one, incomplete (a save cut short by a kill) or with an unreadable file,
    is skipped with a one-line warning and left in place."""
    if not os.path.isdir(output_dir):
        return None
    steps = {
        int(name.removeprefix("checkpoint-")): name
        for name in os.listdir(output_dir)
        if name.startswith("checkpoint-") and name.removeprefix("checkpoint-").isdigit()
    }
    for step in sorted(steps, reverse=True):
        folder = os.path.join(output_dir, steps[step])
        if _trainer_state(folder) is None:
            print(
                f"skipping {folder}: incomplete (no readable {TRAINER_STATE_NAME}; its save was cut short)",
                file=sys.stderr,
            )
        elif (problem := unreadable_checkpoint_file(folder)) is not None:
            print(f"skipping {folder}: {problem}", file=sys.stderr)
        else:
            return folder
    return None


def unreadable_checkpoint_file(folder: str) -> str | None:
    """The first file of the checkpoint `folder` that Trainer would fail to load on resuming, as a message naming it
    (truncated or corrupt: a disk fault, or a kill while copying); None when all read. Checked: the weights (header
    and tensor extents), the JSON files, and the torch files (optimizer, scheduler, RNG states)."""
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        try:
            if name.endswith(".safetensors"):
                check_safetensors_file(path)
            elif name.endswith(".json"):
                read_config_dict(path)
        except ValueError as error:  # both name the file
            return str(error)
        if name.endswith((".pt", ".pth")):
            try:
                with safe_globals():  # as Trainer loads them; mmap reads the zip's index, not every tensor
                    torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:  # whatever fails torch.load here fails Trainer's load of the file
                return f"{path} is not a readable torch file (truncated or corrupt?): {error}"
    return None


def _trainer_state(folder: str) -> dict | None:
    """The checkpoint's `trainer_state.json`; None unless Trainer finished saving `folder` (it writes that file last,
    and not atomically: missing or unreadable, the save was cut short)."""
    try:
        with open(os.path.join(folder, TRAINER_STATE_NAME), encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError):
        return None
