"""`domino-spec cache-features`: compute the target features of a training set once, for `train --features DIR`.

    domino-spec cache-features --target DIR --data FILE --output DIR [train's draft-shape flags]

Takes the same flags and `--config` as `train` (the draft's tapped layers decide what is stored); `--output` is the
store's folder. Rerunning resumes. Data that grew (more regenerated pieces after the ones already cached) reuses
the store of the data it started as: `--extend OLD_DIR` copies it and computes only the new examples.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from ..configuration_domino import DominoConfig
from ..draft_building import config_for_target
from .features import FeatureStore
from .train import fresh_draft_shape, load_target_and_data, parse_train_arguments


@dataclass
class CacheArguments:
    extend: str | None = field(
        default=None,
        metadata={
            "help": "A complete feature store of the first examples of --data (the same target, layers and soft "
            "targets): copied into --output, and only the examples after them computed."
        },
    )


def main(argv: list[str], prepare_target: Callable | None = None) -> None:
    """Build (or resume) the store; `prepare_target(target)` runs first (the CLI's plans a CPU target's kernels with
    `optimize_for_cpu`, which training does not import)."""
    draft_args, training_args, cache_args = parse_train_arguments(
        argv,
        prog="domino-spec cache-features",
        description=(
            "Compute the target features of a training set once, for `train --features DIR`; takes train's flags "
            "(the draft's shape decides the tapped layers), --output is the store's folder; rerun to resume."
        ),
        extra_arguments=(CacheArguments,),
    )
    target, tokenizer, dataset, _ = load_target_and_data(draft_args)
    if prepare_target is not None:
        prepare_target(target)
    if draft_args.init_from:
        layer_ids = DominoConfig.from_pretrained(draft_args.init_from).target_layer_ids
    else:  # the config alone: no draft weights to build
        shape = fresh_draft_shape(draft_args, target)
        layer_ids = config_for_target(target, tokenizer=tokenizer, **shape).target_layer_ids
    store = FeatureStore.build(
        target, dataset, layer_ids, training_args.output_dir, training_args.soft_targets, cache_args.extend
    )
    soft_targets = f", soft targets of {store.top_k} tokens" if store.top_k else ""
    print(f"features of {len(store)} examples (target layers {layer_ids}{soft_targets}) in {training_args.output_dir}")
