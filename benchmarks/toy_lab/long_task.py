"""The toy lab's long-response setting: chain sums written out step by step (issue 13, item 1).

A question lists 7 to 9 one-digit terms by letter, ``a7 b3 c5 d1 ...``; the worked answer adds
them one at a time, looking each term up, copying the running total and writing the new one::

    a=7, b=3: 7+3=10, c=5: 10+5=15, d=1: 15+1=16, ... \\boxed{41}

Targets are 88-126 characters (1 token = 1 character; median 112). The decisive tokens are the
running totals, two characters in fifteen; a wrong total early or in the middle is followed by
many ordinary tokens (letters, looked-up digits, copies of the previous total, and later totals
that are right *given* the wrong prefix). That is the shape the suffix veto is about: an unlikely
early token and a long, locally normal tail behind it. The letters make looking a term up a
content match (find ``c`` in the prompt, copy the digit after it), which a 4-layer char model
learns in a few hundred SFT steps; counting positions would not be.

The items are written to a jsonl file (training rows, then the held-out rows, no question in
both) and read by mugrpo's ``math`` task source; the reward is :func:`score`, an exact match of
the last ``\\boxed{}`` with the sum, plugged in through ``task.reward_fn``. mugrpo itself is not
changed. :func:`build` is the warm start of this setting (SFT on worked answers until the sampled
pass@1 reaches ``target_pass1``), cached like :mod:`benchmarks.toy_lab.warmstart`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import string
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.toy_lab.warmstart import CACHE, _sft_batch


@dataclass(frozen=True)
class LongSpec:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    min_terms: int = 7
    max_terms: int = 9
    train_size: int = 20_000
    eval_size: int = 128
    sft_lr: float = 2e-3
    sft_batch: int = 32
    sft_max_steps: int = 4000
    eval_every: int = 50
    eval_prompts: int = 128
    answer_format: str = "compact"
    """``compact``: ``a=7, b=3: 7+3=10, ...``; ``verbose``: ``a is 7. b is 3, so 7+3=10. ...`` (more
    ordinary tokens per decisive one, so fewer terms reach the same length)."""
    sft_bf16: bool = True
    """bf16 autocast for the SFT (about 2x faster on a CPU with native bf16)."""
    target_pass1: float = 0.25
    """Stop at the first evaluation with sampled pass@1 >= this."""
    seed: int = 0

    def key(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return "long-" + hashlib.sha1(text.encode()).hexdigest()[:10]


def make_item(rng: random.Random, spec: LongSpec) -> dict:
    n = rng.randint(spec.min_terms, spec.max_terms)
    terms = [rng.randint(1, 9) for _ in range(n)]
    letters = string.ascii_lowercase[:n]
    question = " ".join(f"{c}{t}" for c, t in zip(letters, terms))
    return {"question": question, "answer": str(sum(terms)), "terms": terms}


def target_text(terms: list[int], answer_format: str = "compact") -> str:
    """The worked answer: ``a=7, b=3: 7+3=10, c=5: 10+5=15, \\boxed{15}`` (compact) or
    ``a is 7. b is 3, so 7+3=10. c is 5, so 10+5=15. \\boxed{15}`` (verbose)."""
    verbose = answer_format == "verbose"
    steps, total = [f"a is {terms[0]}. " if verbose else f"a={terms[0]}, "], terms[0]
    for c, t in zip(string.ascii_lowercase[1:], terms[1:]):
        steps.append(f"{c} is {t}, so {total}+{t}={total + t}. " if verbose else f"{c}={t}: {total}+{t}={total + t}, ")
        total += t
    return "".join(steps) + f"\\boxed{{{total}}}"


def data_file(spec: LongSpec, cache: Path = CACHE) -> Path:
    """Write (once) and return the jsonl: ``train_size`` training rows, then ``eval_size`` held-out
    rows whose questions occur nowhere in the training rows (mugrpo's math source holds out the last
    ``task.eval_size`` rows)."""
    path = cache / f"data-{spec.key()}.jsonl"
    if path.is_file():
        return path
    rng, seen, rows = random.Random(spec.seed), set(), []
    while len(rows) < spec.train_size + spec.eval_size:
        row = make_item(rng, spec)
        if row["question"] in seen:
            continue
        seen.add(row["question"])
        rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(path)
    return path


def score(text: str, answer: str, entry: dict) -> float:
    """1.0 when the last ``\\boxed{}`` holds exactly the sum, else 0.0 (``task.reward_fn``)."""
    from mugrpo.rollout.tasks import extract_boxed

    return float(extract_boxed(text) == str(answer).strip())


def task_overrides(spec: LongSpec, cache: Path = CACHE) -> list[str]:
    """``key=value`` overrides that make a mugrpo Config use this task with bare prompts."""
    return ["task.kind=math", f"task.name={data_file(spec, cache)}", f"task.eval_size={spec.eval_size}",
            f"task.reward_fn={__name__}:score", "task.instruction=''", "task.few_shot=[]",
            f"task.seed={spec.seed}"]


def build(spec: LongSpec, cache: Path = CACHE, log=print) -> Path:
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
    cfg = load_config("grpo", overrides=task_overrides(spec))
    task = build_task(cfg.task)
    eval_items = task.eval_items[:spec.eval_prompts]
    eval_prompts = [prompt_ids(tokenizer, it.question, cfg.task) for it in eval_items]
    targets = [target_text(it.entry["terms"], spec.answer_format) for it in task.items + task.eval_items]
    max_new_tokens = max(len(t) for t in targets) + 1  # room for the longest target plus EOS
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(spec.seed)
    curve, t0 = [], time.perf_counter()
    log(f"[warmstart-long] {n_params / 1e6:.2f}M params; SFT until sampled pass@1 >= {spec.target_pass1}")
    for step in range(1, spec.sft_max_steps + 1):
        idx = torch.randint(len(task.items), (spec.sft_batch,), generator=gen).tolist()
        items = [task.items[i] for i in idx]
        ids, att, labels = _sft_batch(tokenizer, [prompt_ids(tokenizer, it.question, cfg.task) for it in items],
                                      [target_text(it.entry["terms"], spec.answer_format) for it in items])
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.sft_bf16):
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % spec.eval_every == 0:
            ev = sample_pass1(model, tokenizer, eval_prompts, task, eval_items, samples=1, seed=12345,
                              max_new_tokens=max_new_tokens)
            curve.append({"step": step, "loss": float(loss.detach()), **{k: ev[k] for k in ("pass1", "boxed_frac")},
                          "time_s": time.perf_counter() - t0})
            log(f"[warmstart-long] step {step} loss {float(loss.detach()):.3f} pass@1 {ev['pass1']:.3f} "
                f"boxed {ev['boxed_frac']:.2f} ({time.perf_counter() - t0:.0f} s) e.g. {ev['example']!r}", flush=True)
            if ev["pass1"] >= spec.target_pass1:
                break
    model.config.use_cache = True
    model.save_pretrained(tmp)
    lengths = sorted(len(t) for t in targets)
    meta = {"spec": dataclasses.asdict(spec), "num_params": n_params, "sft_steps": step, "curve": curve,
            "max_new_tokens": max_new_tokens, "example_target": targets[0],
            "target_chars": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]},
            "final_pass1": curve[-1]["pass1"] if curve else None}
    (tmp / "warmstart.json").write_text(json.dumps(meta, indent=1))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    print(build(LongSpec(), log=lambda *a, **k: print(*a, file=sys.stdout, flush=True)))
