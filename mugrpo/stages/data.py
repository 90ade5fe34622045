"""The stage dataset: one stage's rollouts, persisted, and cut into update minibatches.

A stage's data is static: prompts, sampled responses, their behaviour log-probs, rewards and the
advantages computed once at generation time. Each rank writes its shard atomically to
``RUN_DIR/stages/stage_KKK/rollouts_rank{R}.safetensors`` right after scoring, so a run resumed
mid-stage never regenerates. Sequences are stored group by group: sequence s belongs to group s // G.
The stage folder's name comes from :class:`mugrpo.run_dir.RunDir`; the names of the shard
and text files in it are defined here and nowhere else (:func:`shard_path`, :func:`text_path`).

Multi-turn trajectories (:mod:`mugrpo.rollout.multiturn`) store their whole response, policy and
environment tokens, as one sequence plus an int8 ``turns`` tensor: k >= 0 for a token of policy
turn k, -1 for an environment token. Environment tokens stay in the sequence (the policy attends
to them) but leave ``MicroBatch.response_mask``, so the loss, its normaliser, KL, entropy, the veto
and every diagnostic see policy tokens only. Single-turn data has no ``turns`` (all turn 0).

Format versions (safetensors metadata ``format_version``): 1 (and files without a version) have no
``turns``; 2 may have it, and an int64 ``policy_versions`` (one per sequence; written only by stages
generated ahead, ignored by a mugrpo that predates it, read as the stage's index where absent). A
file of a later version is refused with a message.

Shapes: B sequences in a micro-batch, P padded prompt length, R padded response length.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from mugrpo.errors import UserError
from mugrpo.run_dir import SHARDS_FILE, atomic_write, atomic_write_text, shard_path, text_path  # noqa: F401

FORMAT_VERSION = 2
ENV_TURN = -1
"""The ``turns`` value of an environment token."""


class StageDataError(UserError, RuntimeError):
    """A persisted stage file that cannot be read; the message names it and says how to recover."""

    def __init__(self, path: Path, cause: BaseException):
        path, why = Path(path), " ".join(str(cause).split()) or type(cause).__name__
        self.path, self.why = path, why
        super().__init__(f"stage data file {path} cannot be read ({why}): "
                         f"damaged or incomplete. Delete the folder {path.parent} and resume (mugrpo train "
                         "--resume RUN_DIR): that stage's data is then generated again, by the resumed policy")


def shard_checksum(path: Path) -> str:
    """sha256 (hex) of a shard file's bytes, as recorded in :data:`SHARDS_FILE`."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_shard(path: Path, marker: dict, shard: int) -> None:
    """StageDataError naming ``path`` when its bytes are not the ones the stage's marker (the parsed
    :data:`SHARDS_FILE`) recorded for shard ``shard``: a damaged file, or another stage's or rank's
    shard put in its place. A marker without checksums (an older stage) checks nothing."""
    sums = marker.get("sha256")
    if sums is None:
        return
    try:
        expected, got = sums[shard], shard_checksum(path)
    except (OSError, IndexError, TypeError) as exc:
        raise StageDataError(path, exc) from exc
    if got != expected:
        why = ValueError(f"its sha256 is {got[:12]}... but {SHARDS_FILE} recorded {str(expected)[:12]}... for shard "
                         f"{shard}: the file was changed, damaged, or swapped with another shard after the stage was "
                         "written")
        raise StageDataError(path, why) from why


@dataclass(frozen=True)
class Field:
    """One field of :class:`StageData`: how it is indexed, stored and combined (:data:`SCHEMA`)."""

    name: str
    per: str
    """"group": one value per group; "group_tokens": one token list per group (the prompt);
    "sequence": one value per sequence, a tensor; "sequence_values": one value per sequence, a list;
    "tokens": one list per sequence, aligned with the sequence's response tokens (stored flat, cut by
    the responses' offsets)."""
    dtype: torch.dtype
    """The dtype on disk."""
    key: str
    """The safetensors key (the names of every earlier format, so old stages load)."""
    offsets: str | None = None
    """The key of the offsets this field defines ("group_tokens" and the responses)."""
    optional: bool = False
    """None when absent (an optional field is present in combined data when every part has it, or
    when it has a ``fill``)."""
    fill: Callable[["StageData", int], list] | None = None
    """An optional field's value for sequence s of a part that lacks it, when other parts have it."""


def _zero_turns(data: "StageData", s: int) -> list[int]:
    return [0] * len(data.responses[s])


SCHEMA: tuple[Field, ...] = (
    Field("prompts", "group_tokens", torch.int64, "prompt_ids", offsets="prompt_offsets"),
    Field("responses", "tokens", torch.int64, "response_ids", offsets="response_offsets"),
    Field("behavior_logprobs", "tokens", torch.float32, "behavior_logprobs"),
    Field("rewards", "sequence", torch.float32, "rewards"),
    Field("advantages", "sequence", torch.float32, "advantages"),
    Field("finished", "sequence", torch.uint8, "finished"),
    Field("item_indices", "group", torch.int64, "item_indices"),
    Field("trainer_logprobs", "tokens", torch.float32, "trainer_logprobs", optional=True),
    Field("turns", "tokens", torch.int8, "turns", optional=True, fill=_zero_turns),
    Field("policy_versions", "sequence_values", torch.int64, "policy_versions", optional=True),
)
"""Every field of a stage's data, in one place: :meth:`StageData.save`, :meth:`StageData.load`,
:meth:`StageData.subset` and :func:`gather_groups` (rounds, shards) read it, so adding a field is a
line here, its attribute on :class:`StageData`, and its test (tests/stages/test_data.py)."""


@dataclass
class StageData:
    prompts: list[list[int]]
    """One per group."""
    responses: list[list[int]]
    """One per sequence (num_groups x G, group-major)."""
    behavior_logprobs: list[list[float]]
    rewards: torch.Tensor
    """[num_groups * G] float32."""
    advantages: torch.Tensor
    """[num_groups * G] float32, frozen for the stage."""
    finished: torch.Tensor
    """[num_groups * G] bool: response ended on EOS (False: truncated at max_new_tokens)."""
    item_indices: list[int]
    """One per group: the task item the prompt came from."""
    group_size: int
    trainer_logprobs: list[list[float]] | None = field(default=None, kw_only=True)
    """One per sequence, only with ``loss.behavior_logprobs=trainer``: the behaviour policy's
    log-probs recomputed by the trainer at stage start (:mod:`mugrpo.stages.tis`); None otherwise."""
    turns: list[list[int]] | None = field(default=None, kw_only=True)
    """One per sequence, one entry per response token: policy turn k >= 0 or :data:`ENV_TURN`;
    None = single-turn data (every token of turn 0)."""
    policy_versions: list[int] | None = field(default=None, kw_only=True)
    """One per sequence: the policy version that generated it, i.e. the stage at whose start the
    behaviour weights were taken (set by stages generated ahead, :mod:`mugrpo.stages.ahead`).
    None (the synchronous loop, and shards written before it existed): the stage's own index, see
    :meth:`versions`."""

    def versions(self, stage: int) -> list[int]:
        """Each sequence's policy version; ``stage`` (this data's stage) where none was recorded."""
        return [stage] * len(self.responses) if self.policy_versions is None else self.policy_versions

    def turns_of(self, s: int) -> list[int]:
        """Sequence ``s``'s per-token turn index (all 0 for single-turn data)."""
        return [0] * len(self.responses[s]) if self.turns is None else self.turns[s]

    def num_policy_tokens(self, s: int) -> int:
        """Tokens of sequence ``s`` the policy sampled: what the loss normaliser counts."""
        return len(self.responses[s]) if self.turns is None else sum(1 for k in self.turns[s] if k >= 0)

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def subset(self, groups: list[int]) -> "StageData":
        """Keep only ``groups`` (e.g. dropping zero-variance groups)."""
        return gather_groups([(self, g) for g in groups], self)

    def save(self, path: Path) -> None:
        """Atomic write (temp file, fsync, rename) of every present field of :data:`SCHEMA`."""
        tensors = {}
        for f in SCHEMA:
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.per in ("group_tokens", "tokens"):
                tensors[f.key], offsets = _flat(value, f.dtype)
                if f.offsets:
                    tensors[f.offsets] = offsets
            elif f.per in ("group", "sequence_values"):
                tensors[f.key] = torch.tensor(value, dtype=f.dtype)
            else:
                tensors[f.key] = value.to(f.dtype).contiguous()
        meta = {"group_size": str(self.group_size), "format_version": str(FORMAT_VERSION)}
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    @classmethod
    def load(cls, path: Path) -> "StageData":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
            version = int(meta.get("format_version", 1))
            t = load_file(str(path))
            values = {}
            for f in SCHEMA:
                if f.optional and f.key not in t:
                    values[f.name] = None
                elif f.per in ("group_tokens", "tokens"):
                    values[f.name] = _unflat(t[f.key], t[f.offsets or "response_offsets"])
                elif f.per in ("group", "sequence_values"):
                    values[f.name] = t[f.key].tolist()
                else:
                    values[f.name] = t[f.key].bool() if f.name == "finished" else t[f.key]
            data = cls(**values, group_size=int(meta["group_size"]))
        except (SafetensorError, OSError, KeyError, TypeError, ValueError) as exc:
            raise StageDataError(path, exc) from exc
        if version > FORMAT_VERSION:
            raise StageDataError(path, ValueError(
                f"format_version {version} was written by a newer mugrpo (this one reads up to {FORMAT_VERSION})"))
        return data


def _flat(seqs, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.tensor([v for s in seqs for v in s], dtype=dtype), offsets


def _unflat(values: torch.Tensor, offsets: torch.Tensor) -> list:
    o = offsets.tolist()
    return [values[a:b].tolist() for a, b in zip(o, o[1:])]


def gather_groups(picks: Sequence[tuple[StageData, int]], template: StageData, cls=StageData, **extra
                  ) -> StageData:
    """A stage's data made of the groups ``picks`` ((part, group index) pairs, in order), every field of
    :data:`SCHEMA` carried along. An optional field is kept when every part has it, or filled for the
    parts that lack it when it has a ``fill`` and some part has it. ``template``: a part that gives the
    group size, and the fields' types when ``picks`` is empty. ``cls``/``extra``: a subclass and its own
    fields (:class:`mugrpo.stages.shards.ShardedStage`)."""
    G = template.group_size
    seqs = [(part, g * G + j) for part, g in picks for j in range(G)]
    parts = list({id(p): p for p, _ in picks}.values()) or [template]
    values = {}
    for f in SCHEMA:
        have = [getattr(p, f.name) is not None for p in parts]
        if f.optional and not (all(have) or (f.fill is not None and any(have))):
            values[f.name] = None
        elif f.per in ("group", "group_tokens"):
            values[f.name] = [getattr(part, f.name)[g] for part, g in picks]
        elif f.per in ("tokens", "sequence_values"):
            values[f.name] = [getattr(part, f.name)[s] if getattr(part, f.name) is not None else f.fill(part, s)
                              for part, s in seqs]
        else:
            values[f.name] = _rows(seqs, f.name, template)
    return cls(**values, group_size=G, **extra)


def _rows(seqs: list, name: str, template: StageData) -> torch.Tensor:
    """The per-sequence tensor ``name`` of ``seqs`` ((part, sequence) pairs), in order."""
    if not seqs:
        return getattr(template, name)[:0]
    by_part: dict[int, list] = {}
    for part, s in seqs:
        by_part.setdefault(id(part), [part, []])[1].append(s)
    if len(by_part) == 1:  # one part (a subset): index once
        part, idx = next(iter(by_part.values()))
        return getattr(part, name)[torch.tensor(idx, dtype=torch.long)]
    return torch.stack([getattr(part, name)[s] for part, s in seqs])


def write_stage_text(path: Path, data: StageData, tokenizer, items) -> None:
    """Human-readable jsonl of the stage, one trajectory a line, in reading order: its group and item,
    the prompt text (special tokens kept: they show the chat roles), its ``turns`` (``{"role":
    "policy", "turn": k, "text"}`` for what the policy sampled, ``{"role": "environment", "text"}`` for
    what an environment appended, split by the stored ``turns`` array; one policy turn for single-turn
    data), the reference answer, reward, advantage and ``end`` (``finished``: ended on EOS or the
    environment's done; ``truncated``: at the token budget or the context). Also, as before: the whole
    response as one text (``response``), ``finished``, ``num_tokens`` and, multi-turn,
    ``num_policy_tokens`` and ``num_turns``."""
    G = data.group_size
    lines = []
    for s, response in enumerate(data.responses):
        g = s // G
        lines.append(json.dumps({
            "group": g, "item": data.item_indices[g],
            "prompt": tokenizer.decode(data.prompts[g], skip_special_tokens=False),
            "turns": _turn_texts(response, data.turns_of(s), tokenizer),
            "answer": items[data.item_indices[g]].answer,
            "reward": float(data.rewards[s]), "advantage": round(float(data.advantages[s]), 6),
            "end": "finished" if bool(data.finished[s]) else "truncated",
            "response": tokenizer.decode(response, skip_special_tokens=True),
            "finished": bool(data.finished[s]), "num_tokens": len(response),
            **({} if data.turns is None else {"num_policy_tokens": data.num_policy_tokens(s),
                                              "num_turns": 1 + max(data.turns[s], default=0)}),
        }, ensure_ascii=False))
    atomic_write_text(path, "\n".join(lines) + "\n")


def _turn_texts(response: list[int], turns: list[int], tokenizer) -> list[dict]:
    """The response cut where its turn index changes: policy turns decoded without special tokens (as
    ``response`` is), environment turns with them (their chat markup is what the policy read)."""
    out, start = [], 0
    for end in range(1, len(response) + 1):
        if end < len(response) and turns[end] == turns[start]:
            continue
        k, ids = turns[start], response[start:end]
        if k == ENV_TURN:
            out.append({"role": "environment", "text": tokenizer.decode(ids, skip_special_tokens=False)})
        else:
            out.append({"role": "policy", "turn": k, "text": tokenizer.decode(ids, skip_special_tokens=True)})
        start = end
    return out
