"""Rollout engine on Hugging Face ``transformers`` ``generate`` (works everywhere, no extra install).

Shapes: P prompts in a generate call, G = ``sampling.n`` responses per prompt, B = P * G sequences,
W the padded prompt width, T new tokens, V the vocabulary.

Behaviour log-probs: the engine builds the sampling warpers (temperature, top-k, top-p) itself
and puts them in ``generate``'s ``logits_processor`` list, followed by a recorder that keeps the
sampled token's log-prob under the warped scores, i.e. the distribution actually sampled from.
Only a [B] tensor per step is kept, never the [B, T, V] scores. (User processors run *before*
``generate``'s own warpers, so the engine gives ``generate`` neutral sampling values and leaves
it no warper of its own that would act after the recorder.)

Prefix sharing: with G > 1 each prompt is prefilled once; its KV cache is repeated G times and
``generate`` continues from it (transformers' "re-use a prompt cache" pattern). Prompts are
left-padded; position ids are cumsum(mask) - 1 clamped at 0 both in the prefill and in
``generate`` (which derives them from the attention mask), as in the trainer, so the trainer's
log-probs match the engine's to float rounding.

Stop strings (``SamplingConfig.stop``, multi-turn): a stopping criterion decodes the tail of each
row after every step and stops the row at the first token whose text completes a stop string
(the rule vLLM applies, see :mod:`mugrpo.rollout.engines.vllm`); the row is cut right after that
token, so what ``generate`` pads after it is never kept. Without stop strings nothing changes.

Stopping a call: with a ``progress`` callback, the engine calls ``progress(0)`` after every decode
step (a stopping criterion that never stops a row), so the caller can end a long call by raising
there: a SIGTERM lands within one decode step, not at the end of the batch.
Multi-turn continuation is a plain call with the trajectory so far as the prompt (n = 1): one
prefill of the active batch per turn; the KV cache is not carried between turns (the left padding
changes as trajectories grow), vLLM's prefix cache covers that for the vLLM engine.

Weights: ``load_weights`` makes the engine's parameters share storage with the incoming tensors
when dtype, device and shape agree (an fp32 engine beside an fp32 policy holds no second copy),
and copies otherwise. The shared parameters then follow the optimizer's in-place updates; that is
safe because the trainer syncs right before every ``generate`` (see ``HFEngine.load_weights``).

This module knows nothing about rewards, advantages or the loss. Written against transformers
5.19 (``DynamicCache.batch_repeat_interleave``, ``generate``'s processor ordering).
"""

from __future__ import annotations

import copy
import gc
from typing import Iterable, Optional

import torch
from transformers import (AutoModelForCausalLM, DynamicCache, GenerationConfig, LogitsProcessor,
                          LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from mugrpo.rollout.engines.base import Completion, ProgressFn, SamplingConfig, eos_ids
from mugrpo.seeds import derive

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SampledTokenLogprobs(LogitsProcessor):
    """The last logits processor: records log softmax(scores)[sampled token] at every step.

    At step t the scores are known but the token is not (``generate`` samples after the
    processors), so the step's [B, V] log-probs are held until step t + 1, whose ``input_ids``
    end with the token sampled at t. The final step's token comes from ``finish``.
    """

    def __init__(self):
        self.steps: list[torch.Tensor] = []  # [B] per step whose token is known
        self._pending: torch.Tensor | None = None  # [B, V]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:
            self.steps.append(self._pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] log-probs of ``new_tokens`` [B, T], what ``generate`` appended to the prompts."""
        num_steps = new_tokens.shape[1]
        # generate may run (and undo) one step past the last token (deferred stop checks, on MPS):
        # then every kept token is already recorded and the pending step is that discarded one.
        if len(self.steps) < num_steps:
            self.steps.append(self._pending.gather(-1, new_tokens[:, -1:]).squeeze(-1))
        self._pending = None
        return torch.stack(self.steps[:num_steps], dim=1)


class Heartbeat(StoppingCriteria):
    """Calls ``progress(0)`` after every decode step and never stops a row: the caller's chance to end
    a long ``generate`` call by raising (a requested stop, :mod:`mugrpo.stages.generation`)."""

    def __init__(self, progress: ProgressFn):
        self.progress = progress

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.progress(0)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class StopStrings(StoppingCriteria):
    """Stops a row at the first new token whose decoded text completes one of ``stop``.

    Only a tail of ``window`` tokens is decoded each step: a stop string of c characters completed
    by the last token lies within its last c + (text of the last token) characters, and every
    non-special token decodes to at least one character. ``ends[row]`` is the number of new tokens
    to keep (the completing token included), or None while the row runs on.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], width: int, batch: int):
        self.tokenizer, self.stop, self.width = tokenizer, stop, width
        self.window = max(len(s) for s in stop) + 4
        self.ends: list[int | None] = [None] * batch

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        num_new = input_ids.shape[1] - self.width
        for row, end in enumerate(self.ends):
            if end is None:
                tail = input_ids[row, max(self.width, input_ids.shape[1] - self.window):].tolist()
                text = self.tokenizer.decode(tail, skip_special_tokens=True)  # vLLM's detokenizer default
                if any(s in text for s in self.stop):
                    self.ends[row] = num_new
        return torch.tensor([end is not None for end in self.ends], device=input_ids.device)


class RowLimits(StoppingCriteria):
    """Marks a row finished once it has ``limits[row]`` new tokens, so that rows with a lower cap
    than the call's largest (a multi-turn call's per-trajectory room) do not keep ``generate``
    running after every row is done. Finishing a row changes no other row's tokens: the sampler
    draws for the whole batch either way, a finished row just gets padding."""

    def __init__(self, limits: list[int], width: int):
        self.limits, self.width = torch.tensor(limits), width

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return (self.limits <= input_ids.shape[1] - self.width).to(input_ids.device)


def sampling_warpers(sampling: SamplingConfig) -> list[LogitsProcessor]:
    """The active warpers, in ``generate``'s own order (temperature, top-k, top-p); none for greedy."""
    if sampling.temperature == 0:
        return []
    warpers: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, [P, W], each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention[row, width - len(p):] = 1
    return input_ids, attention


class HFEngine:
    """Sampling with ``model.generate`` on the engine's own model (weights shared with the policy when possible)."""

    def __init__(self, model_path: str, tokenizer, rollout_cfg, seed: int = 0, device: str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = tokenizer
        self.batch_size = rollout_cfg.batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[rollout_cfg.dtype])
        self.model.to(self.device).eval()
        self.eos = eos_ids(tokenizer, self.model.config, self.model.generation_config)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos[0]
        # Sampling is fully specified by SamplingConfig: a checkpoint's generation_config.json
        # (temperature, top_p, repetition_penalty, min_p, ...) must not leak into generate, and a
        # warper generate added from it would run after the recorder, falsifying the log-probs.
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.model.generation_config.bos_token_id, eos_token_id=self.eos, pad_token_id=self.pad_id)
        self.seed = seed
        self._params = dict(self.model.named_parameters())
        self._buffer_names = {name for name, _ in self.model.named_buffers()}
        self._params.update(dict(self.model.named_buffers()))
        self._shared: set[str] = set()  # parameters whose storage is currently the caller's

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Share the incoming tensor's storage when it matches the parameter exactly, else copy.

        Sharing is safe because the engine never writes its weights, and the trainer calls
        ``load_weights`` right before every ``generate``: the optimizer updates the shared storage
        in place, but between an optimizer step and the next sync the engine does not generate.
        Tied weights (``lm_head.weight`` is ``embed_tokens.weight``) are one Parameter, listed
        once, so they stay tied. Buffers (e.g. rotary frequencies) are always copied: they are
        small, and the caller's may not be meant to outlive the call.
        """
        for name, tensor in named_tensors:
            target = self._params.get(name)
            if target is None:
                raise KeyError(f"HF engine: the policy has parameter {name!r} that the engine model lacks")
            if (name not in self._buffer_names and tensor.dtype == target.dtype
                    and tensor.device == target.device and tensor.shape == target.shape):
                target.data = tensor.detach()
                self._shared.add(name)
                continue
            if name in self._shared:
                # Still the caller's storage from an earlier sync: copying into it would overwrite
                # the caller's tensor, so give the parameter its own storage first.
                target.data = torch.empty_like(target)
                self._shared.discard(name)
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 progress: Optional[ProgressFn] = None,
                 max_new_tokens: Optional[list[int]] = None, first_chunk: int = 0) -> list[list[Completion]]:
        """``first_chunk`` (not in the engine interface): the index of this call's first chunk of
        ``rollout.batch_size`` sequences in a larger call split at chunk boundaries (a rollout service's
        part of a remote call, :mod:`mugrpo.rollout.engines.remote`): each chunk's seed follows its index
        in the whole call, so the parts sample what one call would."""
        greedy = sampling.temperature == 0
        # Neutral sampling values: generate then adds no warper of its own (ours run in
        # logits_processor, before the recorder). None for greedy, where generate warps nothing.
        gen_cfg = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else 1.0, top_k=None if greedy else 0,
            top_p=None if greedy else 1.0, max_new_tokens=sampling.max_new_tokens, pad_token_id=self.pad_id,
            eos_token_id=self.eos,
        )
        # rollout.batch_size counts sequences per generate call; whole groups go into one call so
        # each prompt is prefilled once.
        prompts_per_call = max(1, self.batch_size // sampling.n)
        out: list[list[Completion]] = []
        # fork_rng: sampling must not move the trainer's global RNG (reproducible resume).
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for chunk_idx, start in enumerate(range(0, len(prompts), prompts_per_call)):
                torch.manual_seed(derive(sampling.seed, "hf-generate-call", first_chunk + chunk_idx))
                chunk = prompts[start:start + prompts_per_call]
                limits = None if max_new_tokens is None else max_new_tokens[start:start + prompts_per_call]
                out.extend(self._generate_chunk(chunk, sampling, gen_cfg, limits, progress))
                if progress is not None:
                    progress(len(chunk) * sampling.n)
        return out

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingConfig, gen_cfg: GenerationConfig,
                        limits: Optional[list[int]] = None,
                        progress: Optional[ProgressFn] = None) -> list[list[Completion]]:
        """``sampling.n`` completions for each of ``prompts``, in one generate call.

        ``limits`` (per prompt): the call runs to the largest and each row is cut at its own; the
        kept tokens are exactly the sampled ones (a cut only drops the continuation). ``progress``
        is called with 0 after every decode step (:class:`Heartbeat`)."""
        n = sampling.n
        input_ids, attention = left_pad(prompts, self.pad_id)
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        width = input_ids.shape[1]
        extra = {}
        if n > 1 and width > 1:  # with one prompt token there is nothing to prefill
            extra["past_key_values"] = self._shared_prompt_cache(input_ids, attention, n)
        input_ids, attention = input_ids.repeat_interleave(n, 0), attention.repeat_interleave(n, 0)  # [B, W]
        recorder = SampledTokenLogprobs()
        processors = LogitsProcessorList([*sampling_warpers(sampling), recorder])
        if limits is not None:
            gen_cfg = copy.deepcopy(gen_cfg)
            gen_cfg.max_new_tokens = max(limits)
            limits = [limit for limit in limits for _ in range(n)]
        stops = StopStrings(self.tokenizer, sampling.stop, width, input_ids.shape[0]) if sampling.stop else None
        # none changes what is sampled: a row cap ends a row where its own cap would; a heartbeat never stops one
        criteria = [c for c in (stops, progress and Heartbeat(progress)) if c is not None]
        if limits is not None and min(limits) < max(limits):
            criteria.append(RowLimits(limits, width))
        if criteria:
            extra["stopping_criteria"] = StoppingCriteriaList(criteria)
        sequences = self.model.generate(input_ids=input_ids, attention_mask=attention, generation_config=gen_cfg,
                                        logits_processor=processors, **extra)
        new_tokens = sequences[:, width:]
        completions = self._completions(new_tokens.cpu(), recorder.finish(new_tokens).cpu(),
                                        None if stops is None else stops.ends, limits)
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _shared_prompt_cache(self, input_ids: torch.Tensor, attention: torch.Tensor, n: int) -> DynamicCache:
        """KV cache of every prompt but its last token, computed once and repeated n times, [P * n, ...].

        generate sees a cache one token shorter than the prompt and runs only that last token,
        whose logits give the first response token's distribution.
        """
        positions = (attention.cumsum(1) - 1).clamp(min=0)  # generate's (and the trainer's) convention
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=input_ids[:, :-1], attention_mask=attention[:, :-1], position_ids=positions[:, :-1],
                   past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(n)
        return cache

    def _completions(self, new_tokens: torch.Tensor, logprobs: torch.Tensor, stop_ends: list | None = None,
                     limits: list[int] | None = None) -> list[Completion]:
        """Cut each row [T] at its first EOS or stop string (the token kept), else at its limit
        (all of it by default: it hit max_new_tokens)."""
        eos = torch.tensor(self.eos)
        completions = []
        for row, (tokens, row_logprobs) in enumerate(zip(new_tokens, logprobs)):
            is_eos = torch.isin(tokens, eos)
            ends = [int(is_eos.nonzero()[0, 0]) + 1] if is_eos.any() else []
            if stop_ends is not None and stop_ends[row] is not None:
                ends.append(stop_ends[row])
            limit = tokens.numel() if limits is None else min(limits[row], tokens.numel())
            end, reason = (min(ends), "stop") if ends and min(ends) <= limit else (limit, "length")
            completions.append(Completion(tokens[:end].tolist(), row_logprobs[:end].tolist(), reason))
        return completions

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        gc.collect()

    def wake(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)

    def close(self) -> None:
        del self.model
        self._params = {}
        gc.collect()
