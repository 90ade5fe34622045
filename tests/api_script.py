"""A training script that uses the Python API (run by tests/test_api.py in a subprocess, to be killed).

    python tests/api_script.py RUN_DIR MODEL_DIR [resume]
"""
import sys

import mugrpo


def ones(prompts, completions, **kwargs):
    """TRL-style batched reward: the fraction of '1' characters (learnable by the tiny model)."""
    assert kwargs["answer"] == [str(len(p)) for p in prompts]  # the rows' other columns arrive as lists
    return [sum(ch == "1" for ch in c) / max(len(c), 1) for c in completions]


def short(completion, answer, item):
    return 1.0 - len(completion) / 8


ROWS = [{"prompt": f"q{i}{'x' * (i % 5)}", "answer": str(len(f"q{i}{'x' * (i % 5)}")), "level": i % 3}
        for i in range(40)]
CONFIG = {"model.name": None, "task": {"few_shot": [], "instruction": "", "eval_size": 4}, "rollout.max_new_tokens": 8,
          "train.autocast": "none", "train.progress": False, "schedule.total_updates": 8, "schedule.num_stages": 2,
          "optim.lr": 1e-2, "train.deterministic": True, "train.threads": 1, "checkpoint.every_updates": 2,
          "eval.num_items": 0}

if __name__ == "__main__":
    run_dir, model_dir = sys.argv[1], sys.argv[2]
    funcs = [ones, short]
    if len(sys.argv) > 3 and sys.argv[3] == "resume":
        mugrpo.train(run_dir=run_dir, resume=True, reward_funcs=funcs, train_dataset=ROWS)
    else:
        mugrpo.train({**CONFIG, "model.name": model_dir}, reward_funcs=funcs, reward_weights=[1.0, 0.25],
                     train_dataset=ROWS, run_dir=run_dir)
