#!/usr/bin/env bash
# Build the virtual environment that runs the official reference package `dflash` 0.1.0
# (torch path and MLX path) for speculant's parity tests.
#
#   scripts/make_reference_venv.sh [DIR]      (default: <repo>/.ref-venv, git-ignored)
#
# Why a separate environment: dflash 0.1.0's torch loop crops transformers' DynamicCache with a
# positive length, which transformers >= 5.2x rejects, so it needs the transformers release the
# package pins (5.15.0), while speculant itself runs on the newest one.
#
# Idempotent: a marker file records the exact specification it was built from; when it matches,
# the script exits at once. Concurrent callers are serialised with flock when available.
# Never pulls a CUDA torch: the CPU wheel from /opt/wheels (pip.conf find-links) is installed by
# file when present, otherwise `torch==2.13.0+cpu` is required explicitly.
#
# Environment: SPECULANT_REF_PYTHON (interpreter used to create the venv; default python3).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-${SPECULANT_REF_VENV:-$REPO_ROOT/.ref-venv}}"
case "$VENV_DIR" in /*) ;; *) VENV_DIR="$PWD/$VENV_DIR" ;; esac
PYTHON="${SPECULANT_REF_PYTHON:-python3}"

TORCH_VERSION="2.13.0"
TRANSFORMERS_VERSION="5.15.0"   # the exact pin in dflash 0.1.0's own `local` extra (linux)
DFLASH_VERSION="0.1.0"
MLX_VERSION="0.32.4"
MLX_LM_VERSION="0.32.2"
CONSTRAINTS="$REPO_ROOT/tests/reference/constraints.txt"

CONSTRAINT_PINS=""
if [[ -f "$CONSTRAINTS" ]]; then
    CONSTRAINT_PINS="$(grep -v '^#' "$CONSTRAINTS" | tr '\n' ' ' || true)"
fi
# Everything that determines the environment goes into the marker, so a change rebuilds it.
SPEC="speculant-ref-venv v1
torch==$TORCH_VERSION+cpu
transformers==$TRANSFORMERS_VERSION
dflash==$DFLASH_VERSION (--no-deps)
mlx[cpu]==$MLX_VERSION
mlx-lm==$MLX_LM_VERSION
constraints: $CONSTRAINT_PINS"
MARKER="$VENV_DIR/.speculant-ref-complete"

log() { printf '[make_reference_venv] %s\n' "$*" >&2; }

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$SPEC" && -x "$VENV_DIR/bin/python" ]]; then
    log "up to date: $VENV_DIR"
    exit 0
fi

mkdir -p "$VENV_DIR"
LOCK="$VENV_DIR/.build.lock"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$LOCK"
    flock 9
    # Another process may have finished the build while we waited.
    if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$SPEC" ]]; then
        log "up to date (built concurrently): $VENV_DIR"
        exit 0
    fi
fi

START=$(date +%s)
rm -f "$MARKER"
if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    log "creating venv at $VENV_DIR with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV_DIR"   # deliberately without --system-site-packages
fi
VPY="$VENV_DIR/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check --no-input)

TORCH_WHEEL="$(ls /opt/wheels/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -n1 || true)"
if [[ -n "$TORCH_WHEEL" ]]; then
    TORCH_REQ="$TORCH_WHEEL"
else
    TORCH_REQ="torch==$TORCH_VERSION+cpu"
fi

CONSTRAINT_ARGS=()
[[ -f "$CONSTRAINTS" ]] && CONSTRAINT_ARGS=(-c "$CONSTRAINTS")

log "installing torch ($TORCH_REQ), transformers $TRANSFORMERS_VERSION, mlx[cpu] $MLX_VERSION, mlx-lm $MLX_LM_VERSION"
"${PIP[@]}" install "${CONSTRAINT_ARGS[@]}" \
    "$TORCH_REQ" \
    "transformers==$TRANSFORMERS_VERSION" \
    safetensors tokenizers numpy typing-extensions huggingface-hub \
    "mlx[cpu]==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION"

# The package's declared deps (datasets, tqdm/requests pins, torch/transformers extras) are
# for its CLI and benchmark; model.py and model_mlx.py need only what is installed above.
log "installing dflash==$DFLASH_VERSION --no-deps"
"${PIP[@]}" install --no-deps "dflash==$DFLASH_VERSION"

log "checking imports"
"$VPY" - <<'EOF'
import importlib.metadata as md
import torch, transformers, mlx.core, mlx_lm
from dflash.model import DFlashDraftModel, DFlash2DraftModel, dflash_generate  # noqa: F401
from dflash import model_mlx  # noqa: F401
assert torch.version.cuda is None, f"expected the CPU torch build, got CUDA {torch.version.cuda}"
assert transformers.__version__.startswith("5.15."), transformers.__version__
for name in ("torch", "transformers", "dflash", "mlx", "mlx-lm", "tokenizers", "safetensors",
             "numpy", "huggingface-hub"):
    print(f"  {name}=={md.version(name)}")
EOF

"${PIP[@]}" freeze > "$VENV_DIR/speculant-ref-freeze.txt"
printf '%s' "$SPEC" > "$MARKER"
log "done in $(( $(date +%s) - START )) s: $VENV_DIR"
