"""An environment's ``reset`` prompt is cut by characters before it is tokenized
(mugrpo.rollout.envs.start, mugrpo.rollout.envs.render.trajectory_prompt_ids)."""
import sys

from memory_peak import peak_rss_kib

from conftest import TINY_OVERRIDES
from hostile_envs import HugeReset
from mugrpo.config import load_config
from mugrpo.models.tiny import build_char_tokenizer
from mugrpo.rollout.envs.start import start_trajectories
from mugrpo.rollout.tasks import Item


def test_a_huge_reset_prompt_is_cut_before_it_is_tokenized():
    task_cfg = load_config(overrides=[*TINY_OVERRIDES, "task.max_prompt_tokens=20"]).task
    started = start_trajectories(HugeReset, [Item("odd", "1"), Item("even", "1")], 2, 0, build_char_tokenizer(),
                                 task_cfg)
    huge, plain = started.prompts
    # 20 tokens of at most 5 characters: 101 characters kept (the message's end), then "u:" ... "\na:"
    assert len(huge) == 2 + 101 + 3 and len(plain) == len("u:even\na:")


def test_a_10_mb_reset_prompt_keeps_an_rl_run_under_1_gb(tiny_model_dir, tmp_path):
    code, kib, out = peak_rss_kib([sys.executable, "-m", "mugrpo", "train", "--run-dir", tmp_path / "run",
                                   f"model.name={tiny_model_dir}", *TINY_OVERRIDES, "task.env=hostile_envs:HugeReset",
                                   "task.prompt_too_long=skip", "schedule.total_updates=1", "schedule.num_stages=1",
                                   "schedule.prompts_per_update=4", "rollout.group_size=2", "eval.num_items=0",
                                   "train.threads=1"])
    assert code == 0, out
    assert kib < 1024 * 1024, f"peak RSS {kib / 1024:.0f} MiB"
