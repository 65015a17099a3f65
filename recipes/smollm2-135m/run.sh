#!/usr/bin/env bash
# Reproduce the shipped SmolLM2-135M drafts, their learning curves and the README's results on a CPU machine.
# Rerun it after an interruption: regeneration, feature caching, training and scoring resume; finished steps are kept.
# CHUNKS (default 2) sets how many chunks of 2,000 prompts are regenerated and trained on, STEPS (default 5000) the
# training steps of each draft.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=runs/smollm2
CHUNKS=${CHUNKS:-2}
STEPS=${STEPS:-5000}
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
# The shipped drafts, with and without the Domino head (same data, steps and seed), trained at once and scored as
# learning curves. Another `--variant "NAME=TRAIN FLAGS"` adds a recipe change to compare, e.g.
# "target-layers=--init_from_target_layers true", "block-16=--block_size 16", "whole-vocabulary=--draft_vocab_size 0",
# "soft-targets=--soft_targets 16" (its store from `cache-features ... --soft_targets 16`, into another --output).
CURVES=$RUN/curves_${CHUNKS}chunks_${STEPS}steps
python benchmarks/learning_curve.py --config recipes/smollm2-135m/train.yaml --data $DATA --features $FEATURES \
    --eval-data $RUN/held_out.jsonl --steps $STEPS --eval-every 1250 --tau-prompts 2 --tau-tokens 96 \
    --runs $CURVES --parallel \
    --variant "domino=" --variant "dflash=--use_domino_head false" \
    --output benchmarks/results/learning_curve_smollm2-135m_${CHUNKS}chunks_${STEPS}steps.json
# Both drafts in bf16, as shipped; the bench results then go on the shipped model card.
python recipes/smollm2-135m/ship.py $CURVES/domino checkpoints/domino-smollm2-135m
python recipes/smollm2-135m/ship.py $CURVES/dflash $RUN/dflash-bf16
# --quality scores HumanEval by running SmolLM2's programs here, in the sandbox the README describes.
domino-spec bench --domino checkpoints/domino-smollm2-135m --dflash $RUN/dflash-bf16 --limit 10 --max-new-tokens 128 \
    --quality --allow-code-execution --output $RUN/bench
cp $RUN/bench/bench_results.json benchmarks/results/bench_smollm2-135m.json
cp $RUN/bench/bench_results.md benchmarks/results/bench_smollm2-135m.md
cp $RUN/bench/bench_acceptance.png benchmarks/results/bench_smollm2-135m_acceptance.png
python recipes/smollm2-135m/ship.py $CURVES/domino checkpoints/domino-smollm2-135m --bench $RUN/bench/bench_results.json
