#!/usr/bin/env bash
# Reproduce the shipped SmolLM2-135M drafts, their learning curves and the README's results on a CPU machine.
# Rerun it after an interruption: regeneration, feature caching, training and scoring resume; finished steps are kept.
# The costly state lives in the repository: the regenerated conversations (recipes/smollm2-135m/data, committed piece
# by piece as each lands) and the shipped drafts. Each session regenerates the pieces of 250 prompts up to PIECES
# (default 56: the 4,000 prompts the shipped drafts first trained on, then 6,000, then 4,000 ShareGPT prompts added
# after the pool), then trains the shipped drafts STEPS more steps (default 5000: 10,000 conversations) on every
# committed piece. A session that ends first keeps its finished pieces, and the next goes on from them. COMMIT=0
# leaves the new pieces and drafts uncommitted.
set -euo pipefail
cd "$(dirname "$0")/../.."
RECIPE=recipes/smollm2-135m
RUN=runs/smollm2
PIECES=${PIECES:-56}
STEPS=${STEPS:-5000}
COMMIT=${COMMIT:-1}
mkdir -p $RUN
# Written each time (the same bytes, a few seconds): prompts added at its end reach a machine that has the file.
python $RECIPE/prepare_prompts.py --output $RUN/prompts.jsonl --held-out-output $RUN/held_out_prompts.jsonl
# The target's responses, greedy, 256 tokens at most, 250 prompts a piece; committed pieces are skipped.
python $RECIPE/pieces.py regenerate --prompts $RUN/prompts.jsonl --pieces "$PIECES" $([ "$COMMIT" = 1 ] && echo --commit)
# The training data: every committed piece, whichever session regenerated it.
NAME=$(ls $RECIPE/data/piece-*.json | wc -l)pieces
DATA=$RUN/data_$NAME.jsonl
FEATURES=$RUN/features_${NAME}_soft16
[ -f $DATA ] || python $RECIPE/pieces.py build --prompts $RUN/prompts.jsonl --output $DATA
domino-spec generate-data --target smollm2-135m --prompts $RUN/held_out_prompts.jsonl --output $RUN/held_out.jsonl \
    --max-new-tokens 256 --batch-size 48 --limit 100
# The target's features of every conversation and its 16 likeliest next tokens (the soft targets the drafts learn
# from), one prefill each: ~11 minutes per 1,000 conversations on a 2-core CPU (the target's peak there). The store
# of fewer pieces, where one is kept, holds the first conversations already: only the new pieces' are computed.
EXTEND=$(ls -d $RUN/features_*pieces_soft16 2>/dev/null | grep -vx "$FEATURES" | sort -V | tail -1 || true)
domino-spec cache-features --config $RECIPE/train.yaml --data $DATA --output $FEATURES --soft_targets 16 \
    ${EXTEND:+--extend $EXTEND}
# The shipped drafts, with and without the Domino head (same data, steps and seed), go on training at once: their
# weights, a fresh optimizer and a short warm-up, their curves counting steps, examples and CPU-hours on from those
# that shipped them ($RECIPE/shipped_curve.txt). Where no DFlash-only draft was kept, its first leg starts from the
# Domino draft's backbone (its curve going on from the Domino draft's): the twin at equal data and steps.
# Another `--variant "NAME=TRAIN FLAGS"` adds a recipe change to compare, e.g. "block-16=--block_size 16" (a fresh
# draft), "hard-labels=--soft_targets 0" (the target's greedy tokens alone).
# The cheaper labels keep ShareGPT's own answers to the same prompts and learn the target from its soft targets over
# them (one prefill per conversation, no decoding): prepare_prompts.py --kept-output $RUN/kept_conversations.jsonl,
# then `domino-spec generate-data --keep-responses --prompts $RUN/kept_conversations.jsonl --output $RUN/kept.jsonl
# --max-new-tokens 256`, `cache-features --data $RUN/kept.jsonl --soft_targets 16` and a variant with --data, --features
# and --soft_targets 16 of its own, compared at equal CPU-hours on the same held-out proxy (learning_curve.py
# --label-cpu-hours NAME=HOURS counts what labelling each variant's data cost: the pieces' manifests for regenerated data).
# Each leg reads the data in another order (its seed, the piece count) at a third of the first leg's learning rate,
# under bf16 autocast where the CPU computes in bf16 natively (AVX-512 BF16 or AMX: more steps per CPU-hour at the
# same loss, which the curve's CPU-hours show); elsewhere bf16 is emulated, slower than fp32.
WARM="--warmup_steps 100"
BF16=$(python -c "import torch; print(int(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))")
LEG="--soft_targets 16 --learning_rate 0.0002 --seed ${NAME%pieces}$([ "$BF16" = 1 ] && echo " --bf16")"
PREVIOUS=$(cat $RECIPE/shipped_curve.txt)
DFLASH=$RECIPE/dflash-bf16
TWIN=$([ -d $DFLASH ] && echo $DFLASH || echo checkpoints/domino-smollm2-135m)
TWIN_CURVE=$([ -d $DFLASH ] && echo dflash || echo domino)
CURVES=$RUN/curves_${NAME}_${STEPS}steps
CURVE=benchmarks/results/learning_curve_smollm2-135m_${NAME}_${STEPS}steps.json
[ "$CURVE" != "$PREVIOUS" ] || { echo "the shipped drafts already trained $STEPS steps on $NAME: regenerate more"; exit 1; }
python benchmarks/learning_curve.py --config $RECIPE/train.yaml --data $DATA --features $FEATURES \
    --eval-data $RUN/held_out.jsonl --steps $STEPS --eval-every $((STEPS / 2)) --tau-prompts 2 --tau-tokens 96 \
    --runs $CURVES --parallel --continues "$PREVIOUS" --continues-curve dflash=$TWIN_CURVE \
    --variant "domino=--init_from checkpoints/domino-smollm2-135m $WARM $LEG" \
    --variant "dflash=--init_from $TWIN --use_domino_head false $WARM $LEG" --output $CURVE
# Both drafts in bf16, as shipped; the bench results then go on the shipped model card.
python $RECIPE/ship.py $CURVES/domino checkpoints/domino-smollm2-135m --curve $CURVE
python $RECIPE/ship.py $CURVES/dflash $DFLASH --curve $CURVE
# The README's bench: every method beside the twin, on the bench sets and held-out reasoning prompts. --quality scores
# HumanEval by running SmolLM2's programs here, in the sandbox the README describes.
domino-spec bench --domino checkpoints/domino-smollm2-135m --dflash $DFLASH \
    --eval-sets mt-bench,humaneval,gsm-symbolic,reasoning-held-out --limit 10 --max-new-tokens 128 --quality \
    --allow-code-execution --methods plain-eager,plain,plain-native,prompt-lookup,dflash,domino-hf,domino,domino-alone \
    --output $RUN/bench
cp $RUN/bench/bench_results.json benchmarks/results/bench_smollm2-135m.json
cp $RUN/bench/bench_results.md benchmarks/results/bench_smollm2-135m.md
cp $RUN/bench/bench_acceptance.png benchmarks/results/bench_smollm2-135m_acceptance.png
python $RECIPE/ship.py $CURVES/domino checkpoints/domino-smollm2-135m --curve $CURVE --bench $RUN/bench/bench_results.json
# The next session's drafts go on from these.
echo $CURVE > $RECIPE/shipped_curve.txt
SHIPPED=(checkpoints/domino-smollm2-135m $DFLASH $RECIPE/shipped_curve.txt ${CURVE%.json}.{json,md,png}
         benchmarks/results/bench_smollm2-135m{.json,.md,_acceptance.png})
if [ "$COMMIT" = 1 ]; then
    git add "${SHIPPED[@]}" && git commit -m "SmolLM2-135M drafts trained $STEPS more steps on $NAME" -- "${SHIPPED[@]}"
fi
