#!/usr/bin/env bash
# Quickstart command 1: set up .venv if needed, then `mugrpo train` (default: the built-in job).
# Extra arguments go to `mugrpo train`, e.g. `bash scripts/train.sh --preset grpo schedule.total_updates=64`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mugrpo train "$@"
