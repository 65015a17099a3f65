"""The recipe's regenerated conversations, kept in the repository piece by piece.

Regenerating the target's responses is the recipe's costly step (about 1.2 CPU-hours per 2,000 prompts here), and a
session's `runs/` does not outlive it, so each piece of `PIECE_SIZE` prompts is compressed into `data/` as soon as it
is complete (`piece-NNN.jsonl.gz`, the records `domino-spec generate-data` wrote) with a manifest (`piece-NNN.json`:
its prompts, their sha256, the target's fingerprint and what the regeneration cost), and committed with `--commit`.
Piece N is always the same prompts, since `prepare_prompts.py` writes its prompts in a fixed order (seeded shuffles of
lists, never of sets: the file is byte-identical across runs and hash seeds); the manifest's `prompts_sha256` checks it.

    python recipes/smollm2-135m/pieces.py regenerate --prompts runs/smollm2/prompts.jsonl --pieces 16 --commit
    python recipes/smollm2-135m/pieces.py build --output runs/smollm2/data.jsonl

`regenerate` skips every committed piece whose fingerprint matches the current target and settings (a mismatch is an
error: the data would teach another model's outputs); `build` writes all committed pieces as one training file.
"""

import argparse
import gzip
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.path.join(HERE, "data")
TARGET = "smollm2-135m"
PIECE_SIZE = 250  # ~9 minutes of a quiet 2-core machine: a piece lands within a session even on a busy one
BATCH_SIZE = 48
# What the responses depend on besides the target; `generate-data`'s flags, so changing one here changes both.
GENERATION = {"max_new_tokens": 256, "temperature": 0.0, "thinking": None, "max_prompt_tokens": 2048, "seed": 0}
# A conversation whose token ids fingerprint the tokenizer and chat template together.
PROBE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Écris `def f(x): return x**2` — and 3.14 × 2 = 6.28?\n\tnaïve café 東京 🙂"},
]


def piece_name(index: int) -> str:
    return f"piece-{index:03d}"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_sha256(tokenizer) -> str:
    """The tokenizer as the data depends on it: its vocabulary, special tokens and the chat template's token ids."""
    probe_ids = tokenizer.apply_chat_template(PROBE, tokenize=True, add_generation_prompt=True)
    if isinstance(probe_ids, dict):  # newer transformers return a BatchEncoding
        probe_ids = probe_ids["input_ids"]
    content = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": tokenizer.all_special_tokens,
        "chat_template": tokenizer.chat_template,
        "probe_ids": list(probe_ids),
    }
    return sha256_text(json.dumps(content, ensure_ascii=False, sort_keys=True))


def fingerprint(target: str = TARGET) -> dict:
    """What regenerated data depends on: the target's GGUF (pinned, checked on conversion), its tokenizer and the
    generation settings."""
    from transformers import AutoTokenizer

    from domino_spec import assets

    tokenizer = AutoTokenizer.from_pretrained(assets.target_dir(target))
    return {
        "target": target,
        "gguf_sha256": assets.TARGETS[target].sha256,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "generation": GENERATION,
    }


def read_prompt_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as file:
        return [line for line in file if line.strip()]


def piece_prompts(lines: list[str], index: int, size: int) -> list[str]:
    return lines[index * size : (index + 1) * size]


def committed_pieces(data_dir: str = DATA_DIR) -> list[int]:
    """Indices of the pieces in `data_dir`: those with both their records and their manifest."""
    if not os.path.isdir(data_dir):
        return []
    names = set(os.listdir(data_dir))
    manifests = (re.fullmatch(r"piece-(\d+)\.json", name) for name in names)
    return sorted(int(m[1]) for m in manifests if m and f"{piece_name(int(m[1]))}.jsonl.gz" in names)


def read_manifest(index: int, data_dir: str = DATA_DIR) -> dict:
    with open(os.path.join(data_dir, f"{piece_name(index)}.json"), encoding="utf-8") as file:
        return json.load(file)


def check_piece(manifest: dict, expected: dict, prompt_lines: list[str] | None = None) -> None:
    """Raise `ValueError` if a committed piece was regenerated for another target, tokenizer or settings than
    `expected`, or (given the prompts file's lines) from other prompts than piece N's today."""
    name = piece_name(manifest["piece"])
    if manifest["fingerprint"] != expected:
        differing = sorted(
            k
            for k in expected.keys() | manifest["fingerprint"].keys()
            if manifest["fingerprint"].get(k) != expected.get(k)
        )
        raise ValueError(
            f"{name} was regenerated with another {', '.join(differing)} than the current target's "
            f"({manifest['fingerprint']} vs {expected}): training on it would teach another model's outputs. "
            f"Delete the committed pieces (git rm {os.path.relpath(DATA_DIR)}/piece-*) to regenerate them all."
        )
    if prompt_lines is not None:
        prompts = piece_prompts(prompt_lines, manifest["piece"], manifest["piece_size"])
        if sha256_text("".join(prompts)) != manifest["prompts_sha256"]:
            raise ValueError(
                f"{name} holds responses to other prompts than the prompts file's piece {manifest['piece']}: "
                "prepare_prompts.py no longer writes the prompts in the order the pieces were regenerated in."
            )


def write_piece(
    records_path: str, index: int, prompts: list[str], expected: dict, cost: dict, data_dir: str
) -> list[str]:
    """Compress a finished piece's records into `data_dir` with its manifest; the two paths written."""
    os.makedirs(data_dir, exist_ok=True)
    gz_path = os.path.join(data_dir, f"{piece_name(index)}.jsonl.gz")
    with open(records_path, "rb") as source, open(gz_path + ".partial", "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as compressed:  # mtime 0: the same bytes on every machine
            shutil.copyfileobj(source, compressed)
    with open(records_path, encoding="utf-8") as file:
        conversations = sum(1 for line in file if line.strip())
    manifest = {
        "piece": index,
        "piece_size": PIECE_SIZE,
        "prompts": [index * PIECE_SIZE, index * PIECE_SIZE + len(prompts)],
        "prompts_sha256": sha256_text("".join(prompts)),
        "conversations": conversations,
        "fingerprint": expected,
        "regeneration": cost,
    }
    manifest_path = os.path.join(data_dir, f"{piece_name(index)}.json")
    with open(manifest_path, "w", encoding="utf-8") as file:
        json.dump(manifest, file, indent=1)
        file.write("\n")
    os.replace(gz_path + ".partial", gz_path)  # last: a piece counts as committed only with both files
    return [gz_path, manifest_path]


def regenerate_piece(prompts: list[str], records_path: str) -> dict:
    """Run `domino-spec generate-data` on a piece's prompts (resumable: it appends to `records_path`); its cost."""
    prompts_path = records_path.replace(".jsonl", ".prompts.jsonl")
    with open(prompts_path, "w", encoding="utf-8") as file:
        file.writelines(prompts)
    command = [
        "domino-spec",
        "generate-data",
        "--target",
        TARGET,
        "--prompts",
        prompts_path,
        "--output",
        records_path,
        "--batch-size",
        str(BATCH_SIZE),
        "--max-new-tokens",
        str(GENERATION["max_new_tokens"]),
        "--temperature",
        str(GENERATION["temperature"]),
        "--max-prompt-tokens",
        str(GENERATION["max_prompt_tokens"]),
        "--seed",
        str(GENERATION["seed"]),
    ]
    start, cpu_start = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, check=True)
    cpu_end = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = (cpu_end.ru_utime - cpu_start.ru_utime) + (cpu_end.ru_stime - cpu_start.ru_stime)
    # A resumed piece's earlier work is not counted: these are this run's costs, on a machine maybe shared.
    return {
        "wall_seconds": round(time.time() - start, 1),
        "cpu_seconds": round(cpu_seconds, 1),
        "batch_size": BATCH_SIZE,
        "cpus": os.cpu_count(),
    }


def git_commit(paths: list[str], message: str, attempts: int = 5) -> None:
    """Commit only `paths`, retrying while another engineer's git command holds the index lock."""

    def git(*args: str) -> bool:
        return subprocess.run(["git", *args], cwd=HERE).returncode == 0

    for attempt in range(attempts):
        if git("add", "--", *paths) and git("commit", "-m", message, "--", *paths):
            return
        time.sleep(5 * (attempt + 1))
    raise RuntimeError(f"could not commit {paths}")


def regenerate(args: argparse.Namespace) -> None:
    lines = read_prompt_lines(args.prompts)
    expected = fingerprint()
    count = min(args.pieces, -(-len(lines) // PIECE_SIZE))
    done = set(committed_pieces(args.data_dir))
    for index in done:
        check_piece(read_manifest(index, args.data_dir), expected, lines)
    os.makedirs(args.work, exist_ok=True)
    for index in range(count):
        if index in done:
            continue
        prompts = piece_prompts(lines, index, PIECE_SIZE)
        records_path = os.path.join(args.work, f"{piece_name(index)}.jsonl")
        cost = regenerate_piece(prompts, records_path)
        paths = write_piece(records_path, index, prompts, expected, cost, args.data_dir)
        print(
            f"{piece_name(index)}: {len(prompts)} prompts in {cost['wall_seconds'] / 60:.1f} min "
            f"({cost['cpu_seconds'] / 3600:.2f} CPU-hours) -> {paths[0]}",
            flush=True,
        )
        if args.commit:
            first, last = index * PIECE_SIZE, index * PIECE_SIZE + len(prompts) - 1
            message = f"SmolLM2-135M recipe: regenerated {piece_name(index)} (prompts {first}-{last})"
            git_commit(paths, f"{message}, {cost['cpu_seconds'] / 3600:.2f} CPU-hours")


def build(args: argparse.Namespace) -> None:
    """Write the records of every committed piece, in piece order, as one training file."""
    pieces = committed_pieces(args.data_dir)
    if not pieces:
        raise SystemExit(f"no committed pieces in {args.data_dir}: run `pieces.py regenerate` first")
    expected = fingerprint()
    lines = read_prompt_lines(args.prompts) if args.prompts else None
    conversations = 0
    with open(args.output + ".partial", "wb") as output:
        for index in pieces:
            manifest = read_manifest(index, args.data_dir)
            check_piece(manifest, expected, lines)
            with gzip.open(os.path.join(args.data_dir, f"{piece_name(index)}.jsonl.gz"), "rb") as file:
                shutil.copyfileobj(file, output)
            conversations += manifest["conversations"]
    os.replace(args.output + ".partial", args.output)
    print(f"{conversations} conversations from {len(pieces)} committed pieces -> {args.output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=DATA_DIR, help="where the committed pieces are")
    commands = parser.add_subparsers(dest="command", required=True)
    regen = commands.add_parser("regenerate", help="regenerate the first PIECES pieces not yet committed")
    regen.add_argument("--prompts", required=True, help="prepare_prompts.py's training prompts")
    regen.add_argument("--pieces", type=int, required=True, help=f"how many pieces of {PIECE_SIZE} prompts to have")
    regen.add_argument("--work", default="runs/smollm2/pieces", help="unfinished pieces (resumable)")
    regen.add_argument("--commit", action="store_true", help="git commit each piece as it lands")
    collect = commands.add_parser("build", help="write all committed pieces as one training .jsonl")
    collect.add_argument("--output", required=True)
    collect.add_argument("--prompts", default=None, help="also check each piece against these prompts")
    args = parser.parse_args()
    regenerate(args) if args.command == "regenerate" else build(args)


if __name__ == "__main__":
    main()
