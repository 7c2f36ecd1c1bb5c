#!/usr/bin/env bash
# Reproduce the model pair shipped in speculant/embedded/pair/ from the CPython standard library.
#
#   bash scripts/build_embedded_pair.sh [WORK_DIR]
#
# Every step is seeded and resumable: rerun the script after an interruption and finished steps
# are skipped, unfinished training resumes from its last checkpoint. On a 2-core CPU the whole run
# takes about three and a half hours. The corpus (file list, Python version) is recorded in MANIFEST.json; a
# different Python version gives a different corpus and so different weights.
set -euo pipefail

WORK=${1:-build/embedded-pair}
SEED=0
BLOCK=8
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$WORK"

# 1. byte-level BPE tokenizer (8192 entries, <|endoftext|> and <|mask|>) on the stdlib without its tests
[ -f "$WORK/tokenizer/tokenizer.json" ] ||
  speculant train tokenizer --out "$WORK/tokenizer" --vocab-size 8192

# 2. the target: Qwen3, hidden 192, 8 layers, trained on 512-token windows (5000 x 4 x 512 tokens)
[ -f "$WORK/target/model/training.json" ] ||
  speculant train target --tokenizer "$WORK/tokenizer" --out "$WORK/target" --hidden-size 192 --layers 8 \
    --seq-len 512 --batch 4 --steps 5000 --lr 1.5e-3 --seed $SEED --checkpoint-every 250

TARGET="$WORK/target/model"
# 3. training data for the drafters: corpus prompts continued greedily by the target itself
SEQ=(--sequences 2048 --prompt-len 64 --response-len 256 --sequences-file "$WORK/sequences.npy" --seed $SEED)

# training.json is written last, when a model is done
# DFlash: as the shipped draft was made, the 3000-step schedule, then resumed under a 12000-step
# one (the learning rate rises again at step 3000 and decays to the end)
step_of() { python -c "import json,sys; print(json.load(open(sys.argv[1]))['step'])" "$1" 2>/dev/null || echo 0; }
DFLASH=(--target "$TARGET" --out "$WORK/dflash" "${SEQ[@]}" --block-size $BLOCK --layers 2 --features 3 --anchors 32
        --batch 4 --lr 1e-3)
if ! grep -q '"steps": 12000' "$WORK/dflash/training.json" 2>/dev/null; then
  [ "$(step_of "$WORK/dflash/checkpoint/state.json")" -ge 3000 ] ||
    speculant train dflash "${DFLASH[@]}" --steps 3000 --checkpoint-every 250
  speculant train dflash "${DFLASH[@]}" --steps 12000 --checkpoint-every 500
fi

# DFlash2 starts from the trained DFlash (identity convolutions, zero successor codebook: it
# drafts exactly as DFlash does) and fine-tunes backbone, convolutions and selector together
[ -f "$WORK/dflash2/training.json" ] ||
  speculant train dflash2 --target "$TARGET" --out "$WORK/dflash2" "${SEQ[@]}" --block-size $BLOCK \
    --layers 2 --features 3 --anchors 32 --batch 4 --init-from "$WORK/dflash" --steps 1500 --lr 3e-4 --checkpoint-every 100

# MTP: as the shipped head was made, 250 steps of a 1500-step schedule, then resumed to end at 600
if [ ! -f "$WORK/mtp/training.json" ]; then
  [ -f "$WORK/mtp/checkpoint/state.json" ] ||
    speculant train mtp --target "$TARGET" --out "$WORK/mtp" "${SEQ[@]}" --batch 8 --steps 1500 --stop-at 250 \
      --lr 1e-3 --checkpoint-every 250
  speculant train mtp --target "$TARGET" --out "$WORK/mtp" "${SEQ[@]}" --batch 8 --steps 600 --lr 1e-3 --checkpoint-every 100
fi

# 4. copy into the package (weights in bfloat16), with checksums, token counts and this recipe
python scripts/package_embedded_pair.py "$WORK" speculant/embedded/pair
