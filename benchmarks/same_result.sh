#!/usr/bin/env bash
# Does this checkout train exactly as an earlier commit does? Runs the same short deterministic run
# of the tiny model (built in code, HF engine, float32) with both, then compares every metric
# (perf/* and time_s aside) and the final weights bitwise. Used to check refactors (issue 19).
#   bash benchmarks/same_result.sh OLD_COMMIT [key=value ... | --replay SOURCE_RUN]
# Needs .venv (bash scripts/setup.sh). Writes into a temporary folder; prints the differences.
# MUGRPO_SAME_MODEL=DIR uses the tiny model in DIR (built there if missing) instead of a fresh one, so a
# replay source made with that model can be replayed by both sides (replay checks model.name).
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: bash benchmarks/same_result.sh OLD_COMMIT [key=value ...]}; shift
here=$PWD; tmp=$(mktemp -d); trap 'git -C "$here" worktree remove --force "$tmp/old" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/old" "$old"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
model=${MUGRPO_SAME_MODEL:-$tmp/model}
[ -f "$model/config.json" ] || PYTHONPATH=$here .venv/bin/python -c "from mugrpo.models.tiny import build_tiny_model; build_tiny_model('$model')"
args=(model.name="$model" "task.few_shot=[]" task.instruction= rollout.max_new_tokens=8 train.autocast=none
      task.reward_fn=toy_rewards:frac_ones train.progress=false rollout.engine=hf train.deterministic=true
      schedule.total_updates=8 schedule.num_stages=2 eval.num_items=16 "$@")
for side in old new; do
  src=$here; [ $side = old ] && src=$tmp/old
  (cd "$src" && PYTHONPATH=$src:$here/tests "$here/.venv/bin/python" -m mugrpo train --run-dir "$tmp/run_$side" "${args[@]}") \
    > "$tmp/log_$side.txt" 2>&1 || { echo "the $side run failed:"; tail -5 "$tmp/log_$side.txt"; exit 1; }
done
PYTHONPATH=$here .venv/bin/python - "$tmp" <<'PY'
import json, sys
import torch
from safetensors.torch import load_file
tmp = sys.argv[1]
def records(side):
    return [{k: v for k, v in json.loads(line).items() if not (k.startswith("perf/") or k == "time_s")}
            for line in open(f"{tmp}/run_{side}/metrics.jsonl")]
old, new = records("old"), records("new")
diffs = [(a.get("kind"), a.get("update"), k, a.get(k), b.get(k)) for a, b in zip(old, new)
         for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
for d in diffs[:20]:
    print("differs:", *d)
wa, wb = load_file(f"{tmp}/run_old/final_model/model.safetensors"), load_file(f"{tmp}/run_new/final_model/model.safetensors")
same_w = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
print(f"records {len(old)} vs {len(new)}; metric differences: {len(diffs)}; final weights bitwise equal: {same_w}")
sys.exit(0 if (not diffs and same_w and len(old) == len(new)) else 1)
PY
