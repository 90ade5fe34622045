"""The evaluation runner with a scripted engine: scoring wiring, prompt limits, and the training cadence."""

import dataclasses

import pytest
import torch

from mugrpo.config import load_config
from mugrpo.kit.distributed import World
from mugrpo.rollout.engines import Completion
from mugrpo.training.evaluator import TrainingEvaluator
from mugrpo.stages.samplers import RolloutParts
from mugrpo.evaluation.evaluate import (EvalSettings, generate_and_score, render_prompts,
                             summarize_generations)
from mugrpo.config.plan import make_plan
from mugrpo.observability.progress import Progress
from mugrpo.rollout.tasks import Item, Task, TaskError
from mugrpo.models.tiny import build_char_tokenizer

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


class ScriptedEngine:
    """Greedy answers "11" (+EOS); sampled answers cycle through "1", "0", "10", "00000000" (truncated)."""

    SAMPLED = ("1", "0", "10", "00000000")

    def __init__(self):
        self.calls, self.loaded = [], 0

    def _completion(self, text, max_new):
        ids = TOK(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= max_new:
            return Completion(ids[:max_new], [0.0] * max_new, "length")
        return Completion(ids + [EOS], [0.0] * (len(ids) + 1), "stop")

    def generate(self, prompts, sampling, progress=None):
        self.calls.append(sampling)
        out = []
        for i, _ in enumerate(prompts):
            texts = ["11"] if sampling.temperature == 0 else [self.SAMPLED[(i + j) % 4] for j in range(sampling.n)]
            out.append([self._completion(t, sampling.max_new_tokens) for t in texts])
            if progress:
                progress(sampling.n)
        return out

    def load_weights(self, named):
        self.loaded += len(list(named))

    def wake(self):
        pass

    def sleep(self):
        pass


def _task(n_items=3):
    items = [Item(f"q{i}", "1") for i in range(n_items)]
    exact = lambda text, item: float(text == "1")  # noqa: E731 - 1 for exactly "1", else 0
    return Task("t", items, items, exact), items


def test_generate_and_score_by_hand():
    task, items = _task()
    settings = EvalSettings(greedy=True, n=2, ks=(1, 2), max_new_tokens=8)
    gen = generate_and_score(ScriptedEngine(), TOK, task, items, [[5]] * 3, dataclasses.replace(settings, keep_text=True))
    # greedy "11" != "1" -> 0 for every item
    # sampled: item 0 -> "1", "0"; item 1 -> "0", "10"; item 2 -> "10", "00000000"
    assert gen.greedy == [0.0, 0.0, 0.0]
    assert gen.samples == [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    m = summarize_generations(gen, settings)
    assert m["greedy_acc"] == 0.0
    assert m["avg_at_2"] == pytest.approx(1 / 6)       # one correct of 6 samples
    assert m["pass_at_1"] == pytest.approx(1 / 6)      # (1/2 + 0 + 0) / 3
    assert m["pass_at_2"] == pytest.approx(1 / 3)      # item 0 solved of 3
    # lengths: greedy 3 x "11"+EOS = 3 tokens; sampled 2, 2, 2, 3, 3, 8 (the last one truncated)
    assert m["response_len_mean"] == pytest.approx((3 * 3 + 2 + 2 + 2 + 3 + 3 + 8) / 9)
    assert m["truncated_frac"] == pytest.approx(1 / 9)
    assert [r["mode"] for r in gen.records] == ["greedy"] * 3 + ["sample"] * 6
    assert gen.records[3] == {"item": 0, "mode": "sample", "text": "1", "score": 1.0}


def test_prompt_limit_policies():
    cfg = load_config(overrides=["task.few_shot=[]", "task.instruction=", "task.max_prompt_tokens=12"])
    items = [Item("short", "1"), Item("a much longer question", "1")]
    with pytest.raises(TaskError, match="longer than task.max_prompt_tokens=12"):
        render_prompts(TOK, items, cfg.task)
    cfg.task.prompt_too_long = "skip"
    prompts, kept = render_prompts(TOK, items, cfg.task)
    assert kept == items[:1] and len(prompts) == 1
    cfg.task.prompt_too_long = "truncate"
    prompts, kept = render_prompts(TOK, items, cfg.task)
    assert kept == items and [len(p) for p in prompts][1] == 12


def _State(stage, update, update_in_stage):
    from mugrpo.stages.state import RLState

    return RLState(stage=stage, update=update, update_in_stage=update_in_stage)


def _simulate(overrides):
    """Drive the evaluator through the loop's call pattern; return the updates evaluated and the
    per-stage seconds it reported."""
    cfg = load_config(overrides=["task.few_shot=[]", "task.instruction=", "schedule.total_updates=12",
                                 "eval.num_items=2", *overrides])
    plan = make_plan(cfg)
    task, _ = _task()
    logged = []

    class Logger:
        def log(self, record):
            logged.append(record)

    engine = ScriptedEngine()
    ev = TrainingEvaluator(cfg, plan, World(), RolloutParts(engine, task, TOK), torch.nn.Linear(2, 2), Logger(),
                           Progress(enabled=False), clock=lambda: 0.0)
    stage_s = []
    ev.maybe_run(_State(0, 0, 0))
    update = 0
    for stage in range(plan.num_stages):
        for i in range(1, plan.updates_per_stage + 1):
            update += 1
            ev.maybe_run(_State(stage, update, i), stage_ends=i == plan.updates_per_stage)
        stage_s.append(ev.finish_stage(_State(stage, update, plan.updates_per_stage)))
    assert engine.loaded == 2 * len(logged)  # the weights (weight and bias) are pushed before each eval
    return [r["update"] for r in logged], stage_s, logged


@pytest.mark.parametrize("overrides, expected", [
    ([], [0, 3, 6, 9, 12]),                                                 # 4 stages of 3: at start + each end
    (["eval.at_start=false", "eval.every_stages=2"], [6, 12]),
    (["eval.every_stages=0", "eval.every_updates=4"], [0, 4, 8, 12]),       # 4 and 8 fall mid-stage
    (["eval.every_stages=3", "eval.every_updates=5"], [0, 5, 9, 10, 12]),   # stage 2 end (9), the last (12)
    (["schedule.num_stages=null", "schedule.updates_per_stage=4", "eval.every_updates=6"], [0, 4, 6, 8, 12]),
    (["eval.num_items=0"], []),
])
def test_training_cadence(overrides, expected):
    updates, stage_s, logged = _simulate(overrides)
    assert updates == expected
    for record in logged:
        assert record["kind"] == "eval" and record["eval/num_items"] == 2 and "eval/greedy_acc" in record
    assert sum(stage_s) == pytest.approx(sum(r["perf/eval_s"] for r in logged))
