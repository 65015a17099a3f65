"""How much of the target's own output a draft vocabulary can propose: the bound a draft vocabulary puts on acceptance.

    python benchmarks/draft_vocab_coverage.py --output benchmarks/results/draft_vocab_coverage_smollm2-135m.json

A draft proposes only the tokens of its draft vocabulary (`draft_vocab_size`, the most frequent of its training data),
so a target token outside it is never accepted: the round ends there. Per evaluation set, the plain decoding outputs
of a bench run (`--bench`, the texts of `--method`, tokenized again with the target's tokenizer) are counted against
the draft's vocabulary and against the `--sizes` most frequent response tokens of the recipe's committed conversations
(`recipes/smollm2-135m/data`), the vocabularies a draft of that size would get. The LM head's rows per drafted token
grow with the size; the checkpoint does not (the draft reads the target's LM head). Writes JSON and Markdown.
"""

import argparse
import gzip
import json
import platform
from collections import Counter
from pathlib import Path

import transformers

from domino_spec.published_format import load_draft
from domino_spec.targets import load_target
from domino_spec.training.data import by_frequency

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "recipes" / "smollm2-135m" / "data"


def response_token_counts(data_dir: Path) -> tuple[Counter, int]:
    """How often each token id occurs in the responses of the committed conversations, and how many there are."""
    counts, conversations = Counter(), 0
    for piece in sorted(data_dir.glob("piece-*.jsonl.gz")):
        with gzip.open(piece, "rt", encoding="utf-8") as lines:
            for line in lines:
                counts.update(json.loads(line)["response_ids"])
                conversations += 1
    if not conversations:
        raise FileNotFoundError(f"no committed conversations (piece-*.jsonl.gz) in {data_dir}")
    return counts, conversations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", default=str(ROOT / "checkpoints" / "domino-smollm2-135m"))
    parser.add_argument("--target", default="smollm2-135m", help="target model folder or asset name (its tokenizer)")
    parser.add_argument("--bench", default=str(ROOT / "benchmarks" / "results" / "bench_smollm2-135m.json"))
    parser.add_argument("--method", default="plain-native", help="whose outputs to count: a plain decoding's")
    parser.add_argument("--sizes", default="8192,12288,16384,24576,32768", help="comma-separated vocabulary sizes")
    parser.add_argument("--output", default="draft_vocab_coverage.json")
    args = parser.parse_args()

    draft = load_draft(args.draft)
    _, tokenizer = load_target(args.target, device="cpu")
    if draft.draft_vocab is None:
        raise ValueError(f"{args.draft} proposes the whole vocabulary: every token is covered")
    own = set(draft.draft_vocab.tolist())
    counts, conversations = response_token_counts(DATA_DIR)
    sizes = [int(size) for size in args.sizes.split(",")]
    ranked = by_frequency(counts)  # as a draft vocabulary takes them (`training.data.draft_vocabulary`)
    vocabularies = {f"top {size:,}": set(ranked[:size]) for size in sizes}
    texts = json.loads(Path(args.bench).read_text())["texts"]

    rows = []
    for eval_set, by_method in texts.items():
        if args.method not in by_method:
            raise ValueError(f"{args.bench} has no {args.method!r} outputs for {eval_set}: pass --method")
        outputs = by_method[args.method]
        tokens = [token for text in outputs for token in tokenizer.encode(text, add_special_tokens=False)]
        row = {"eval_set": eval_set, "tokens": len(tokens), f"draft's own ({len(own):,})": _share(tokens, own)}
        row |= {name: _share(tokens, vocabulary) for name, vocabulary in vocabularies.items()}
        rows.append(row)

    columns = list(rows[0])
    lines = [
        f"Share of the target's output tokens inside a draft vocabulary: the `{args.method}` outputs of "
        f"`{Path(args.bench).name}`, tokenized again; `top N`: the N most frequent response tokens of "
        f"{conversations:,} committed conversations.",
        "",
        "| " + " | ".join(columns) + " |",
        "|---|" + "---:|" * (len(columns) - 1),
    ]
    for row in rows:
        cells = [row["eval_set"], f"{row['tokens']:,}"] + [f"{row[name]:.1%}" for name in columns[2:]]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "rows": rows,
        "config": {**vars(args), "conversations": conversations},
        "machine": {"platform": platform.platform()},
        "versions": {"transformers": transformers.__version__},
    }
    output.write_text(json.dumps(report, indent=1) + "\n")
    output.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {output} and {output.with_suffix('.md')}")


def _share(tokens: list[int], vocabulary: set[int]) -> float:
    return sum(token in vocabulary for token in tokens) / len(tokens) if tokens else float("nan")


if __name__ == "__main__":
    main()
