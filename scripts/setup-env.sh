#!/usr/bin/env bash
# Create (or reuse) the CPU development environment in .venv: torch + torchvision on the CPU, the
# pinned training stack (pyproject's `train` extra) and the test tools. Safe to run repeatedly.
#   bash scripts/setup-env.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
# torchvision must match torch exactly (LLaMA-Factory imports it for Qwen3.5's video processor).
TORCH_PINS=${TORCH_PINS:-"torch==2.14.1 torchvision==0.29.1"}

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup-env] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086
python -m pip install --quiet $TORCH_PINS
python -m pip install --quiet -e '.[train,test]'
python - <<'PY'
from importlib.metadata import version
print("[setup-env] ready:", ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "peft", "llamafactory")))
PY
