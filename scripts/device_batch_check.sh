#!/usr/bin/env bash
# Issue #39's GPU figures in one call on a lent GPU machine (the `device` tool: no network there,
# its image lacks pydantic): batched speculative decoding against plain batched decoding and the
# single stream, the padded and the flattened layouts, on the shipped pair and a mid pair
# (benchmarks/batch_generate.py), on CUDA. Results as JSON and logs in $OUT.
#
#   here:   scripts/device_batch_check.sh prepare      (the wheels the image lacks -> .whl/, ignored by git)
#   device: LIMIT=540 scripts/device_batch_check.sh run   (carry .whl)
#   a CPU smoke run of the same steps: NO_WHEELS=1 SMOKE=1 scripts/device_batch_check.sh run
#
# Environment: PYTHON (python3), OUT ($WORK/out), WORK (/tmp/batch-check), LIMIT (seconds in all,
# 540), MID (the mid pair, HIDDEN,LAYERS: 1024,16, about 200M parameters), CONCURRENCY (1,4,16,32).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHON=${PYTHON:-python3}
WORK=${WORK:-/tmp/batch-check}
OUT=${OUT:-$WORK/out}
LIMIT=${LIMIT:-540}
MID=${MID:-1024,16}
CONCURRENCY=${CONCURRENCY:-1,4,16,32}
mkdir -p "$WORK" "$OUT"

bench() {  # NAME ARGS...: one batch_generate run within the time left
  local name=$1; shift
  local left=$((LIMIT - SECONDS - 15))
  [ "$left" -gt 30 ] || { echo "skipped $name: no time left" | tee -a "$OUT/skipped.txt"; return; }
  echo "== $name ($left s left)"
  timeout "$left" $PYTHON benchmarks/batch_generate.py "$@" --out "$OUT/$name.json" 2>&1 \
    | grep -v "Loading weights" | tee "$OUT/$name.log"
}

run() {
  if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl
  fi
  export PYTHONPATH="$WORK/site:$PWD"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
  local new=128 repeats=3 solo=8
  if [ -n "${SMOKE:-}" ]; then new=8; repeats=1; solo=2; CONCURRENCY=1,2; MID=128,4; fi
  local flat=spec,plain,single,spec_flat,plain_flat
  bench shipped --concurrency "$CONCURRENCY" --max-new-tokens "$new" --repeats "$repeats" --solo-prompts "$solo" --arms "$flat"
  bench mid --mid "$MID" --concurrency "$CONCURRENCY" --max-new-tokens "$new" --repeats "$repeats" --solo-prompts 2 --arms "$flat"
  ls -la "$OUT"
}

prepare() {  # here: the wheels speculant needs beyond the machine's image (Python 3.12)
  grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
  rm -rf .whl && mkdir -p .whl
  $PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  du -sh .whl
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare | run" >&2; exit 2 ;;
esac
