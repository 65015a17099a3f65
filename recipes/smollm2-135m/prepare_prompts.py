"""Training and held-out prompts for the SmolLM2-135M drafts: ShareGPT first turns plus gsm_symbolic on training seeds.

The training file lists its prompts in the order the recipe regenerates them, chunk by chunk: first the `--first`
prompts of the original recipe (2,400 ShareGPT and 1,600 gsm_symbolic prompts, shuffled), then the rest of a larger
pool of `--sharegpt` and `--gsm` prompts, shuffled, then `--more-sharegpt` ShareGPT prompts from outside that pool,
shuffled: data added at the end, so the prompts before keep their place. The held-out file holds `--held-out` ShareGPT
prompts outside the pool (and outside the prompts added after it), for scoring drafts on regenerated data they never
trained on. Every evaluation prompt of `domino-spec bench` is excluded, and both files are checked for overlap with
them (exact match of the normalised user turn).

The order is deterministic: seeded shuffles of lists, never of sets, so the file is byte-identical across runs and
hash seeds, and piece N of the recipe's committed data (pieces.py) is always the same prompts. Changing the pool, its
sources or the evaluation sets can reorder it; pieces.py then refuses the committed pieces (their prompts' sha256).
Usage:

    python recipes/smollm2-135m/prepare_prompts.py --output runs/smollm2/prompts.jsonl \\
        --held-out-output runs/smollm2/held_out_prompts.jsonl
"""

import argparse
import itertools
import json
import random

from domino_spec import assets
from domino_spec.generation.eval_sets import EVAL_SETS, GSM_EVAL_SEED, eval_prompts
from domino_spec.training.data import load_prompts, read_sharegpt

GSM_TRAIN_SEED = 1
ORIGINAL_SHAREGPT, ORIGINAL_GSM = 2400, 1600  # the first recipe's pool


def normalise(text: str) -> str:
    return " ".join(text.split()).lower()


def user_turn(record: dict) -> str:
    return normalise(record["messages"][-1]["content"])


def pool(sharegpt: list, gsm: list, num_sharegpt: int, num_gsm: int, held_out: set[str], seed: int) -> list[dict]:
    """`num_sharegpt` ShareGPT prompts and the first `num_gsm` gsm_symbolic problems, shuffled."""
    records = [{"id": f"sharegpt-{p.id}", "messages": p.messages} for p in sharegpt[:num_sharegpt]]
    for index, problem in enumerate(gsm[:num_gsm]):
        if normalise(problem["question"]) not in held_out:
            records.append({"id": f"gsm-train-{index}", "messages": [{"role": "user", "content": problem["question"]}]})
    random.Random(seed).shuffle(records)
    return records


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="training prompts, in regeneration order")
    parser.add_argument("--held-out-output", default=None, help="held-out prompts (default: none written)")
    parser.add_argument(
        "--kept-output",
        default=None,
        help="the training pool's ShareGPT conversations with their own answers, in the same order, for "
        "`generate-data --keep-responses` (labels from the target's soft targets instead of regeneration)",
    )
    parser.add_argument("--first", type=int, default=2000, help="prompts of the original recipe's pool first")
    parser.add_argument("--sharegpt", type=int, default=6500, help="ShareGPT prompts in the pool")
    parser.add_argument("--gsm", type=int, default=4000, help="gsm_symbolic training problems in the pool")
    parser.add_argument(
        "--more-sharegpt", type=int, default=4000, help="ShareGPT prompts from outside the pool, appended after it"
    )
    parser.add_argument("--held-out", type=int, default=200, help="held-out ShareGPT prompts")
    parser.add_argument("--max-chars", type=int, default=2000, help="skip longer ShareGPT prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    assert GSM_TRAIN_SEED != GSM_EVAL_SEED

    evaluation = {user_turn(item) for name in EVAL_SETS for item in eval_prompts(name)}
    sharegpt = [
        p
        for p in load_prompts(assets.sharegpt_path())
        if len(p.messages[-1]["content"]) <= args.max_chars and normalise(p.messages[-1]["content"]) not in evaluation
    ]
    random.Random(args.seed).shuffle(sharegpt)
    gsm = assets.gsm_symbolic(max(args.gsm, ORIGINAL_GSM), seed=GSM_TRAIN_SEED)
    first = pool(sharegpt, gsm, ORIGINAL_SHAREGPT, ORIGINAL_GSM, evaluation, args.seed)[: args.first]
    seen = {user_turn(record) for record in first}
    rest = [r for r in pool(sharegpt, gsm, args.sharegpt, args.gsm, evaluation, args.seed) if user_turn(r) not in seen]
    training = first + rest
    training_turns = {user_turn(record) for record in training}
    unseen = (p for p in sharegpt[args.sharegpt :] if normalise(p.messages[-1]["content"]) not in training_turns)
    held_out = [{"id": f"held-out-{p.id}", "messages": p.messages} for p in itertools.islice(unseen, args.held_out)]
    taken = training_turns | {user_turn(record) for record in held_out}
    more = []
    for prompt in sharegpt[args.sharegpt :]:
        if len(more) < args.more_sharegpt and (turn := normalise(prompt.messages[-1]["content"])) not in taken:
            more.append({"id": f"sharegpt-{prompt.id}", "messages": prompt.messages})
            taken.add(turn)
    random.Random(args.seed).shuffle(more)
    training += more
    training_turns |= {user_turn(record) for record in more}

    if overlap := [r["id"] for r in training + held_out if user_turn(r) in evaluation]:
        raise SystemExit(f"evaluation prompts leaked into the recipe's prompts: {overlap[:5]}")
    if overlap := [r["id"] for r in held_out if user_turn(r) in training_turns]:
        raise SystemExit(f"held-out prompts are also training prompts: {overlap[:5]}")
    write_jsonl(args.output, training)
    if args.held_out_output:
        write_jsonl(args.held_out_output, held_out)
    if args.kept_output:
        conversations = {f"sharegpt-{record.get('id')}": record for record in read_sharegpt(assets.sharegpt_path())}
        kept = [{**conversations[r["id"]], "id": r["id"]} for r in training if r["id"] in conversations]
        write_jsonl(args.kept_output, kept)
    print(
        f"{len(training)} training prompts ({len(first)} of the original pool first, {len(more)} added after it), "
        f"{len(held_out)} held out; "
        f"0 overlap with {len(evaluation)} evaluation prompts -> {args.output}"
    )


if __name__ == "__main__":
    main()
