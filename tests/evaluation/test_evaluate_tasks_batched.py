"""mugrpo.evaluation.evaluate.generate_and_score_tasks: several single-turn
tasks are generated in ONE engine call per mode (not one small batch per task), and each task's responses
are scored by its own task. The real HF engine on the tiny model, counted by a thin wrapper."""
import pytest

from mugrpo.config import RolloutConfig, load_config
from mugrpo.evaluation.evaluate import EvalSettings, generate_and_score, generate_and_score_tasks, render_prompts
from mugrpo.models.loading import load_tokenizer
from mugrpo.rollout.engines.hf import HFEngine
from mugrpo.rollout.tasks import build_task


class Counted:
    """The engine, with the sizes of the ``generate`` calls made on it."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling, progress=None):
        self.calls.append((len(prompts), sampling.n))
        return self.engine.generate(prompts, sampling, progress=progress)


def _part(cfg, tokenizer, questions):
    task = build_task(cfg.task, [{"question": f"t{i}", "answer": "1"} for i in range(10)],
                      [{"question": q, "answer": "1"} for q in questions])
    prompts, items = render_prompts(tokenizer, task.eval_items, cfg.task)
    return task, items, prompts


def test_all_tasks_in_one_call_per_mode_each_scored_by_its_own_task(tiny_model_dir):
    cfg = load_config(overrides=["task.few_shot=[]", "task.instruction=", "task.reward_fn=toy_rewards:frac_ones"])
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = Counted(HFEngine(tiny_model_dir, tokenizer, RolloutConfig(batch_size=64, dtype="float32")))
    parts = [_part(cfg, tokenizer, ["1+1", "2+2", "3+3"]), _part(cfg, tokenizer, ["4+4", "5+5"])]
    settings = EvalSettings(greedy=True, n=2, ks=(1, 2), max_new_tokens=6, keep_text=True)
    gens = generate_and_score_tasks(engine, tokenizer, parts, settings)
    assert engine.calls == [(5, 1), (5, 2)]  # greedy: 5 prompts at once; sampled: 5 prompts x 2 at once
    assert [len(g.greedy) for g in gens] == [3, 2] and [len(g.samples) for g in gens] == [3, 2]
    assert [len(g.lengths) for g in gens] == [9, 6] and [len(g.records) for g in gens] == [9, 6]
    for gen in gens:  # each record scored as its task scores it (frac_ones of its own text)
        for r in gen.records:
            ones = sum(c == "1" for c in r["text"]) / len(r["text"]) if r["text"] else 0.0
            assert r["score"] == pytest.approx(ones)
    # greedy: the same responses as each task evaluated alone (its own, smaller batch)
    alone = [generate_and_score(engine, tokenizer, t, items, prompts, EvalSettings(max_new_tokens=6, keep_text=True))
             for t, items, prompts in parts]
    assert [[r["text"] for r in g.records if r["mode"] == "greedy"] for g in gens] == [
        [r["text"] for r in g.records] for g in alone]


def test_mugrpo_eval_of_several_tasks_writes_every_field_of_a_sample(tiny_model_dir, tmp_path, capsys):
    import json

    from mugrpo.cli import main

    files = {}
    for name, questions in (("a", ["1+1", "2+2", "3+3"]), ("b", ["4+4", "5+5"])):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps({"question": q, "answer": str(i)}) + "\n"
                                       for i, q in enumerate(questions)))
    samples = tmp_path / "samples.jsonl"
    assert main(["eval", "--model", tiny_model_dir, "--task", f"a={files['a']},b={files['b']}", "--k", "2",
                 "--max-new-tokens", "4", "--samples", str(samples), "task.few_shot=[]", "task.instruction=",
                 "train.threads=1", "task.reward_fn=toy_rewards:frac_ones"]) == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["task"], r["mode"]) for r in rows].count(("a", "sample")) == 6 and len(rows) == 15  # (3 + 2) x 3
    assert all(set(r) == {"task", "item", "mode", "text", "score", "answer"} for r in rows)
    assert {(r["task"], r["item"], r["answer"]) for r in rows} == {("a", 0, "0"), ("a", 1, "1"), ("a", 2, "2"),
                                                                    ("b", 0, "0"), ("b", 1, "1")}
    table = capsys.readouterr().out
    assert "overall (mean)" in table and "\na " in table and "\nb " in table
