#!/usr/bin/env bash
# Train the DFlash and DFlash2 drafters of the real pair (SmolLM2-135M-Instruct) from scratch:
#   data (chat prompts + the target's own greedy answers) -> DFlash -> DFlash2 (started from the
#   DFlash draft) -> mean acceptance length on the held-out chat prompts.
#
#   TARGET=/path/to/smollm2-folder scripts/train_real_pair.sh            # PROFILE=cpu (default)
#   PROFILE=smoke TARGET=... scripts/train_real_pair.sh                  # minutes: checks the chain works
#
# Every step is seeded and resumable: rerun the same command after an interruption and each step
# continues from its last complete batch / checkpoint (a finished step is skipped). Sizes are
# parameters (environment variables below); a profile only sets their defaults:
#   cpu   - hours on a 2-core CPU: 1024 answers, 2000 + 3000 steps.
#   smoke - a few minutes: 64 answers of 64 tokens, 20 + 20 steps (not a useful drafter).
#   h200  - one H200 for ~7 minutes: 2048 prompts answered greedily and 3 more times sampled at
#           temperature 0.8 (1024 at a time), then each drafter for as many steps as fit in its time
#           budget (batch 16, 64 anchors); scripts/device_train_real_pair.sh runs it on a lent GPU.
# With a GPU (CUDA) the data, the target and the drafters all run on it (bf16 target and autocast).
# Precision: bf16 autocast only where the hardware has native bfloat16 (CUDA, or a CPU with
# avx512_bf16 / amx_bf16); otherwise --fp32 (bf16 autocast emulated in software is ~4x slower).
set -euo pipefail

PROFILE=${PROFILE:-cpu}
case "$PROFILE" in
  cpu)   d_prompts=1024 d_batch=32   d_rounds=0 d_dflash=2000  d_dflash2=3000  d_batch_train=4  d_anchors=32 d_budget= d_data_s= ;;
  smoke) d_prompts=64   d_batch=16   d_rounds=1 d_dflash=20    d_dflash2=20    d_batch_train=2  d_anchors=32 d_budget= d_data_s= ;;
  h200)  d_prompts=2048 d_batch=1024 d_rounds=3 d_dflash=50000 d_dflash2=50000 d_batch_train=16 d_anchors=64  d_budget=140 d_data_s=90 ;;
  *) echo "PROFILE=$PROFILE: choose cpu, smoke or h200" >&2; exit 2 ;;
esac
: "${TARGET:?set TARGET to the SmolLM2-135M-Instruct folder (config.json + model.safetensors + tokenizer)}"
RUN=${RUN:-runs/smollm2}                 # everything this recipe writes
SEED=${SEED:-0}
PROMPTS=${PROMPTS:-$d_prompts}           # training prompts the target answers
SAMPLED_ROUNDS=${SAMPLED_ROUNDS:-$d_rounds}  # more answers per prompt, sampled at temperature 0.8
DATA_SECONDS=${DATA_SECONDS:-$d_data_s}  # stop making data after this long (what is done is used; rerun to add)
HELD_OUT=${HELD_OUT:-32}                 # evaluation prompts, never trained on
GEN_BATCH=${GEN_BATCH:-$d_batch}         # prompts answered at once
MAX_NEW=${MAX_NEW:-$([ "$PROFILE" = smoke ] && echo 64 || echo 256)}
BLOCK=${BLOCK:-8}
LAYERS=${LAYERS:-2}                      # draft layers
FEATURES=${FEATURES:-$([ "$PROFILE" = h200 ] && echo 5 || echo 3)}  # target layers read, 1..N-3 spacing (3: 1, 14, 27)
ANCHORS=${ANCHORS:-$d_anchors}           # blocks per sequence per step
BATCH=${BATCH:-$d_batch_train}           # sequences per step
DFLASH_STEPS=${DFLASH_STEPS:-$d_dflash}
DFLASH2_STEPS=${DFLASH2_STEPS:-$d_dflash2}
LR=${LR:-6e-4}
MASK_TOKEN_ID=${MASK_TOKEN_ID:-16}       # SmolLM2 has no <|mask|>; 16 is <empty_output>, which chat never writes
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-$([ "$PROFILE" = h200 ] && echo 1000 || echo 100)}
TIME_BUDGET=${TIME_BUDGET:-$d_budget}    # seconds per drafter: lowers the steps to what fits (timed first)
EVALUATE=${EVALUATE:-1}                  # 0: skip the held-out evaluation (EXPORT still runs)
EVAL_NEW=${EVAL_NEW:-256}
NICE=${NICE:-nice -n 19}
# EXPORT=DIR (optional): write DIR/dflash and DIR/dflash2 (bf16 weights + manifest) after evaluating

PYTHON=${PYTHON:-python}
DFLASH2_FP32=()
if $PYTHON -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
   || grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
  PRECISION=()
  DATA_DTYPE=bfloat16
  # on CUDA, DFlash2's per-block vmap under bf16 autocast failed in softmax backward (input and grad
  # dtypes differ; H200, torch 2.11, 2026-12-04), so DFlash2 trains in float32 there
  $PYTHON -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && DFLASH2_FP32=(--fp32)
else
  PRECISION=(--fp32)
  DATA_DTYPE=float32
fi

speculant() { $NICE $PYTHON -m speculant "$@"; }
shape=(--block-size "$BLOCK" --layers "$LAYERS" --features "$FEATURES" --anchors "$ANCHORS" --batch "$BATCH"
       --mask-token-id "$MASK_TOKEN_ID" --lr "$LR" --seed "$SEED" --checkpoint-every "$CHECKPOINT_EVERY" "${PRECISION[@]}")
[ -n "$TIME_BUDGET" ] && shape+=(--time-budget "$TIME_BUDGET")

echo "== data: $PROMPTS prompts answered by $TARGET ($DATA_DTYPE, $GEN_BATCH at a time)"
speculant train data --target "$TARGET" --out "$RUN/data" --prompts "$PROMPTS" --held-out "$HELD_OUT" --seed "$SEED" \
  --batch "$GEN_BATCH" --max-new-tokens "$MAX_NEW" --dtype "$DATA_DTYPE" --sampled-rounds "$SAMPLED_ROUNDS" \
  ${DATA_SECONDS:+--max-seconds "$DATA_SECONDS"}

if [ ! -f "$RUN/dflash/model.safetensors" ]; then
  echo "== dflash: $DFLASH_STEPS steps"
  speculant train dflash --target "$TARGET" --data "$RUN/data" --out "$RUN/dflash" --steps "$DFLASH_STEPS" "${shape[@]}"
fi
if [ ! -f "$RUN/dflash2/model.safetensors" ]; then
  echo "== dflash2: $DFLASH2_STEPS steps, backbone from the DFlash draft"
  speculant train dflash2 --target "$TARGET" --data "$RUN/data" --out "$RUN/dflash2" --steps "$DFLASH2_STEPS" \
    --init-from "$RUN/dflash" "${shape[@]}" "${DFLASH2_FP32[@]}"
fi

for drafter in dflash dflash2; do
  evaluation=()
  if [ "$EVALUATE" = 1 ]; then
    echo "== evaluate $drafter: greedy, $HELD_OUT held-out chat prompts, up to $EVAL_NEW tokens"
    speculant train evaluate --target "$TARGET" --draft "$RUN/$drafter" --drafter "$drafter" --data "$RUN/data" \
      --max-new-tokens "$EVAL_NEW" --dtype float32 > "$RUN/$drafter-eval.json"
    cat "$RUN/$drafter-eval.json"
    evaluation=(--evaluation "$RUN/$drafter-eval.json")
  fi
  if [ -n "${EXPORT:-}" ]; then  # e.g. EXPORT=speculant/pairs/smollm2: the shipped folders
    speculant train export --draft "$RUN/$drafter" --out "$EXPORT/$drafter" "${evaluation[@]}"
  fi
done
