"""Replay sources (mugrpo/stages/replay.py): every refusal names its key or file; a good source copies exactly.

The source run directories are written by hand (config.yaml + stage shards), so these tests need no
model; the end-to-end replay (a replayed run equals the original) lives in tests/training/test_trainer.py.
"""

import json

import pytest
import torch

from mugrpo.config import dump_yaml, load_config
from mugrpo.stages import replay
from mugrpo.run_dir import SHARDS_FILE, RunDir, shard_path
from mugrpo.stages.data import StageData

pytestmark = pytest.mark.unit

BASE = ["model.name=/models/tiny", "task.few_shot=[]", "task.instruction=", "schedule.total_updates=4",
        "schedule.num_stages=1", "schedule.prompts_per_update=2", "rollout.group_size=2"]
PROMPTS = {0: [5, 6, 7], 1: [5, 8], 2: [9, 9, 9, 9]}


def fake_prompt_ids(item):
    return PROMPTS[item]


def stage(items=(0, 1), trainer=False, G=2) -> StageData:
    n = len(items) * G
    responses = [[3, 4, 1][: 1 + s % 3] for s in range(n)]
    logprobs = [[-0.5 * (j + 1) for j in range(len(r))] for r in responses]
    return StageData([PROMPTS[i] for i in items], responses, logprobs, torch.arange(n, dtype=torch.float32) % 2,
                     torch.tensor([1.0, -1.0] * (n // 2)), torch.ones(n, dtype=torch.bool), list(items), G,
                     trainer_logprobs=[[v - 0.01 for v in lp] for lp in logprobs] if trainer else None)


def write_run(run_dir, overrides=(), stages=1, groups_per_stage=8, trainer=False):
    """A source run directory: config.yaml and ``stages`` complete stages of ``groups_per_stage`` groups."""
    cfg = load_config("mu-grpo", overrides=BASE + list(overrides))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    for k in range(stages):
        folder = RunDir(run_dir).stage(k)
        items = [g % 2 for g in range(groups_per_stage)]
        stage(items, trainer).save(shard_path(folder, 0))
        (folder / SHARDS_FILE).write_text(json.dumps({"num_shards": 1, "num_groups": [groups_per_stage]}))
    return cfg


def new_cfg(*overrides):
    return load_config("mu-grpo", overrides=BASE + list(overrides))


def refusal(source, cfg) -> str:
    with pytest.raises(replay.ReplayError) as info:
        replay.check_source(source, cfg)
    return str(info.value)


def test_a_matching_source_is_accepted_and_copied(tmp_path):
    write_run(tmp_path / "src", stages=2)
    # the new run may differ in anything but the matched keys: here the loss and the lr
    src = replay.check_source(tmp_path / "src", new_cfg("loss.clip_mode=m2po", "optim.lr=1e-3"))
    assert src.stages == (0, 1)
    dest = tmp_path / "new" / "stages" / "stage_000"
    assert replay.copy_stage(src, 0, dest, need_trainer_logprobs=False, prompt_ids_of=fake_prompt_ids) == 8
    copied = StageData.load(shard_path(dest, 0))
    original = StageData.load(shard_path(RunDir(tmp_path / "src").stage(0), 0))
    assert copied.responses == original.responses and copied.behavior_logprobs == original.behavior_logprobs
    assert torch.equal(copied.advantages, original.advantages)
    assert json.loads((dest / SHARDS_FILE).read_text())["num_shards"] == 1


def test_not_a_directory_or_not_a_run(tmp_path):
    assert "is not a directory" in refusal(tmp_path / "nowhere", new_cfg())
    (tmp_path / "empty").mkdir()
    assert "no config.yaml" in refusal(tmp_path / "empty", new_cfg())
    write_run(tmp_path / "nostage", stages=0)
    assert "no complete stage" in refusal(tmp_path / "nostage", new_cfg())


@pytest.mark.parametrize("override, key", [
    ("model.name=/models/other", "model.name"),
    ("rollout.group_size=4", "rollout.group_size"),
    ("task.instruction=Think step by step.", "task.instruction"),
    ("task.few_shot=[{question: q, answer: a}]", "task.few_shot"),
    ("task.system_prompt=You are helpful.", "task.system_prompt"),
    ("rollout.temperature=0.7", "rollout.temperature"),
    ("loss.adv_std_scale=false", "loss.adv_std_scale"),
])
def test_a_mismatched_key_is_refused_by_name(tmp_path, override, key):
    write_run(tmp_path / "src")
    message = refusal(tmp_path / "src", new_cfg(override))
    assert key in message and "replay source" in message


def test_a_different_stage_size_or_too_few_stages_is_refused(tmp_path):
    write_run(tmp_path / "src")  # one stage of 4 updates x 2 prompts = 8 prompts
    assert "prompts each" in refusal(tmp_path / "src", new_cfg("schedule.prompts_per_update=4"))
    message = refusal(tmp_path / "src", new_cfg("schedule.total_updates=8", "schedule.num_stages=2"))
    assert "schedule.num_stages" in message and "stage 1 is missing" in message


def test_a_stage_with_a_missing_shard_is_not_complete(tmp_path):
    write_run(tmp_path / "src", stages=2)
    shard_path(RunDir(tmp_path / "src").stage(1), 0).unlink()
    assert replay.complete_stages(tmp_path / "src") == (0,)


def test_another_tokenizer_or_prompt_format_is_caught_by_the_stored_prompts(tmp_path):
    write_run(tmp_path / "src")
    src = replay.check_source(tmp_path / "src", new_cfg())
    other = {0: [5, 6, 99], 1: [5, 8]}  # item 0 tokenises differently here
    with pytest.raises(replay.ReplayError, match="tokenizer") as info:
        replay.copy_stage(src, 0, tmp_path / "dest", need_trainer_logprobs=False, prompt_ids_of=other.__getitem__)
    assert "group 0" in str(info.value)
    assert not (tmp_path / "dest" / SHARDS_FILE).exists()  # nothing marked complete


def test_trainer_logprobs_needed_but_not_stored(tmp_path):
    write_run(tmp_path / "src")
    src = replay.check_source(tmp_path / "src", new_cfg())
    with pytest.raises(replay.ReplayError, match="loss.behavior_logprobs=trainer"):
        replay.copy_stage(src, 0, tmp_path / "dest", need_trainer_logprobs=True)
    write_run(tmp_path / "src2", trainer=True)
    src = replay.check_source(tmp_path / "src2", new_cfg())
    assert replay.copy_stage(src, 0, tmp_path / "dest2", need_trainer_logprobs=True) == 8


@pytest.mark.parametrize("damage", ["delete", "corrupt", "marker"])
def test_a_source_file_deleted_or_damaged_mid_run_is_named(tmp_path, damage):
    write_run(tmp_path / "src", stages=2)
    src = replay.check_source(tmp_path / "src", new_cfg("schedule.total_updates=8", "schedule.num_stages=2"))
    folder = RunDir(tmp_path / "src").stage(1)
    path = folder / SHARDS_FILE if damage == "marker" else shard_path(folder, 0)
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(b"\x00garbage")
    with pytest.raises(replay.ReplayError) as info:
        replay.copy_stage(src, 1, tmp_path / "dest", need_trainer_logprobs=False)
    assert str(path) in str(info.value)


def test_the_same_model_folder_or_task_file_by_another_path_is_accepted(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "model")
    write_run(tmp_path / "src", [f"model.name={tmp_path / 'model'}"])
    replay.check_source(tmp_path / "src", new_cfg(f"model.name={tmp_path / 'link'}"))
    (tmp_path / "other").mkdir()
    assert "model.name" in refusal(tmp_path / "src", new_cfg(f"model.name={tmp_path / 'other'}"))
    (tmp_path / "rows.jsonl").write_text("")
    (tmp_path / "rows_link.jsonl").symlink_to(tmp_path / "rows.jsonl")
    write_run(tmp_path / "src2", ["task.kind=math", f"task.name={tmp_path / 'rows.jsonl'}"])
    replay.check_source(tmp_path / "src2", new_cfg("task.kind=math", f"task.name={tmp_path / 'rows_link.jsonl'}"))
