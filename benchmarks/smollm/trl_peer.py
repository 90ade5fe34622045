"""The peer: TRL's ``GRPOTrainer`` with settings matched to mugrpo's ``grpo`` preset (mu = 4).

Runs in its own virtual environment (``benchmarks/smollm/requirements-trl.txt``); the benchmark
driver :mod:`benchmarks.smollm.run` starts it as a subprocess with ``PYTHONPATH`` at the repository
root, because it borrows mugrpo's task code (prompt rendering and scorer) so that both frameworks
see the same prompts, in the same order, scored by the same function.

Matched: model (the same local HF folder), prompts (mugrpo's stage prompts of the grpo preset, in
order, ``shuffle_dataset=False``), group size, max new tokens, temperature 1 / top-p 1 / top-k 0, lr,
constant schedule, AdamW (torch) with the same betas/eps/weight decay, grad-norm clip 1, clip
epsilon 0.2, no KL, group-std advantages, token-level loss normalisation (TRL ``dapo``), optimizer
updates per generation (``steps_per_generation`` = 4 updates x gradient-accumulation steps),
sequences per update, micro-batch size, fp32 or bf16 as asked.
Not matched (TRL's own design): TRL generates the whole generation batch in one ``generate`` call
and recomputes the old log-probs with an extra forward pass; mugrpo generates in chunks of
``rollout.batch_size`` and stores the sampler's log-probs.

Writes one JSON: per-update wall-clock and reward, evaluation points (sampled pass@1 on mugrpo's
held-out prompts, its time taken off the clock), and the time spent generating and scoring.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="local HF model folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--updates", type=int, required=True)
    ap.add_argument("--mu", type=int, default=4)
    ap.add_argument("--prompts-per-update", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-at", type=int, nargs="*", default=[])
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--task-overrides", nargs="*", default=[], help="mugrpo key=value overrides of task.*")
    args = ap.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.evaluate import sample_pass1
    from mugrpo import seeds
    from mugrpo.config import load_config
    from mugrpo.config.plan import make_plan
    from mugrpo.rollout.tasks import build_task, prompt_ids, render_messages

    torch.set_num_threads(args.threads)
    cfg = load_config("grpo", overrides=args.task_overrides + [
        f"schedule.total_updates={args.updates}", f"schedule.prompts_per_update={args.prompts_per_update}",
        f"rollout.group_size={args.group_size}", f"schedule.micro_batch_size={args.micro_batch_size}",
        f"train.seed={args.seed}", f"task.eval_size={args.eval_prompts}"])
    plan = make_plan(cfg)
    task = build_task(cfg.task)
    # mugrpo's stage prompts (Trainer._draw draws them with this generator).
    order = []
    for stage in range(plan.num_stages):
        gen = torch.Generator().manual_seed(seeds.prompt_draw(cfg.train.seed, stage))
        order += task.sample(plan.prompts_per_stage, gen)
    dataset = Dataset.from_list([{"prompt": render_messages(task.items[i].question, cfg.task), "item_index": i}
                                 for i in order])

    def reward(completions, item_index, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards, _ = task.score_all(texts, [task.items[i] for i in item_index])
        return rewards.tolist()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    seqs = args.prompts_per_update * args.group_size
    accum = seqs // args.micro_batch_size
    out_dir = Path(args.out).with_suffix(".trl_tmp")
    targs = GRPOConfig(
        output_dir=str(out_dir), max_steps=args.updates, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, optim="adamw_torch", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0, per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=accum,
        steps_per_generation=accum * args.mu, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", shuffle_dataset=False, num_iterations=1, bf16=args.bf16,
        use_cpu=True, seed=args.seed, logging_steps=1, report_to="none", save_strategy="no",
        disable_dropout=True, log_completions=False, dataloader_num_workers=0,
        gradient_checkpointing=False,  # TRL's GRPOConfig turns it on by default; mugrpo's default is off
        model_init_kwargs={"dtype": torch.float32})

    eval_prompts = [prompt_ids(tokenizer, it.question, cfg.task) for it in task.eval_items]
    record = {"updates": [], "eval": [], "generate_s": 0.0, "eval_s": 0.0}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            record["t0"] = time.perf_counter()

        def _evaluate(self, model, update):
            t = time.perf_counter()
            ev = sample_pass1(model, tokenizer, eval_prompts, task, task.eval_items, samples=args.eval_samples,
                              max_new_tokens=args.max_new_tokens, seed=777, batch_size=64)
            record["eval_s"] += time.perf_counter() - t
            record["eval"].append({"update": update, "pass1": ev["pass1"], "boxed_frac": ev["boxed_frac"],
                                   "time_s": self.now()})

        def now(self):
            return time.perf_counter() - record["t0"] - record["eval_s"]

        def on_step_begin(self, args_, state, control, model=None, **k):
            if state.global_step == 0 and 0 in args.eval_at and not record["eval"]:
                self._evaluate(model, 0)

        def on_step_end(self, args_, state, control, model=None, **k):
            record["updates"].append({"update": state.global_step, "time_s": self.now()})
            if state.global_step in args.eval_at:
                self._evaluate(model, state.global_step)

        def on_log(self, args_, state, control, logs=None, **k):
            if logs and "reward" in logs and record["updates"]:
                record["updates"][-1]["reward"] = logs["reward"]

    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=targs, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    generate = trainer._generate_and_score_completions  # TRL internal, 1.16: generation + scoring

    def timed_generate(*a, **k):
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            record["generate_s"] += time.perf_counter() - t

    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    record["total_s"] = record["updates"][-1]["time_s"] if record["updates"] else 0.0
    record["settings"] = vars(args)
    record["trl_args"] = {k: str(v) for k, v in targs.to_dict().items()
                          if k in ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                                   "generation_batch_size", "num_generations", "loss_type", "optim", "bf16")}
    import trl
    import transformers

    record["versions"] = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
