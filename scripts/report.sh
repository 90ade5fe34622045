#!/usr/bin/env bash
# Regenerate docs/REPORT.md and its figures (docs/report/*.png) with `mugrpo report`.
#
#   bash scripts/report.sh RUN_DIR [RUN_DIR ...]   report on finished runs (the first is the baseline
#                                                  of the speed-up columns), e.g. the default job:
#                                                  bash scripts/report.sh runs/grpo-* runs/mu-grpo-*
#   bash scripts/report.sh --tiny                  demo: trains two tiny runs (a 0.1M-parameter random
#                                                  character model, reward = fraction of "1"s; about a
#                                                  minute on 2 cores) and reports them, labelled TINY
#
# Environment: MUGRPO_PYTHON (default .venv/bin/python, set up by scripts/setup.sh),
# REPORT_TITLE, REPORT_LABELS (comma-separated run names), REPORT_LEVELS (reward levels),
# REPORT_EVAL_KEY (the eval metric, default eval/greedy_acc).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${MUGRPO_PYTHON:-}" ]; then
  bash scripts/setup.sh
  MUGRPO_PYTHON=.venv/bin/python
fi
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mugrpo() { "$MUGRPO_PYTHON" -m mugrpo "$@"; }

out=docs/report
intro=""
if [ "${1:-}" = "--tiny" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$MUGRPO_PYTHON" -c "from mugrpo.models.tiny import build_tiny_model; build_tiny_model('$work/tiny')"
  common=(model.name="$work/tiny" task.reward_fn=ones_reward:reward "task.few_shot=[]" task.instruction=
          task.size=1000 rollout.max_new_tokens=8 schedule.total_updates=16 optim.lr=3e-3
          eval.num_items=32 eval.num_samples=4 eval.every_updates=4 eval.every_stages=0 train.progress=false train.threads=1)
  mugrpo train --preset grpo --run-dir "$work/grpo" "${common[@]}"
  mugrpo train --preset mu-grpo --run-dir "$work/mu-grpo" "${common[@]}" schedule.num_stages=2
  set -- "$work/grpo" "$work/mu-grpo"
  REPORT_TITLE=${REPORT_TITLE:-"mugrpo report: TINY DEMO RUN (not the default job)"}
  REPORT_LABELS=${REPORT_LABELS:-"tiny-grpo,tiny-mu-grpo"}
  # greedy decoding soon emits only "1"s (greedy score 1.0); the sampled mean is the informative metric here
  REPORT_EVAL_KEY=${REPORT_EVAL_KEY:-eval/avg_at_4}
  intro="> **This is a tiny demonstration run, not the default job.** Model: a randomly initialised
> 0.1M-parameter character-level Llama (\`mugrpo.models.tiny\`); reward: the fraction of response
> characters equal to \"1\" (\`tests/ones_reward.py\`); 16 updates of 8 prompts x 8 responses of up
> to 8 tokens; grpo = 4 stages of mu = 4, mu-grpo = 2 stages of mu = 8; evaluation of 32 held-out
> prompts (greedy and 4 samples) every 4 updates. It shows what the report contains, not how the
> methods compare: at this size every phase takes a fraction of a second and the timings are
> dominated by noise from other jobs on a shared 2-core machine. Regenerate it with
> \`bash scripts/report.sh --tiny\`; replace it with the default job's runs with
> \`bash scripts/report.sh RUN_DIR RUN_DIR\`."
fi
[ $# -ge 1 ] || { echo "usage: bash scripts/report.sh RUN_DIR [RUN_DIR ...] | --tiny" >&2; exit 2; }

args=(--out "$out" --title "${REPORT_TITLE:-mugrpo report}")
[ -n "${REPORT_LABELS:-}" ] && args+=(--labels "$REPORT_LABELS")
[ -n "${REPORT_LEVELS:-}" ] && args+=(--levels "$REPORT_LEVELS")
[ -n "${REPORT_EVAL_KEY:-}" ] && args+=(--eval-key "$REPORT_EVAL_KEY")
rm -f "$out"/*.png "$out"/summary.*
mugrpo report "$@" "${args[@]}"

{
  sed -n '1p' "$out/summary.md"                      # the title
  echo
  [ -n "$intro" ] && { echo "$intro"; echo; }
  echo "Runs compared (\`config.yaml\` of each):"
  echo
  for run in "$@"; do
    "$MUGRPO_PYTHON" - "$run" <<'EOF'
import sys, yaml
c = yaml.safe_load(open(f"{sys.argv[1]}/config.yaml"))
s, r = c["schedule"], c["rollout"]
print(f"- `{c['preset']}`: model {c['model']['name'].split('/')[-1]}, task {c['task']['name']}, "
      f"{s['total_updates']} updates, num_stages={s['num_stages']}, updates_per_stage={s['updates_per_stage']}, "
      f"{s['prompts_per_update']} prompts x G={r['group_size']} per update, max_new_tokens={r['max_new_tokens']}, "
      f"lr={c['optim']['lr']}, engine={r['engine']}")
EOF
  done
  echo
  echo "Generated $(date -u +%Y-%m-%d) at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) on" \
       "$(nproc) CPU cores ($(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1 || echo unknown CPU))."
  echo
  sed '1d' "$out/summary.md" | sed -E 's#\]\(([A-Za-z0-9_.-]+\.png)\)#](report/\1)#'
} > docs/REPORT.md
echo "[report] wrote docs/REPORT.md and $out/"
ls -l "$out"/*.png
