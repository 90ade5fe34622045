#!/usr/bin/env bash
# Quickstart command 2: set up .venv if needed, then run the test suite (CPU, offline).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k veto`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest -q "$@"
