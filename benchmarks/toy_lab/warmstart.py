"""The toy lab's starting policy: a character-level Llama built in code, warm-started by a short SFT.

A randomly initialised model never boxes an answer, so RL would have no signal. A short supervised
fine-tune on the task's own questions with a worked target (``4-7=-3 \\boxed{-3}``, see
:func:`target_text`) teaches the answer format and part of the arithmetic. It stops at the first
evaluation whose sampled pass@1 (temperature 1, the RL sampling) reaches ``target_pass1``, which
leaves a policy that is right some of the time and uncertain elsewhere: the regime RL with
verifiable rewards works in. The worked chain matters for the lab: it gives every response a
suffix after its first decisive token, the place where the veto acts (with a bare ``\\boxed{N}``
answer nothing but the closing brace follows the digits, and the veto has nothing to remove).

The result is an ordinary HF folder cached under ``benchmarks/cache/toy_lab/warm-<hash>/`` (the hash
covers every field of :class:`WarmStartSpec`), with ``warmstart.json`` recording the SFT curve.
Prompts are rendered exactly as the trainer renders them (``mugrpo.rollout.tasks.prompt_ids`` with the same
task config), so SFT and RL see the same text.

This module knows nothing about RL; :mod:`benchmarks.toy_lab.run` uses its output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

CACHE = Path(__file__).resolve().parents[1] / "cache" / "toy_lab"


@dataclass(frozen=True)
class WarmStartSpec:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    task_name: str = "basic_arithmetic"
    task_params: tuple = (("min_terms", 2), ("max_terms", 2), ("min_digits", 1), ("max_digits", 1),
                          ("operators", ("+", "-")), ("allow_negation", False), ("allow_parentheses", False))
    """reasoning-gym config fields, as a tuple of pairs so the spec stays hashable."""
    task_size: int = 5_000
    answer_format: str = "steps"
    """``steps``: ``4-7=-3 \\boxed{-3}`` (the worked chain, one step per operator, then the boxed
    answer); ``boxed``: ``\\boxed{-3}`` only."""
    sft_lr: float = 2e-3
    sft_batch: int = 64
    sft_max_steps: int = 3000
    eval_every: int = 25
    eval_prompts: int = 200
    target_pass1: float = 0.3
    """Stop at the first evaluation with sampled pass@1 >= this."""
    seed: int = 0

    def params_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.task_params}

    def key(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True, default=list)
        return hashlib.sha1(text.encode()).hexdigest()[:10]


def task_overrides(spec: WarmStartSpec) -> list[str]:
    """``key=value`` overrides that make a mugrpo Config use this task with bare prompts."""
    params = json.dumps(spec.params_dict())
    return [f"task.name={spec.task_name}", f"task.params={params}", f"task.size={spec.task_size}",
            "task.instruction=''", "task.few_shot=[]", f"task.seed={spec.seed}"]


def target_text(item, answer_format: str) -> str:
    """The SFT target for a reasoning-gym arithmetic item (``+``/``-`` only, no parentheses)."""
    if answer_format == "boxed":
        return f"\\boxed{{{item.answer}}}"
    terms = item.entry["metadata"]["expression"].split()
    value, steps = int(terms[0]), []
    for op, num in zip(terms[1::2], terms[2::2]):
        new = value + int(num) if op == "+" else value - int(num)
        steps.append(f"{value}{op}{num}={new}")
        value = new
    assert str(value) == str(item.answer), (terms, item.answer)
    return " ".join(steps) + f" \\boxed{{{item.answer}}}"


def _sft_batch(tokenizer, prompts: list[list[int]], targets: list[str]) -> tuple[torch.Tensor, ...]:
    """Right-padded prompt+target rows; labels are -100 except on the target and its EOS."""
    rows = []
    for p, a in zip(prompts, targets):
        t = tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p, t))
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    att = torch.zeros_like(ids)
    for r, (p, t) in enumerate(rows):
        ids[r, :len(p) + len(t)] = torch.tensor(p + t)
        labels[r, len(p):len(p) + len(t)] = torch.tensor(t)
        att[r, :len(p) + len(t)] = 1
    return ids, att, labels


def build(spec: WarmStartSpec, cache: Path = CACHE, log=print) -> Path:
    """Return the cached warm-started model folder for ``spec``, building it if needed."""
    target = cache / f"warm-{spec.key()}"
    if (target / "warmstart.json").is_file():
        return target
    from transformers import AutoModelForCausalLM

    from benchmarks.evaluate import sample_pass1
    from mugrpo.config import load_config
    from mugrpo.models.loading import load_tokenizer
    from mugrpo.rollout.tasks import build_task, prompt_ids
    from mugrpo.models.tiny import build_tiny_model

    tmp = cache / f".warm-{spec.key()}-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, hidden=spec.hidden, layers=spec.layers, heads=spec.heads, seed=spec.seed)
    tokenizer = load_tokenizer(str(tmp))
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = load_config("grpo", overrides=task_overrides(spec) + [f"task.eval_size={spec.eval_prompts}"])
    task = build_task(cfg.task)
    eval_prompts = [prompt_ids(tokenizer, it.question, cfg.task) for it in task.eval_items]
    # Room for the longest target plus EOS: the RL runs use it as rollout.max_new_tokens.
    max_new_tokens = max(len(target_text(it, spec.answer_format)) for it in task.items + task.eval_items) + 1
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(spec.seed)
    curve, t0 = [], time.perf_counter()
    log(f"[warmstart] {n_params / 1e6:.2f}M params; SFT until sampled pass@1 >= {spec.target_pass1}")
    for step in range(1, spec.sft_max_steps + 1):
        idx = torch.randint(len(task.items), (spec.sft_batch,), generator=gen).tolist()
        items = [task.items[i] for i in idx]
        ids, att, labels = _sft_batch(tokenizer, [prompt_ids(tokenizer, it.question, cfg.task) for it in items],
                                      [target_text(it, spec.answer_format) for it in items])
        model.train()
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0:
            log(f"[warmstart] step {step} loss {float(loss.detach()):.3f} ({time.perf_counter() - t0:.0f} s)")
        if step % spec.eval_every == 0:
            ev = sample_pass1(model, tokenizer, eval_prompts, task, task.eval_items, samples=2, seed=12345,
                              max_new_tokens=max_new_tokens)
            curve.append({"step": step, "loss": float(loss.detach()), **{k: ev[k] for k in ("pass1", "boxed_frac")},
                          "time_s": time.perf_counter() - t0})
            log(f"[warmstart] step {step} loss {float(loss.detach()):.3f} pass@1 {ev['pass1']:.3f} "
                f"boxed {ev['boxed_frac']:.2f} e.g. {ev['example']!r}")
            if ev["pass1"] >= spec.target_pass1:
                break
    model.config.use_cache = True
    model.save_pretrained(tmp)
    meta = {"spec": dataclasses.asdict(spec), "num_params": n_params, "sft_steps": step, "curve": curve,
            "max_new_tokens": max_new_tokens, "example_target": target_text(task.items[0], spec.answer_format),
            "final_pass1": curve[-1]["pass1"] if curve else None}
    (tmp / "warmstart.json").write_text(json.dumps(meta, indent=1, default=list))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target
