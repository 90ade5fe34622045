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

import torch
from safetensors.torch import load_file, save_file

from mugrpo import seeds
from mugrpo.errors import UserError
from mugrpo.run_dir import SHARDS_FILE, atomic_write, atomic_write_text, shard_path, text_path  # noqa: F401

FORMAT_VERSION = 2
ENV_TURN = -1
"""The ``turns`` value of an environment token."""


class StageDataError(UserError, RuntimeError):
    """A persisted stage file that cannot be read; the message names it and says how to recover."""

    def __init__(self, path: Path, cause: BaseException):
        path, why = Path(path), " ".join(str(cause).split()) or type(cause).__name__
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
    log-probs recomputed by the trainer at stage start (:mod:`mugrpo.training.tis`); None otherwise."""
    turns: list[list[int]] | None = field(default=None, kw_only=True)
    """One per sequence, one entry per response token: policy turn k >= 0 or :data:`ENV_TURN`;
    None = single-turn data (every token of turn 0)."""
    policy_versions: list[int] | None = field(default=None, kw_only=True)
    """One per sequence: the policy version that generated it, i.e. the stage at whose start the
    behaviour weights were taken (set by stages generated ahead, :mod:`mugrpo.training.ahead`).
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
        G = self.group_size
        seqs = [g * G + j for g in groups for j in range(G)]
        idx = torch.tensor(seqs, dtype=torch.long)
        trainer = None if self.trainer_logprobs is None else [self.trainer_logprobs[s] for s in seqs]
        turns = None if self.turns is None else [self.turns[s] for s in seqs]
        versions = None if self.policy_versions is None else [self.policy_versions[s] for s in seqs]
        return StageData([self.prompts[g] for g in groups], [self.responses[s] for s in seqs],
                         [self.behavior_logprobs[s] for s in seqs], self.rewards[idx], self.advantages[idx],
                         self.finished[idx], [self.item_indices[g] for g in groups], G, trainer_logprobs=trainer,
                         turns=turns, policy_versions=versions)

    def save(self, path: Path) -> None:
        """Atomic write (temp file, fsync, rename)."""
        def flat(seqs, dtype):
            lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            values = torch.tensor([v for s in seqs for v in s], dtype=dtype)
            return values, offsets

        prompt_ids, prompt_offsets = flat(self.prompts, torch.int64)
        response_ids, response_offsets = flat(self.responses, torch.int64)
        logprobs, _ = flat(self.behavior_logprobs, torch.float32)
        tensors = {
            "prompt_ids": prompt_ids, "prompt_offsets": prompt_offsets,
            "response_ids": response_ids, "response_offsets": response_offsets,
            "behavior_logprobs": logprobs, "rewards": self.rewards.float().contiguous(),
            "advantages": self.advantages.float().contiguous(), "finished": self.finished.to(torch.uint8),
            "item_indices": torch.tensor(self.item_indices, dtype=torch.int64),
        }
        if self.trainer_logprobs is not None:
            tensors["trainer_logprobs"] = flat(self.trainer_logprobs, torch.float32)[0]
        if self.turns is not None:
            tensors["turns"] = flat(self.turns, torch.int8)[0]
        if self.policy_versions is not None:
            tensors["policy_versions"] = torch.tensor(self.policy_versions, dtype=torch.int64)
        meta = {"group_size": str(self.group_size), "format_version": str(FORMAT_VERSION)}
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    @classmethod
    def load(cls, path: Path) -> "StageData":
        from safetensors import SafetensorError, safe_open

        def unflat(values, offsets):
            o = offsets.tolist()
            return [values[a:b].tolist() for a, b in zip(o, o[1:])]

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
            version = int(meta.get("format_version", 1))
            t = load_file(str(path))
            trainer, turns, versions = t.get("trainer_logprobs"), t.get("turns"), t.get("policy_versions")
            offsets = t["response_offsets"]
            data = cls(unflat(t["prompt_ids"], t["prompt_offsets"]), unflat(t["response_ids"], offsets),
                       unflat(t["behavior_logprobs"], offsets), t["rewards"], t["advantages"],
                       t["finished"].bool(), t["item_indices"].tolist(), int(meta["group_size"]),
                       trainer_logprobs=None if trainer is None else unflat(trainer, offsets),
                       turns=None if turns is None else unflat(turns, offsets),
                       policy_versions=None if versions is None else versions.tolist())
        except (SafetensorError, OSError, KeyError, TypeError, ValueError) as exc:
            raise StageDataError(path, exc) from exc
        if version > FORMAT_VERSION:
            raise StageDataError(path, ValueError(
                f"format_version {version} was written by a newer mugrpo (this one reads up to {FORMAT_VERSION})"))
        return data


def update_groups(num_groups: int, prompts_per_update: int, update_in_stage: int, seed: int, stage: int
                  ) -> list[int]:
    """Group indices of update ``update_in_stage``: consecutive slices of seeded reshuffles.

    Pass p over the stage data is permutation p of a generator seeded by (seed, stage), so the
    minibatch of any update is a pure function of its position: resume needs no sampler state.
    """
    start = update_in_stage * prompts_per_update
    first_pass, last_pass = start // num_groups, (start + prompts_per_update - 1) // num_groups
    gen = torch.Generator().manual_seed(seeds.minibatch_order(seed, stage))
    perms = [torch.randperm(num_groups, generator=gen) for _ in range(last_pass + 1)]
    order = torch.cat(perms[first_pass:])
    offset = start - first_pass * num_groups
    return order[offset: offset + prompts_per_update].tolist()


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    position_ids: torch.Tensor  # [B, P + R]
    response_ids: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R] bool
    behavior_logprobs: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B]
    trainer_logprobs: torch.Tensor | None = field(default=None, kw_only=True)  # [B, R], with StageData's
    turns: torch.Tensor | None = field(default=None, kw_only=True)  # [B, R] int8 (padding 0), with StageData's

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]

    def to(self, device) -> "MicroBatch":
        return type(self)(**{f: None if getattr(self, f) is None else getattr(self, f).to(device)
                             for f in self.__dataclass_fields__})


def collate(data: StageData, seqs: list[int], pad_id: int) -> MicroBatch:
    """Left-pad prompts and right-pad responses so every response starts at column P.

    Position ids count real tokens only (cumsum of the mask - 1), as ``generate`` does for a
    left-padded batch, so trainer and engine see identical positions. ``response_mask`` is the
    response's policy tokens (environment tokens of multi-turn data are in the inputs, not the mask).
    """
    G = data.group_size
    prompts = [data.prompts[s // G] for s in seqs]
    responses = [data.responses[s] for s in seqs]
    P, R = max(len(p) for p in prompts), max(max(len(r) for r in responses), 1)
    B = len(seqs)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + R), dtype=torch.long)
    behavior = torch.zeros((B, R), dtype=torch.float32)
    trainer = None if data.trainer_logprobs is None else torch.zeros((B, R), dtype=torch.float32)
    turns = response_turns(data, seqs, R)
    for row, (p, r, s) in enumerate(zip(prompts, responses, seqs)):
        input_ids[row, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        input_ids[row, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[row, P - len(p):P + len(r)] = 1
        behavior[row, :len(r)] = torch.tensor(data.behavior_logprobs[s], dtype=torch.float32)
        if trainer is not None:
            trainer[row, :len(r)] = torch.tensor(data.trainer_logprobs[s], dtype=torch.float32)
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    response_mask = attention[:, P:].bool()
    if turns is not None:
        response_mask &= turns >= 0
    return MicroBatch(input_ids, attention, position_ids, input_ids[:, P:].clone(), response_mask, behavior,
                      data.advantages[torch.tensor(seqs, dtype=torch.long)], trainer_logprobs=trainer, turns=turns)


def response_turns(data: StageData, seqs: list[int], R: int) -> torch.Tensor | None:
    """[len(seqs), R] int8 turn index of each response token (padding 0), or None for single-turn data."""
    if data.turns is None:
        return None
    turns = torch.zeros((len(seqs), R), dtype=torch.int8)
    for row, s in enumerate(seqs):
        turns[row, :len(data.turns[s])] = torch.tensor(data.turns[s], dtype=torch.int8)
    return turns


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
