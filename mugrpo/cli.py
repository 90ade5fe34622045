"""The ``mugrpo`` command: ``train``, ``sft`` (a warm start alone), ``plan`` and ``config`` here; ``eval``,
``report`` and ``serve`` in their own modules.

A verb's code is imported only when that verb runs (:data:`VERBS`: each verb's argument builder and
entry point by name), so ``mugrpo --help`` imports no verb and ``mugrpo train`` no report, evaluation or
serving module; ``train`` and ``sft`` install the stop handler (:mod:`mugrpo.stopping`) before the config
is even imported.

Every verb that takes a config accepts ``--preset NAME``, ``--config FILE.yaml`` and ``key=value``
overrides of any field (dotted names), anywhere on the line (:func:`parse_args`). Errors in user input
exit with status 2 and one message that names the problem and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import os
import re
import sys
from pathlib import Path

from mugrpo import stopping
from mugrpo.errors import UserError
from mugrpo.faults import maybe_die

VERBS: dict[str, tuple[str, str, str]] = {
    "train": ("mugrpo.cli:train_arguments", "mugrpo.cli:train_verb",
              "train a policy (default: mu-grpo on SmolLM2-135M, basic arithmetic)"),
    "sft": ("mugrpo.cli:sft_arguments", "mugrpo.cli:train_verb",
            "a supervised warm start alone (warmstart.data=FILE): its final_model/ can be the model.name of an RL run "
            "(docs/WARMSTART.md)"),
    "plan": ("mugrpo.cli:config_arguments", "mugrpo.cli:plan_verb",
             "print the stage plan a config implies, without training"),
    "config": ("mugrpo.cli:config_verb_arguments", "mugrpo.cli:config_verb",
               "print the resolved config (YAML) or the config reference"),
    "eval": ("mugrpo.evaluation.cli:add_arguments", "mugrpo.evaluation.cli:run",
             "evaluate a model or run: greedy accuracy, avg@n, pass@k per task"),
    "report": ("mugrpo.observability.report:add_arguments", "mugrpo.observability.report:run",
               "compare runs: PNG figures and a markdown summary from metrics.jsonl"),
    "serve": ("mugrpo.serve:add_arguments", "mugrpo.serve:run",
              "start a rollout service for rollout.engine=remote (docs/SERVING.md)"),
}
"""verb -> (its argument builder ``f(parser)``, its entry point ``f(args) -> exit status``, its help), by
``"module:function"`` name: loaded only for the verb on the command line."""

HELD_VERBS = ("train", "sft")
"""Verbs that write a run: the stop handler is held from the CLI's start to the last write."""


def _load(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def config_arguments(p: argparse.ArgumentParser) -> None:
    from mugrpo.config import PRESETS

    p.add_argument("--preset", help=f"one of: {', '.join(PRESETS)} (default mu-grpo)")
    p.add_argument("--config", help="YAML file of overrides (nested sections or dotted keys)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override any config field, e.g. loss.veto_delta=1e-3 schedule.total_updates=64")


def train_arguments(p: argparse.ArgumentParser) -> None:
    config_arguments(p)
    p.add_argument("--run-dir", help="output folder (default runs/<preset>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--replay", metavar="SOURCE_RUN_DIR",
                   help="train on the stages SOURCE_RUN_DIR saved instead of generating (docs/ALGORITHM.md 5d)")


def sft_arguments(p: argparse.ArgumentParser) -> None:
    config_arguments(p)
    p.add_argument("--run-dir", help="output folder (default runs/sft-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the warm start in RUN_DIR from its last checkpoint")


def config_verb_arguments(p: argparse.ArgumentParser) -> None:
    config_arguments(p)
    p.add_argument("--reference", action="store_true", help="print every key with its default and doc")
    p.add_argument("--markdown", action="store_true", help="with --reference: as a markdown table")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per verb, each empty until :func:`parse_args` meets its
    verb on the command line and loads its arguments (:data:`VERBS`)."""
    parser = argparse.ArgumentParser(prog="mugrpo", description="Mu-GRPO: staged stale-rollout GRPO for RLVR")
    sub = parser.add_subparsers(dest="verb", required=True)
    parser.verb_parsers = {name: sub.add_parser(name, help=helptext) for name, (_, _, helptext) in VERBS.items()}
    return parser


def _load_verb_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Add the arguments of the verb named on ``argv`` (its first word that is a verb) to its sub-parser."""
    verb = next((tok for tok in argv if tok in VERBS), None)
    if verb is None or getattr(parser.verb_parsers[verb], "loaded", False):
        return
    _load(VERBS[verb][0])(parser.verb_parsers[verb])
    parser.verb_parsers[verb].loaded = True


_OVERRIDE = re.compile(r"^[A-Za-z_][\w.\-]*=")
"""A ``key=value`` override: a dotted name, then ``=`` (the value may hold anything, ``=`` too)."""


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser``'s arguments, with ``key=value`` overrides accepted anywhere on the line (before, between
    or after flags such as ``--run-dir``), as users type them. argparse alone takes one contiguous block
    of positionals; the overrides it leaves over are appended in order. A left-over token that is neither
    a known flag nor ``key=value`` (in a verb that takes overrides: any token) is an error (exit 2).
    Only the named verb's arguments are loaded (:func:`build_parser`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    _load_verb_arguments(parser, argv)
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    takes_overrides = isinstance(getattr(args, "overrides", None), list)
    stray = [tok for tok in extra if not (takes_overrides and _OVERRIDE.match(tok))]
    if stray:
        hint = (" (a config override is key=value, e.g. loss.veto_delta=1e-3; a flag starts with --: "
                f"mugrpo {args.verb} --help lists them)") if takes_overrides else ""
        parser.error(f"unrecognized arguments: {' '.join(stray)}{hint}")
    args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    # A crash in native code (e.g. a reward function that segfaults) still prints the Python stack.
    try:
        faulthandler.enable()
    except (AttributeError, ValueError):  # a stderr without a file descriptor (e.g. captured in tests)
        pass
    argv = sys.argv[1:] if argv is None else list(argv)
    held = bool(argv) and argv[0] in HELD_VERBS
    try:
        # train or sft: the stop handler first, before any heavy import (the config's too), until the last write
        with stopping.hold() if held else contextlib.nullcontext():
            if held:
                maybe_die("start")
            args = parse_args(build_parser(), argv)
            return _load(VERBS[args.verb][1])(args) or 0
    except stopping.Interrupted as exc:
        print(f"[mugrpo] {exc}", file=sys.stderr)
        return 130
    except UserError as exc:  # every module's user-facing error derives from it (mugrpo/errors.py)
        print(f"mugrpo: error: {exc}", file=sys.stderr)
        return 2


def _resolve(args) -> "object":
    from mugrpo.config import load_config

    return load_config(args.preset, args.config, args.overrides)


def plan_verb(args) -> int:
    from mugrpo.config.plan import format_plan, make_plan

    cfg = _resolve(args)
    print(format_plan(make_plan(cfg), cfg))
    print(_environment_plan(cfg), end="")
    print(_warmstart_plan(cfg), end="")
    return 0


def _environment_plan(cfg) -> str:
    """What ``task.env`` / ``task.tools`` make, from the environments built as training builds them (so a
    path that does not import, or arguments it does not take, exit 2 here too); "" for single-turn."""
    if cfg.task.env is None and not cfg.task.tools:
        return ""
    from mugrpo.rollout.envs.build import build_env_factory, describe_env, format_rows, turn_budget_rows

    summary = build_env_factory(cfg.task, cfg.env).summary
    rows = describe_env(summary)
    try:
        from mugrpo.models.loading import load_tokenizer, resolve_model_path

        # the built-in name (smollm2-135m-instruct) resolved as training and the warm-start rows resolve it
        tokenizer = load_tokenizer(resolve_model_path(cfg.model.name, cfg.model.cache_dir), cfg.model.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - the plan still helps without the tokenizer (e.g. offline)
        rows.append(("env turn template", f"unknown: the tokenizer of {cfg.model.name} did not load "
                                                  f"({type(exc).__name__})"))
    else:
        rows += turn_budget_rows(summary, tokenizer, cfg.rollout.max_new_tokens, cfg.env)
    return format_rows(rows)


def _warmstart_plan(cfg) -> str:
    """The warm start ``warmstart.data`` asks for (its data read and checked as at start, so bad data
    exits 2 here too); "" without one."""
    from mugrpo.warmstart.source import plan_rows

    rows = plan_rows(cfg)
    if not rows:
        return ""
    width = max(len(k) for k, _ in rows)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in rows)


def config_verb(args) -> int:
    from mugrpo.config import dump_yaml, field_docs

    if args.reference:
        print(reference_markdown() if args.markdown else "\n".join(
            f"{key} = {default}\n    {doc}" if doc else f"{key} = {default}" for key, default, doc in field_docs()))
        return 0
    print(dump_yaml(_resolve(args)), end="")
    return 0


def train_verb(args) -> int:
    """``mugrpo train`` (a warm start first with ``warmstart.data``) and ``mugrpo sft`` (the warm start alone)."""
    from mugrpo.api import default_run_dir
    from mugrpo.config import ConfigError
    from mugrpo.kit.lifecycle import resume_config
    from mugrpo.pipeline import sft, train

    for flag, value in (("--run-dir", args.run_dir), ("--resume", args.resume)):
        if value and Path(value).exists() and not Path(value).is_dir():
            raise ConfigError(f"{flag} {value}: that is a file, not a run directory; "
                              + ("choose a new folder name" if flag == "--run-dir" else "give the run's folder"))
    if args.resume:
        run_dir = Path(args.resume)
        if args.run_dir and Path(args.run_dir).resolve() != run_dir.resolve():
            raise ConfigError(f"--resume {args.resume} continues the run in that directory; drop --run-dir "
                              f"{args.run_dir} (a resumed run cannot move to another directory)")
        if args.preset or args.config:
            raise ConfigError("--resume takes the run's own config.yaml; drop --preset/--config "
                              "(key=value overrides of resume-safe keys are allowed)")
        cfg = resume_config(run_dir, args.overrides)
    else:
        cfg = _resolve(args)
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg, "sft" if args.verb == "sft" else None)
    if args.verb == "sft":
        final = sft(cfg, run_dir, resume=bool(args.resume))
    else:
        final = train(cfg, run_dir, resume=bool(args.resume), replay=args.replay)
    if os.environ.get("RANK", "0") == "0":  # under torchrun: once, not once per process
        print(f"[mugrpo] done. Run directory: {run_dir}  final model: {final}")
    return 0


def reference_markdown() -> str:
    """The config reference as markdown (docs/CONFIG.md is this text; a test keeps them equal)."""
    from mugrpo.config import PRESETS, field_docs

    lines = ["# Config reference", "",
             "Generated by `mugrpo config --reference --markdown`; a test keeps this file equal to the code.",
             "Set any key with `key=value` on the command line or in a YAML file (`--config`).", "",
             "## Presets (applied before the file and the command line)", "",
             "| preset | overrides |", "|---|---|"]
    for name, values in PRESETS.items():
        lines.append(f"| `{name}` | " + ", ".join(f"`{k}={v}`" for k, v in values.items()) + " |")
    lines += ["", "## Keys", "", "| key | default | meaning |", "|---|---|---|"]
    for key, default, doc in field_docs():
        lines.append(f"| `{key}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(lines)
