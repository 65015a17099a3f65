#!/usr/bin/env bash
# Reproduce the shipped SmolLM2-135M draft and the README's results table on a CPU machine.
# Rerun it after an interruption: regeneration, feature caching and training resume; finished drafts are kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=runs/smollm2
mkdir -p $RUN
[ -f $RUN/prompts.jsonl ] || python recipes/smollm2-135m/prepare_prompts.py --output $RUN/prompts.jsonl
head -n 2000 $RUN/prompts.jsonl > $RUN/prompts_2k.jsonl
domino-spec generate-data --target smollm2-135m --prompts $RUN/prompts_2k.jsonl --output $RUN/data.jsonl \
    --max-new-tokens 256 --batch-size 48
domino-spec cache-features --config recipes/smollm2-135m/train.yaml --data $RUN/data.jsonl --output $RUN/features
for variant in domino dflash; do
    head=$([ $variant = domino ] && echo true || echo false)
    [ -f $RUN/$variant/model.safetensors ] || domino-spec train --config recipes/smollm2-135m/train.yaml --data $RUN/data.jsonl --features $RUN/features \
        --use_domino_head $head --output $RUN/$variant
done
# Both drafts in bf16, as shipped; the bench results then go on the shipped model card.
python recipes/smollm2-135m/ship.py $RUN/domino checkpoints/domino-smollm2-135m
python recipes/smollm2-135m/ship.py $RUN/dflash $RUN/dflash-bf16
# --quality scores HumanEval by running SmolLM2's programs here, in the sandbox the README describes.
domino-spec bench --domino checkpoints/domino-smollm2-135m --dflash $RUN/dflash-bf16 --limit 10 --quality \
    --allow-code-execution --output $RUN/bench
python recipes/smollm2-135m/ship.py $RUN/domino checkpoints/domino-smollm2-135m --bench $RUN/bench/bench_results.json
