"""What a checkpoint's state holds (mugrpo.kit.checkpoint.RunState, RL's mugrpo.stages.state.RLState): the
folder names, and states saved before the split (issue 39) still load."""
import pytest

from mugrpo.kit.checkpoint import RunState, state_from_saved
from mugrpo.stages.state import RLState

pytestmark = pytest.mark.unit

OLD_WARM_START = {"stage": 0, "update_in_stage": 4, "update": 4, "bad_update_streak": 0, "num_skipped_updates": 1,
                  "elapsed_s": 2.5, "stage_first_log_ratio": None, "eval_pending": False, "world_size": 1}
"""A warm start's trainer_state.json as written before issue 39 (RL's fields, update_in_stage = update)."""


def test_a_warm_start_state_saved_with_rls_fields_loads_without_them():
    assert state_from_saved(OLD_WARM_START) == RunState(update=4, num_skipped_updates=1, elapsed_s=2.5)


def test_an_rl_state_loads_every_field():
    saved = {"stage": 2, "update_in_stage": 1, "update": 9, "bad_update_streak": 1, "num_skipped_updates": 1,
             "elapsed_s": 3.0, "stage_first_log_ratio": 0.25, "eval_pending": True, "world_size": 2}
    assert state_from_saved(saved, RLState) == RLState(update=9, bad_update_streak=1, num_skipped_updates=1,
                                                       elapsed_s=3.0, stage=2, update_in_stage=1,
                                                       stage_first_log_ratio=0.25, eval_pending=True)


def test_checkpoint_names_keep_their_format():
    # The names sort by global step first; a phase without stages is one stage (as warm starts were named).
    assert RunState(update=4).checkpoint_name() == "ckpt_000004_s000_u00004"
    assert RLState(update=12, stage=3, update_in_stage=0).checkpoint_name() == "ckpt_000012_s003_u00000"
