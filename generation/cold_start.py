"""`domino-spec bench --cold`: the time of a process's first decoding call, its one-time set-up included.

A warm-up hides what a user's first call pays: `optimize_for_cpu` timing its kernels, allocations, kernel choice, the
cost-aware draft length learning this machine. So each method in each setting decodes a batch of each evaluation set
in a fresh Python process (`python -m domino_spec.generation.cold_start SPEC RESULT`): loading the
models is not timed, everything after is (preparing the target and the method's draft with `optimize_for_cpu`
where the bench does, the first call). Speedups compare first calls in the same engine, setting and prompts: with
repeats, each repeat's processes decode the set's next batch (`first_call_prompts`), so a cold cell samples the first
calls of as many prompts as a warm one can, not one prompt's many times. The kernel plans
`optimize_for_cpu` reads and the round costs the cost-aware draft length starts from come from this machine's files
(`plan_cache_path`, `draft_costs_path`), which the bench's warm run filled, as a user's earlier processes fill them;
only a machine's very first process times them.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..drafting import DraftingOptions
from ..published_format import load_draft
from ..targets import load_target
from .bench import DRAFT_OF, MethodRun, Setting, decode, reference_method, sampling_generator, setting_results
from .cpu import optimize_for_cpu
from .engine import DeviceClock


def cold_results(
    target_name: str,
    draft_folders: dict[str, str],
    drafting_options: DraftingOptions,
    prompt_ids: dict[str, list[list[int]]],
    methods: Sequence[str],
    settings: Sequence[Setting],
    max_new_tokens: int,
    eos: list[int],
    prepared: bool,
    repeats: int = 1,
) -> list[dict]:
    """The results rows (`timing` "cold") of every method (with its baselines, as `run_bench` measured them) in
    every setting it applies to, each a first call in a fresh process on a batch of each evaluation set; with
    `repeats`, that many processes per method, each repeat on the set's next batch (`first_call_prompts`), the
    methods in turn, the order reversed every other time, their times summed."""

    def spec(method: str, setting: Setting, prompts: list[list[int]]) -> dict:
        return {
            "target": target_name,
            "method": method,
            "setting": dataclasses.asdict(setting),
            "drafts": {DRAFT_OF[method]: draft_folders[DRAFT_OF[method]]} if method in DRAFT_OF else {},
            "drafting_options": {
                "draft_length": drafting_options.draft_length,
                "prompt_lookup": drafting_options.prompt_lookup,
            },
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "eos": eos,
            "cpu_optimization": prepared and method != "plain-eager",
            "threads": torch.get_num_threads(),
        }

    processes = sum(len(setting.methods(methods)) * len(prompt_ids) for setting in settings) * repeats
    progress = tqdm(total=processes, desc="bench --cold", unit="process")
    rows = []
    for setting in settings:
        measured = setting.methods(methods)
        for name, ids in prompt_ids.items():
            runs: dict[str, MethodRun] = {}
            for repeat in range(repeats if measured else 0):
                calls = {}
                prompts = first_call_prompts(ids, setting.batch_size, repeat)
                for method in measured if repeat % 2 == 0 else measured[::-1]:
                    calls[method] = first_call_in_new_process(spec(method, setting, prompts))
                    progress.update(1)
                if setting.greedy:  # the outputs, checked as the warm ones
                    expected = calls[reference_method(measured)].outputs
                    for call in calls.values():
                        call.identical = sum(tokens == reference for tokens, reference in zip(call.outputs, expected))
                for method, call in calls.items():
                    if method in runs:
                        runs[method].add(call)
                    else:
                        runs[method] = call
            rows += setting_results({name: runs}, setting, prepared, timing="cold") if runs else []
    progress.close()
    return rows


def first_call_prompts(prompt_ids: list[list[int]], batch_size: int, repeat: int) -> list[list[int]]:
    """The prompts of a set's `repeat`-th cold process: its batches of `batch_size` in order, the first again after
    the last (a set of fewer prompts than a batch gives them all each time)."""
    num_batches = max(1, len(prompt_ids) // batch_size)
    start = (repeat % num_batches) * batch_size
    return prompt_ids[start : start + batch_size]


def first_call_in_new_process(spec: dict) -> MethodRun:
    """Run `spec` (see `first_call`) in a fresh Python process; its `MethodRun`."""
    with tempfile.TemporaryDirectory(prefix="domino-cold-") as folder:
        spec_path, result_path = os.path.join(folder, "spec.json"), os.path.join(folder, "result.json")
        with open(spec_path, "w", encoding="utf-8") as file:
            json.dump(spec, file)
        command = [sys.executable, "-m", __name__, spec_path, result_path]
        finished = subprocess.run(command, capture_output=True, text=True, check=False)
        if finished.returncode != 0:
            raise RuntimeError(
                f"the cold run of {spec['method']} ({Setting(**spec['setting']).label()}) failed with "
                f"status {finished.returncode}:\n{finished.stderr[-4000:]}"
            )
        with open(result_path, encoding="utf-8") as file:
            return MethodRun(**json.load(file))


def first_call(target, drafts: dict, spec: dict) -> MethodRun:
    """Time everything a process does after loading its models: preparing them for the CPU (`cpu_optimization`)
    and the first decoding call of `spec["method"]` on `spec["prompts"]`."""
    setting = Setting(**spec["setting"])
    clock = DeviceClock(target.device)
    start = clock()
    optimization = optimize_for_cpu(target, *drafts.values()) if spec["cpu_optimization"] else None
    run = MethodRun(identical=None)
    rows = decode(
        spec["method"],
        target,
        drafts,
        spec["prompts"],
        spec["max_new_tokens"],
        spec["eos"],
        run,
        optimization,
        setting,
        sampling_generator(target.device, setting),
    )
    run.seconds = clock() - start  # the whole first call, its set-up included
    run.process_seconds = [round(run.seconds, 3)]
    run.record_outputs(rows, None)
    return run


def main(argv: list[str] | None = None) -> None:
    """The child process: load the models of the spec in `argv[0]`, time `first_call`, write its run to `argv[1]`."""
    spec_path, result_path = sys.argv[1:] if argv is None else argv
    with open(spec_path, encoding="utf-8") as file:
        spec = json.load(file)
    torch.set_num_threads(spec["threads"])  # as the parent's warm runs
    target, _ = load_target(spec["target"])
    drafts = {
        name: load_draft(folder, dtype=target.dtype).to(target.device).eval() for name, folder in spec["drafts"].items()
    }
    for draft in drafts.values():
        draft.drafting_options = DraftingOptions(**spec["drafting_options"])
    run = first_call(target, drafts, spec)
    with open(result_path, "w", encoding="utf-8") as file:
        json.dump(dataclasses.asdict(run), file)


if __name__ == "__main__":
    main()
