#!/usr/bin/env bash
# Reproduce the shipped SmolLM2-135M drafts, their learning curves and the README's results on a CPU machine.
# Rerun it after an interruption: regeneration, feature caching, training and scoring resume; finished steps are kept.
# CHUNKS (default 1) sets how many chunks of 2,000 prompts are regenerated and trained on.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=runs/smollm2
CHUNKS=${CHUNKS:-1}
mkdir -p $RUN
[ -f $RUN/prompts.jsonl ] || python recipes/smollm2-135m/prepare_prompts.py --output $RUN/prompts.jsonl \
    --held-out-output $RUN/held_out_prompts.jsonl
# The target's responses, greedy, 256 tokens at most, 2,000 prompts a chunk; the training data is the first CHUNKS.
for chunk in $(seq 1 "$CHUNKS"); do
    sed -n "$(( (chunk - 1) * 2000 + 1 )),$(( chunk * 2000 ))p" $RUN/prompts.jsonl > $RUN/chunk$chunk.jsonl
    domino-spec generate-data --target smollm2-135m --prompts $RUN/chunk$chunk.jsonl \
        --output $RUN/data_chunk$chunk.jsonl --max-new-tokens 256 --batch-size 48
done
DATA=$RUN/data_${CHUNKS}chunks.jsonl
FEATURES=$RUN/features_${CHUNKS}chunks
for chunk in $(seq 1 "$CHUNKS"); do cat $RUN/data_chunk$chunk.jsonl; done > $DATA
domino-spec generate-data --target smollm2-135m --prompts $RUN/held_out_prompts.jsonl --output $RUN/held_out.jsonl \
    --max-new-tokens 256 --batch-size 48 --limit 100
domino-spec cache-features --config recipes/smollm2-135m/train.yaml --data $DATA --output $FEATURES
# Learning curves: the first recipe's shape, then the recipe changes, each scored on held-out data and bench prompts.
python benchmarks/learning_curve.py --config recipes/smollm2-135m/train.yaml --data $DATA \
    --features $FEATURES --eval-data $RUN/held_out.jsonl --steps 3000 --eval-every 500 --runs $RUN/curves_$CHUNKS \
    --variant "first-recipe=--draft_vocab_size 0" --variant "draft-vocab-8k=" \
    --variant "draft-vocab-8k-target-layers=--init_from_target_layers true" \
    --variant "draft-vocab-8k-block-16=--block_size 16" \
    --output benchmarks/results/learning_curve_smollm2-135m.json
# The shipped drafts: the recipe, with and without the Domino head (same data, steps and seed).
for variant in domino dflash; do
    head=$([ $variant = domino ] && echo true || echo false)
    domino-spec train --config recipes/smollm2-135m/train.yaml --data $DATA --features $FEATURES \
        --use_domino_head $head --output $RUN/$variant
done
# Both drafts in bf16, as shipped; the bench results then go on the shipped model card.
python recipes/smollm2-135m/ship.py $RUN/domino checkpoints/domino-smollm2-135m
python recipes/smollm2-135m/ship.py $RUN/dflash $RUN/dflash-bf16
# --quality scores HumanEval by running SmolLM2's programs here, in the sandbox the README describes.
domino-spec bench --domino checkpoints/domino-smollm2-135m --dflash $RUN/dflash-bf16 --limit 10 --quality \
    --allow-code-execution --output $RUN/bench
python recipes/smollm2-135m/ship.py $RUN/domino checkpoints/domino-smollm2-135m --bench $RUN/bench/bench_results.json
