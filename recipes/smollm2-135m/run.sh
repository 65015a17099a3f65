#!/usr/bin/env bash
# Reproduce the shipped SmolLM2-135M draft and the README's results table on a CPU machine.
# Every step is resumable: rerun the script after an interruption.
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
    domino-spec train --config recipes/smollm2-135m/train.yaml --data $RUN/data.jsonl --features $RUN/features \
        --use_domino_head $head --output $RUN/$variant
done
domino-spec bench --domino $RUN/domino --dflash $RUN/dflash --limit 20 --quality --output $RUN/bench
