"""An update's sequences laid out for the trainer: which to compute, in which rows, in which micro-batches.

Three savings. Each leaves the update equal to the plain path's up to float rounding
(``tests/kit/test_batching.py`` compares per-token log-probs and every parameter's gradient):

1. **Zero-advantage skip** (:func:`sequences_to_train`). With no KL and no entropy term, a
   sequence with A = 0 has token loss -min(rho * 0, clip(rho) * 0) = 0 whatever the policy, so
   its gradient is exactly 0. It is left out of the forward and backward; the loss normaliser
   still counts its tokens (the trainer takes them from the stored lengths).
2. **Shared prefix** (:class:`SharedBatch`). A row holds one prompt followed by the responses of
   its group. A block attention mask lets every token of response j attend to the whole prompt
   and causally to the earlier tokens of response j only; each response's position ids start
   where the prompt ends. So response j sees exactly the keys and values it would see in its own
   row ``prompt + response j``, while the prompt is encoded once instead of G times, and the
   gradients of all G responses flow into that one prompt computation, as their sum flows into
   the parameters in the unshared forward. This is Prefix Grouper's idea (arXiv 2506.05433) done
   with the model's own attention and a 4-D mask.
3. **Token-budget micro-batches** (:func:`pack_rows`). Rows are sorted by length and packed while
   rows x the longest row fits ``schedule.micro_batch_tokens``, so one long response does not pad
   many short ones. A group too long for the budget is split over several rows, each with the prompt.

The plain layout (:func:`collate`: one row per sequence, prompt left-padded,
response right-padded) is the reference, and the fallback for models the block mask cannot serve.

Shapes: B rows, L row length, S sequences in a micro-batch, R its longest response, N its
response tokens. This module builds tensors from the sequences a phase hands it (:class:`Sequences`, read
by attribute: RL's stage data, :class:`~mugrpo.stages.data.StageData`, or the warm start's examples,
:class:`~mugrpo.warmstart.phase.ExampleSet`); it knows nothing about models, stages or losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Sequences(Protocol):
    """What the layout reads of the sequences it lays out: ``group_size`` responses per prompt, sequence
    ``s`` being response ``s`` of prompt ``s // group_size``. ``turns``: each response token's turn (< 0:
    an input, not a trained token) or None (every response token is trained); ``behavior_logprobs`` and
    ``advantages`` None: zeros, for a phase whose loss reads neither (the warm start)."""

    group_size: int
    prompts: list[list[int]]
    responses: list[list[int]]
    turns: list[list[int]] | None
    behavior_logprobs: list[list[float]] | None
    trainer_logprobs: list[list[float]] | None
    advantages: torch.Tensor | None


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    position_ids: torch.Tensor  # [B, P + R]
    response_ids: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R] bool
    behavior_logprobs: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B]
    trainer_logprobs: torch.Tensor | None = field(default=None, kw_only=True)  # [B, R], with RL's stage data's
    turns: torch.Tensor | None = field(default=None, kw_only=True)  # [B, R] int8 (padding 0), with RL's stage data's

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]

    def to(self, device) -> "MicroBatch":
        return type(self)(**{f: None if getattr(self, f) is None else getattr(self, f).to(device)
                             for f in self.__dataclass_fields__})


def collate(data: Sequences, seqs: list[int], pad_id: int) -> MicroBatch:
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
        if data.behavior_logprobs is not None:
            behavior[row, :len(r)] = torch.tensor(data.behavior_logprobs[s], dtype=torch.float32)
        if trainer is not None:
            trainer[row, :len(r)] = torch.tensor(data.trainer_logprobs[s], dtype=torch.float32)
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    response_mask = attention[:, P:].bool()
    if turns is not None:
        response_mask &= turns >= 0
    return MicroBatch(input_ids, attention, position_ids, input_ids[:, P:].clone(), response_mask, behavior,
                      _advantages(data, seqs), trainer_logprobs=trainer, turns=turns)


def _advantages(data: Sequences, seqs: list[int]) -> torch.Tensor:
    """[len(seqs)] the sequences' advantages (zeros for data without any)."""
    if data.advantages is None:
        return torch.zeros(len(seqs))
    return data.advantages[torch.tensor(seqs, dtype=torch.long)]


def response_turns(data: Sequences, seqs: list[int], R: int) -> torch.Tensor | None:
    """[len(seqs), R] int8 turn index of each response token (padding 0), or None for single-turn data."""
    if data.turns is None:
        return None
    turns = torch.zeros((len(seqs), R), dtype=torch.int8)
    for row, s in enumerate(seqs):
        turns[row, :len(data.turns[s])] = torch.tensor(data.turns[s], dtype=torch.int8)
    return turns



def sequences_to_train(data: Sequences, seqs: list[int], skip_zero_advantage: bool) -> list[int]:
    """``seqs`` minus those whose advantage is exactly 0 (when skipping is on)."""
    if not skip_zero_advantage:
        return list(seqs)
    return [s for s in seqs if float(data.advantages[s]) != 0.0]


@dataclass
class SharedBatch(MicroBatch):
    """A micro-batch of shared-prefix rows: the model inputs are [B, L] rows (``attention_mask`` a
    [B, 1, L, L] block mask: bool, True = may attend, for sdpa; additive float for eager), the
    per-sequence tensors [S, R] as in :class:`MicroBatch`, plus where each response
    token sits in the rows."""

    predict_index: torch.Tensor = field(kw_only=True)  # [N] flat index into B * L of the position predicting each token
    token_seq: torch.Tensor = field(kw_only=True)  # [N] which of the S sequences the token belongs to
    token_pos: torch.Tensor = field(kw_only=True)  # [N] its position in that response


Row = tuple[int, list[int]]
"""(group, sequences of that group in this row)."""


def make_rows(data: Sequences, seqs: list[int], shared: bool, budget: int) -> list[Row]:
    """Rows of ``seqs`` (kept in their given order): one per group when ``shared`` (split where the
    group does not fit ``budget``), else one per sequence."""
    G = data.group_size
    if not shared:
        return [(s // G, [s]) for s in seqs]
    rows: list[Row] = []
    for s in seqs:
        g = s // G
        if rows and rows[-1][0] == g:
            prompt, current = len(data.prompts[g]), rows[-1][1]
            if prompt + sum(len(data.responses[t]) for t in current) + len(data.responses[s]) <= budget:
                current.append(s)
                continue
        rows.append((g, [s]))
    return rows


def pack_rows(data: Sequences, rows: list[Row], shared: bool, budget: int, max_seqs: int | None
              ) -> list[list[Row]]:
    """Rows grouped into micro-batches: longest first, each filled while its padded size fits ``budget``.

    The padded size is rows x the longest row (shared layout), or rows x (longest prompt + longest
    response) (plain layout, which left-pads prompts and right-pads responses). A row larger than
    the budget gets a micro-batch of its own. Ties keep the rows' order, so packing is deterministic.
    """
    def extent(row: Row) -> tuple[int, int]:
        g, seqs = row
        return len(data.prompts[g]), sum(len(data.responses[s]) for s in seqs)

    def width(p: int, r: int, widest: tuple[int, int]) -> tuple[int, int]:
        # shared: rows are right-padded to the longest row; plain: prompt and response padded apart
        return (0, max(sum(widest), p + r)) if shared else (max(widest[0], p), max(widest[1], r))

    order = sorted(range(len(rows)), key=lambda i: -sum(extent(rows[i])))
    batches: list[list[Row]] = []
    widest = (0, 0)
    for i in order:
        p, r = extent(rows[i])
        if batches:
            grown = width(p, r, widest)
            num_seqs = sum(len(s) for _, s in batches[-1]) + len(rows[i][1])
            if (len(batches[-1]) + 1) * sum(grown) <= budget and (max_seqs is None or num_seqs <= max_seqs):
                batches[-1].append(rows[i])
                widest = grown
                continue
        batches.append([rows[i]])
        widest = width(p, r, (0, 0))
    return batches


def micro_batches(data: Sequences, seqs: list[int], *, shared: bool, budget: int, max_seqs: int | None,
                  pad_id: int, mask_dtype: torch.dtype = torch.bool) -> list[MicroBatch | SharedBatch]:
    """``seqs`` as token-budgeted micro-batches, in the shared-prefix or the plain layout."""
    return [mb for _, mb in ordered_micro_batches(data, seqs, shared=shared, budget=budget, max_seqs=max_seqs,
                                                  pad_id=pad_id, mask_dtype=mask_dtype)]


def ordered_micro_batches(data: Sequences, seqs: list[int], *, shared: bool, budget: int, max_seqs: int | None,
                          pad_id: int, mask_dtype: torch.dtype = torch.bool
                          ) -> list[tuple[list[int], MicroBatch | SharedBatch]]:
    """:func:`micro_batches`, each with the sequence index of each of its batch rows (for results
    written back per sequence, e.g. :func:`mugrpo.stages.tis.recompute_trainer_logprobs`)."""
    out = []
    for batch in pack_rows(data, make_rows(data, seqs, shared, budget), shared, budget, max_seqs):
        order = [s for _, row_seqs in batch for s in row_seqs]
        out.append((order, collate_shared(data, batch, pad_id, mask_dtype) if shared else collate(data, order, pad_id)))
    return out


def collate_shared(data: Sequences, rows: list[Row], pad_id: int, mask_dtype: torch.dtype = torch.bool
                   ) -> SharedBatch:
    """Lay out shared-prefix rows: ``prompt, response_1, ..., response_k`` each, right-padded.

    ``mask_dtype`` bool gives a boolean mask (True = attend: sdpa); a float dtype gives the
    additive form (0 or the dtype's minimum: eager attention).
    """
    seqs = [s for _, row_seqs in rows for s in row_seqs]
    lengths = [len(data.responses[s]) for s in seqs]
    B, S, R = len(rows), len(seqs), max(max(lengths), 1)
    L = max(len(data.prompts[g]) + sum(len(data.responses[s]) for s in row_seqs) for g, row_seqs in rows)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((B, L), dtype=torch.long)
    segment = torch.full((B, L), -1, dtype=torch.long)  # 0: prompt, j >= 1: response j, -1: padding
    response_ids = torch.full((S, R), pad_id, dtype=torch.long)
    behavior = torch.zeros((S, R), dtype=torch.float32)
    trainer = None if data.trainer_logprobs is None else torch.zeros((S, R), dtype=torch.float32)
    predict, token_seq, token_pos = [], [], []
    slot = 0
    for b, (g, row_seqs) in enumerate(rows):
        prompt = data.prompts[g]
        P = len(prompt)
        input_ids[b, :P] = torch.tensor(prompt, dtype=torch.long)
        position_ids[b, :P] = torch.arange(P)
        segment[b, :P] = 0
        start = P
        for j, s in enumerate(row_seqs, start=1):
            response = data.responses[s]
            n = len(response)
            input_ids[b, start:start + n] = torch.tensor(response, dtype=torch.long)
            position_ids[b, start:start + n] = torch.arange(P, P + n)
            segment[b, start:start + n] = j
            # Token 0 is predicted by the prompt's last position, token t > 0 by the token before it.
            predict += [b * L + P - 1] + [b * L + start + t - 1 for t in range(1, n)]
            token_seq += [slot] * n
            token_pos += list(range(n))
            response_ids[slot, :n] = torch.tensor(response, dtype=torch.long)
            if data.behavior_logprobs is not None:
                behavior[slot, :n] = torch.tensor(data.behavior_logprobs[s], dtype=torch.float32)
            if trainer is not None:
                trainer[slot, :n] = torch.tensor(data.trainer_logprobs[s], dtype=torch.float32)
            slot += 1
            start += n
    response_mask = torch.arange(R)[None, :] < torch.tensor(lengths)[:, None]
    turns = response_turns(data, seqs, R)
    if turns is not None:  # multi-turn: environment tokens are inputs, not loss tokens
        response_mask &= turns >= 0
    return SharedBatch(input_ids=input_ids, attention_mask=block_mask(segment, mask_dtype), position_ids=position_ids,
                       response_ids=response_ids, response_mask=response_mask, behavior_logprobs=behavior,
                       advantages=_advantages(data, seqs), trainer_logprobs=trainer,
                       turns=turns, predict_index=torch.tensor(predict, dtype=torch.long),
                       token_seq=torch.tensor(token_seq, dtype=torch.long),
                       token_pos=torch.tensor(token_pos, dtype=torch.long))


def block_mask(segment: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """[B, 1, L, L] attention mask from segment ids [B, L] (0 prompt, j response j, -1 padding).

    Query q may attend key k when k <= q and k is in the prompt or in q's own response. A padding
    position attends to itself only, so no softmax row is empty (an all-masked row gives NaN).
    """
    L = segment.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    q_seg, k_seg = segment[:, :, None], segment[:, None, :]
    allowed = causal & (k_seg >= 0) & (q_seg >= 0) & ((k_seg == 0) | (k_seg == q_seg))
    allowed |= torch.eye(L, dtype=torch.bool)
    allowed = allowed[:, None]
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
