"""Sampled pass@1 of a policy on a fixed held-out prompt set (shared by the toy lab and the SmolLM run).

mugrpo's trainer logs the reward of each stage's *behaviour* policy only, once per stage: for a
2-stage run that is two points. The benchmarks therefore also evaluate the *current* policy at
chosen updates on the same held-out prompts, with the training sampling (temperature 1, no
top-k/top-p) and a fixed seed, so every run and every evaluation point sees the same random
numbers (common random numbers make the curves comparable).

Sampling runs under ``torch.random.fork_rng``: evaluation never moves the trainer's RNG, so a run
with evaluation is the same run as one without. Callers time it and take it off the run's clock.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import GenerationConfig


@torch.no_grad()
def sample_pass1(model, tokenizer, prompts: list[list[int]], task, items, *, samples: int = 1,
                 max_new_tokens: int = 16, seed: int = 0, batch_size: int = 256) -> dict:
    """Mean reward of ``samples`` responses per prompt at temperature 1; also the boxed fraction."""
    from mugrpo.rollout.tasks import extract_boxed

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                               pad_token_id=pad, eos_token_id=eos, use_cache=True)
    expanded = [(p, it) for p, it in zip(prompts, items) for _ in range(samples)]
    texts, flat_items = [], []
    was_training = model.training
    model.eval()
    with torch.random.fork_rng():
        for chunk_idx, start in enumerate(range(0, len(expanded), batch_size)):
            torch.manual_seed(seed * 1_000_003 + chunk_idx)
            chunk = expanded[start:start + batch_size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            att = torch.zeros_like(ids)
            for row, (p, _) in enumerate(chunk):
                ids[row, width - len(p):] = torch.tensor(p)
                att[row, width - len(p):] = 1
            out = model.generate(input_ids=ids, attention_mask=att, generation_config=gen_cfg)
            texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            flat_items += [it for _, it in chunk]
    model.train(was_training)
    rewards, _ = task.score_all(texts, flat_items)
    boxed = sum(extract_boxed(t) is not None for t in texts) / max(len(texts), 1)
    return {"pass1": float(rewards.mean()), "boxed_frac": boxed, "num_samples": len(texts),
            "example": texts[0] if texts else ""}


class UpdateEvaluator:
    """Evaluates a mugrpo policy before update 1 (``0 in at``) and after each update count in ``at``.

    It is applied by wrapping ``mugrpo.training.trainer.Trainer.update``, which ``train`` looks up on the class
    at every update (:func:`patched_trainer`). ``points`` hold the results; ``eval_s`` the time spent,
    which callers take off the run's clock. mugrpo has no evaluation hook of its own (yet).
    """

    def __init__(self, tokenizer, task, task_cfg, at, *, samples: int, max_new_tokens: int, seed: int = 777,
                 batch_size: int = 256):
        from mugrpo.rollout.tasks import prompt_ids

        self.tokenizer, self.task, self.at = tokenizer, task, set(at)
        self.samples, self.max_new_tokens, self.seed, self.batch_size = samples, max_new_tokens, seed, batch_size
        self.prompts = [prompt_ids(tokenizer, it.question, task_cfg) for it in task.eval_items]
        self.points: list[dict] = []
        self.eval_s = 0.0

    def __call__(self, policy, update: int) -> None:
        t0 = time.perf_counter()
        ev = sample_pass1(policy, self.tokenizer, self.prompts, self.task, self.task.eval_items, samples=self.samples,
                          max_new_tokens=self.max_new_tokens, seed=self.seed, batch_size=self.batch_size)
        self.eval_s += time.perf_counter() - t0
        self.points.append({"update": update, "pass1": ev["pass1"], "boxed_frac": ev["boxed_frac"],
                            "eval_s_cum": self.eval_s, "example": ev["example"]})

    def wrap(self, original):
        def update(trainer, data):
            policy, state = trainer.policy, trainer.state
            if state.update == 0 and 0 in self.at and not self.points:
                self(policy, 0)
            out = original(trainer, data)
            if state.update + 1 in self.at:  # the trainer counts the update after this returns
                self(policy, state.update + 1)
            return out

        return update

    def clock(self, records: list[dict]) -> dict[int, float]:
        """update -> the run's ``time_s`` at that update minus the evaluation time spent up to it."""
        out = {}
        for r in records:
            if r.get("kind") == "update":
                spent = [p["eval_s_cum"] for p in self.points if p["update"] <= r["update"]]
                out[r["update"]] = r["time_s"] - (max(spent) if spent else 0.0)
        return out


@contextlib.contextmanager
def patched_trainer(evaluator: UpdateEvaluator, timers: dict | None = None):
    """Install ``evaluator`` in mugrpo's trainer; with ``timers`` also time ``checkpoint.save`` calls."""
    from mugrpo.kit import checkpoint
    from mugrpo.training import trainer

    original_update, original_save = trainer.Trainer.update, checkpoint.save
    trainer.Trainer.update = evaluator.wrap(original_update)
    if timers is not None:
        timers.setdefault("checkpoint_durations_s", [])

        def save(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original_save(*args, **kwargs)
            finally:
                timers["checkpoint_durations_s"].append(time.perf_counter() - t0)

        checkpoint.save = save
    try:
        yield
    finally:
        trainer.Trainer.update, checkpoint.save = original_update, original_save
