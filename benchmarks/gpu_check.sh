#!/usr/bin/env bash
# GPU check for the fast path (#23): the reference dflash 0.1.0 loop and speculant on the same
# weights (the shipped pair and a random ~226M-parameter pair (--hidden 1536 --layers 8)), on a CUDA GPU, through
# benchmarks/fast_path.py: tokens/s per arm, the ratios and whether the tokens are identical.
#
#   benchmarks/gpu_check.sh                       # CUDA; installs into ~/.cache/speculant-gpu-check
#   benchmarks/gpu_check.sh --device cpu --small  # the same steps on a CPU, a smoke-sized run
#   benchmarks/gpu_check.sh --no-install ...      # use the python on PATH (speculant[torch] installed)
#
# Needs only a package registry (pip). Two environments:
#   venv           pip install -e ".[torch,bench]" (the registry's default torch: a CUDA build on
#                  Linux x86-64).
#   ref-venv       the reference: transformers 5.15.0 (dflash 0.1.0 needs it; speculant runs a newer
#                  one) and dflash 0.1.0, installed --no-deps, with secondary pins from
#                  tests/reference/constraints.txt; it reads torch from the first venv through a .pth
#                  file placed after its own site-packages, so the large CUDA torch is installed once
#                  (a reference venv that has its own torch, as scripts/make_reference_venv.sh builds,
#                  is used as it is).
# Environment: PYTHON (default python3), REPEATS (3), MAX_NEW (64), COMPILE (auto), DTYPE (float32),
# SPECULANT_GPU_VENV, SPECULANT_REF_VENV. Every other argument goes to fast_path.py.
# FAMILY (unset): also run a mid pair of that tiny family (e.g. qwen3_5, a Gated DeltaNet hybrid
# compiled with its states recorded in the graphs), --compile auto,off, after the main run.
# BATCH (unset): also run benchmarks/batch_generate.py on the mid pair (issue #39: speculative
# against plain batched decoding at BATCH's comma-separated concurrencies, e.g. 1,4,16,32).
# TREES (unset): also run benchmarks/tree_speed.py on the shipped pair (issue #40: trees against
# fixed chains, compiled, greedy and at temperature 0.8), with TREES as its --arms
# (e.g. chain,adaptive,adaptive_tree,tree8,tree16,tree32) over TREE_PROMPTS prompts (8).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/speculant-gpu-check"  # outside the work tree
VENV="${SPECULANT_GPU_VENV:-$CACHE/venv}"
REF="${SPECULANT_REF_VENV:-$CACHE/ref-venv}"
DEVICE=cuda
INSTALL=1
PASS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        *) PASS+=("$1"); shift ;;
    esac
done
log() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
START=$(date +%s)
mkdir -p "$CACHE"

if [[ "$INSTALL" == 1 ]]; then
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    log "installing speculant[torch,bench] into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[torch,bench]"
    PY="$VENV/bin/python"
else
    PY="$(command -v python)"
fi

# The reference venv: its own transformers 5.15 first, then this environment's site-packages (torch).
if [[ ! -x "$REF/bin/python" ]]; then
    log "creating $REF"
    "$PY" -m venv --without-pip "$REF" 2>/dev/null || "$PYTHON" -m venv --without-pip "$REF"
fi
REF_SITE="$("$REF/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$REF/bin/python" -c 'import torch' 2>/dev/null; then  # a venv with its own torch is left as it is
    "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$REF_SITE/zz_speculant_torch.pth"
fi
if ! "$REF/bin/python" -c 'import transformers, dflash, sys; sys.exit(not transformers.__version__.startswith("5.15."))' 2>/dev/null; then
    log "installing transformers 5.15.0 and dflash 0.1.0 into $REF"
    PINS=$(grep -v '^#' tests/reference/constraints.txt | grep -E '^(huggingface-hub|tokenizers|safetensors)==' || true)
    # shellcheck disable=SC2086  (one pin per word)
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$REF_SITE" --upgrade \
        "transformers==5.15.0" "dflash==0.1.0" $PINS
fi
"$REF/bin/python" - <<'EOF'
import torch, transformers
from dflash.model import dflash_generate  # noqa: F401
assert transformers.__version__.startswith("5.15."), transformers.__version__
print(f"[gpu_check] reference: torch {torch.__version__} (cuda {torch.version.cuda}), transformers {transformers.__version__}")
EOF

"$PY" - "$DEVICE" <<'EOF'
import sys, torch
device = sys.argv[1]
if device.startswith("cuda"):
    assert torch.cuda.is_available(), "no CUDA device visible to torch; run with --device cpu to check the steps"
    print(f"[gpu_check] {torch.cuda.get_device_name(0)}, torch {torch.__version__} (cuda {torch.version.cuda})")
else:
    print(f"[gpu_check] device {device}, torch {torch.__version__}")
EOF
log "set up in $(( $(date +%s) - START )) s; running benchmarks/fast_path.py"

SPECULANT_REF_VENV="$REF" "$PY" benchmarks/fast_path.py --backend torch --device "$DEVICE" \
    --dtype "${DTYPE:-float32}" --repeats "${REPEATS:-3}" --max-new-tokens "${MAX_NEW:-64}" \
    --compile "${COMPILE:-auto}" --draft-ahead "${DRAFT_AHEAD:-auto,off}" --verifier "${VERIFIER:-auto,adaptive}" \
    --pairs shipped,mid --hidden 1536 --layers 8 "${PASS[@]}"
if [[ -n "${FAMILY:-}" ]]; then
    log "the $FAMILY mid pair"
    SPECULANT_REF_VENV="$REF" "$PY" benchmarks/fast_path.py --backend torch --device "$DEVICE" \
        --dtype "${DTYPE:-float32}" --repeats "${REPEATS:-3}" --max-new-tokens "${MAX_NEW:-64}" \
        --compile auto,off --pairs mid --family "$FAMILY" --hidden 1024 --layers 8 "${PASS[@]}"
fi
if [[ -n "${BATCH:-}" ]]; then
    log "batched requests at concurrency $BATCH"
    "$PY" benchmarks/batch_generate.py --mid 1536,8 --concurrency "$BATCH" --arms spec,plain,single \
        --max-new-tokens "${MAX_NEW:-64}" --repeats "${REPEATS:-3}" --solo-prompts 4
fi
if [[ -n "${TREES:-}" ]]; then
    for temperature in 0 0.8; do
        log "trees against chains at temperature $temperature"
        "$PY" benchmarks/tree_speed.py --device "$DEVICE" --dtype "${DTYPE:-float32}" --compile "${COMPILE:-auto}" \
            --arms "$TREES" --prompts "${TREE_PROMPTS:-8}" --temperature "$temperature" --repeats "${REPEATS:-3}" --max-new-tokens "${MAX_NEW:-64}"
    done
fi
log "done in $(( $(date +%s) - START )) s"
