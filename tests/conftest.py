import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # reward modules for task.reward_fn live here
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from mugrpo.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


# Overrides that make a run of the tiny model take seconds: no few-shot, short answers.
TINY_OVERRIDES = ["task.few_shot=[]", "task.instruction=", "rollout.max_new_tokens=8", "train.autocast=none",
                  "task.reward_fn=toy_rewards:frac_ones", "train.progress=false"]
