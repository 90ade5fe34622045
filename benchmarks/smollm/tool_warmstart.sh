#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the two-call calculator task (a*b + c*d: a*b first, then <that> + c*d):
# the base model with and without the calculator, then a warm start on solved traces
# (mugrpo.warmstart.demos.calculator_rows) and the same evaluations of the warm-started model.
# Greedy, 64 held-out items (seed 1; the traces use seed 0). Writes benchmarks/results/smollm_tool_warmstart/result.json
# (in the suite's schema, benchmarks/suite.py: every evaluation and the timing as its figures; the parts
# themselves stay in benchmarks/cache/smollm_tool_warmstart/).
#   LR=1e-4 python -m benchmarks smollm_tool_warmstart [NUM_TRACES] [EPOCHS]   (8 traces per step; or bash this file)
# Needs .venv-vllm (bash scripts/setup_vllm.sh). A benchmark, not a test: it asserts nothing. A rerun keeps
# the base model's evaluations and redoes the warm start and what follows.
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:-64}; EPOCHS=${2:-2}
OUT=benchmarks/results/smollm_tool_warmstart; CACHE=benchmarks/cache/smollm_tool_warmstart
mkdir -p "$OUT" "$CACHE"
export PYTHONPATH=. OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv-vllm/bin/python
$PY - "$CACHE" "$N" <<'PY'
import json, sys
from mugrpo.warmstart.demos import calculator_rows, write_jsonl
cache, n = sys.argv[1], int(sys.argv[2])
write_jsonl(calculator_rows(n, seed=0, num_calls=2), f"{cache}/train.jsonl")
held = [{"question": r["question"], "answer": r["answer"]} for r in calculator_rows(64, seed=1, num_calls=2)]
write_jsonl(held, f"{cache}/eval.jsonl")
PY
TASK=(task.kind=math "task.few_shot=[]" "task.instruction=Use the calculate tool, then put your final answer within \\boxed{}." task.max_prompt_tokens=1024)
evaluate() {  # model label [extra overrides]
  local model=$1 label=$2; shift 2
  [ -f "$CACHE/eval_$label.json" ] && [ "$label" != "${label#base}" ] && return 0  # the base model's: kept across reruns
  $PY -m mugrpo eval --model "$model" --task "calc=$CACHE/eval.jsonl" --k 0 --max-new-tokens 256 \
    --out "$CACHE/eval_$label.json" --samples "$CACHE/samples_$label.jsonl" "${TASK[@]}" "$@" > "$CACHE/eval_$label.log" 2>&1 \
    || { echo "eval $label failed:"; tail -5 "$CACHE/eval_$label.log"; }
}
echo "capability: $($PY -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"
t0=$(date +%s)
evaluate smollm2-135m-instruct base_tool task.env=calculator
evaluate smollm2-135m-instruct base_notool
t1=$(date +%s)
rm -rf "$CACHE/sft"
$PY -m mugrpo sft --run-dir "$CACHE/sft" warmstart.data="$CACHE/train.jsonl" warmstart.epochs="$EPOCHS" \
  warmstart.lr=${LR:-1e-4} warmstart.batch_size=8 train.progress=false > "$CACHE/sft.log" 2>&1 || { echo "sft failed"; tail -20 "$CACHE/sft.log"; exit 1; }
t2=$(date +%s)
gzip -c "$CACHE/sft/metrics.jsonl" > "$OUT/sft_metrics.jsonl.gz"  # the raw log, compressed beside the result
evaluate "$CACHE/sft/final_model" sft_tool task.env=calculator
evaluate "$CACHE/sft/final_model" sft_notool
t3=$(date +%s)
echo "{\"num_traces\": $N, \"epochs\": $EPOCHS, \"eval_base_s\": $((t1-t0)), \"sft_s\": $((t2-t1)), \"eval_sft_s\": $((t3-t2))}" > "$CACHE/timing.json"
cat "$CACHE/timing.json"
# the suite's result (benchmarks/suite.py): every JSON above as its figures, with the machine and commit
$PY - "$OUT" "$CACHE" "$N" "$EPOCHS" "${LR:-1e-4}" <<'PY'
import sys
from pathlib import Path
from benchmarks.suite import read_figures, write_result
out, cache, n, epochs, lr = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
parts = [cache / f"{name}.json" for name in ("eval_base_notool", "eval_base_tool", "eval_sft_notool", "eval_sft_tool", "timing")]
figures = {p.stem: read_figures(p) for p in parts if p.is_file()}
write_result(out / "result.json", "smollm_tool_warmstart", figures, {"num_traces": n, "epochs": epochs, "lr": lr},
             argv=["bash", "benchmarks/smollm/tool_warmstart.sh", str(n), str(epochs)])
PY
