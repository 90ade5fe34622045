#!/usr/bin/env bash
# Does this checkout train exactly as an earlier commit does? Runs the same short deterministic run
# of the tiny model (built in code, HF engine, float32) with both, then compares every metric
# (perf/* and eval/perf/* timings and time_s aside; a warm start's own metrics too) and the final weights bitwise. Used to
# check refactors (issues 19, 39).
#   bash benchmarks/same_result.sh OLD_COMMIT [key=value ... | --replay SOURCE_RUN]   one train run
#   bash benchmarks/same_result.sh OLD_COMMIT --sft [key=value ...]                   one sft run
#   bash benchmarks/same_result.sh OLD_COMMIT --all                                  the seven runs below
# --all: the default tiny run, a tool environment, dynamic sampling, a correction, a replay (of the old
# side's default run), a `mugrpo sft` run and a `mugrpo train warmstart.data=...` run; one line each.
# Needs .venv (bash scripts/setup.sh). Writes into a temporary folder; prints the differences.
# MUGRPO_SAME_MODEL=DIR uses the tiny model in DIR (built there if missing) instead of a fresh one, so a
# replay source made with that model can be replayed by both sides (replay checks model.name).
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: bash benchmarks/same_result.sh OLD_COMMIT [--all | --sft | key=value ...]}; shift
here=$PWD; tmp=$(mktemp -d); trap 'git -C "$here" worktree remove --force "$tmp/old" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/old" "$old"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
model=${MUGRPO_SAME_MODEL:-$tmp/model}
[ -f "$model/config.json" ] || PYTHONPATH=$here .venv/bin/python -c "from mugrpo.models.tiny import build_tiny_model; build_tiny_model('$model')"
base=(model.name="$model" "task.few_shot=[]" task.instruction= rollout.max_new_tokens=8 train.autocast=none
      task.reward_fn=toy_rewards:frac_ones train.progress=false rollout.engine=hf train.deterministic=true
      schedule.total_updates=8 schedule.num_stages=2 eval.num_items=16)
demos=$tmp/demos.jsonl
for i in 0 1 2 3 4 5; do
  echo "{\"messages\": [{\"role\": \"user\", \"content\": \"q$i\"}, {\"role\": \"assistant\", \"content\": \"1101$i\"}]}"
done > "$demos"
sft=(model.name="$model" warmstart.data="$demos" train.autocast=none train.progress=false train.deterministic=true
     warmstart.batch_size=2 warmstart.steps=5 warmstart.checkpoint_every=2)

compare() {  # compare NAME VERB ARGS...: run VERB with ARGS under both checkouts; one line of result
  local name=$1 verb=$2; shift 2
  for side in old new; do
    local src=$here; [ $side = old ] && src=$tmp/old
    (cd "$src" && PYTHONPATH=$src:$here/tests "$here/.venv/bin/python" -m mugrpo "$verb" --run-dir "$tmp/${name}_$side" "$@") \
      > "$tmp/log_${name}_$side.txt" 2>&1 || { echo "$name: the $side run failed:"; tail -5 "$tmp/log_${name}_$side.txt"; return 1; }
  done
  PYTHONPATH=$here .venv/bin/python - "$tmp/${name}_old" "$tmp/${name}_new" "$name" <<'PY'
import json, os, sys
import torch
from safetensors.torch import load_file
a_dir, b_dir, name = sys.argv[1:]
def records(run):
    out = []
    for sub in ("warmstart/metrics.jsonl", "metrics.jsonl"):  # a train run's warm start first, then its own
        if os.path.isfile(f"{run}/{sub}"):
            out += [{k: v for k, v in json.loads(line).items() if not ("perf/" in k or k == "time_s")}
                    for line in open(f"{run}/{sub}")]
    return out
old, new = records(a_dir), records(b_dir)
diffs = [(a.get("kind"), a.get("update"), k, a.get(k), b.get(k)) for a, b in zip(old, new)
         for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
for d in diffs[:20]:
    print(f"{name}: differs:", *d)
wa, wb = load_file(f"{a_dir}/final_model/model.safetensors"), load_file(f"{b_dir}/final_model/model.safetensors")
same_w = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
print(f"{name}: records {len(old)} vs {len(new)}; metric differences: {len(diffs)}; final weights bitwise equal: {same_w}")
sys.exit(0 if (not diffs and same_w and len(old) == len(new)) else 1)
PY
}

if [ "${1:-}" = --all ]; then
  failed=0
  compare default train "${base[@]}" || failed=1
  compare tools train "${base[@]}" task.env=calculator env.max_turns=2 rollout.max_new_tokens=16 \
    task.max_prompt_tokens=1000 || failed=1
  compare dynamic train "${base[@]}" task.reward_fn=sparse_rewards:has_one rollout.dynamic_sampling=true || failed=1
  compare correction train "${base[@]}" loss.correction=icepop loss.behavior_logprobs=trainer || failed=1
  compare replay train "${base[@]}" loss.correction=opsm --replay "$tmp/default_old" || failed=1
  compare sft sft "${sft[@]}" || failed=1
  compare warmstart train "${base[@]}" warmstart.data="$demos" warmstart.batch_size=2 warmstart.steps=5 \
    warmstart.checkpoint_every=2 || failed=1
  exit $failed
elif [ "${1:-}" = --sft ]; then
  shift; compare run sft "${sft[@]}" "$@"
else
  compare run train "${base[@]}" "$@"
fi
