"""`domino-spec draft-vocab`: give an existing draft a draft vocabulary, the most frequent tokens of regenerated data.

domino-spec draft-vocab DIR OUT --data FILE --size N

A smaller vocabulary drafts what the draft drafted wherever its pick is kept, for less LM-head work per drafted token.
A larger one gives its new tokens zero residual rows: the backbone's base logits alone score them until a training
leg (`domino-spec train --init_from OUT`) teaches the head their residuals.
"""

import argparse
import os

from ..draft_building import with_draft_vocab
from ..published_format import check_draft_folder, load_draft
from .data import draft_vocabulary, load_training_dataset


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="domino-spec draft-vocab",
        description="Write a copy of a draft that proposes only the N most frequent tokens of regenerated data: "
        "the backbone as it is, the head's residual rows of those tokens, zero rows for tokens it had none for "
        "(decoding stays the target's own either way).",
    )
    parser.add_argument("draft_dir", metavar="DIR", help="a draft folder")
    parser.add_argument("output_dir", metavar="OUT", help="folder to write the new draft to")
    parser.add_argument("--data", required=True, help="regenerated .jsonl (domino-spec generate-data) to count")
    parser.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary, e.g. 8192")
    args = parser.parse_args(argv)
    check_draft_folder(args.draft_dir)
    if not os.path.isfile(args.data):
        raise FileNotFoundError(f"--data {args.data}: no such file (make one with `domino-spec generate-data`)")
    draft = load_draft(args.draft_dir)
    dataset = load_training_dataset(args.data)
    token_ids = draft_vocabulary(dataset, args.size, draft.config.vocab_size)
    with_draft_vocab(draft, token_ids).save_pretrained(args.output_dir)
    print(f"wrote a draft of {args.size} draft tokens (of {draft.config.vocab_size}) to {args.output_dir}")
