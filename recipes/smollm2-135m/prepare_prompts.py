"""Training prompts for the SmolLM2-135M draft: ShareGPT first turns plus gsm_symbolic on training seeds.

Every evaluation prompt of `domino-spec bench` is excluded, and the result is checked for overlap with them
(exact match of the normalised user turn). Usage:

    python recipes/smollm2-135m/prepare_prompts.py --output runs/smollm2/prompts.jsonl
"""

import argparse
import json
import random

from domino_spec import assets
from domino_spec.generation.eval_sets import EVAL_SETS, GSM_EVAL_SEED, eval_prompts
from domino_spec.training.data import load_prompts

GSM_TRAIN_SEED = 1


def normalise(text: str) -> str:
    return " ".join(text.split()).lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--sharegpt", type=int, default=2400, help="ShareGPT prompts to keep")
    parser.add_argument("--gsm", type=int, default=1600, help="gsm_symbolic training problems")
    parser.add_argument("--max-chars", type=int, default=2000, help="skip longer ShareGPT prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    assert GSM_TRAIN_SEED != GSM_EVAL_SEED

    held_out = {normalise(item["messages"][-1]["content"]) for name in EVAL_SETS for item in eval_prompts(name)}
    sharegpt = [
        p
        for p in load_prompts(assets.sharegpt_path())
        if len(p.messages[-1]["content"]) <= args.max_chars and normalise(p.messages[-1]["content"]) not in held_out
    ]
    random.Random(args.seed).shuffle(sharegpt)
    records = [{"id": f"sharegpt-{p.id}", "messages": p.messages} for p in sharegpt[: args.sharegpt]]
    num_sharegpt = len(records)
    for index, problem in enumerate(assets.gsm_symbolic(args.gsm, seed=GSM_TRAIN_SEED)):
        if normalise(problem["question"]) not in held_out:
            records.append({"id": f"gsm-train-{index}", "messages": [{"role": "user", "content": problem["question"]}]})

    overlap = [r["id"] for r in records if normalise(r["messages"][-1]["content"]) in held_out]
    if overlap:
        raise SystemExit(f"evaluation prompts leaked into training: {overlap[:5]}")
    random.Random(args.seed).shuffle(records)
    with open(args.output, "w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(
        f"{len(records)} training prompts ({num_sharegpt} ShareGPT, {len(records) - num_sharegpt} gsm_symbolic); "
        f"0 overlap with {len(held_out)} evaluation prompts -> {args.output}"
    )


if __name__ == "__main__":
    main()
