"""Rollout engine on Hugging Face ``transformers`` ``generate`` (works everywhere, no extra install).

Behaviour log-probs are taken from ``generate``'s processed scores (``output_scores=True``): the
logits after temperature / top-k / top-p warping, i.e. the distribution actually sampled from.
Prompts are left-padded inside a batch; ``generate`` derives position ids from the attention
mask, and the trainer does the same, so the two agree to float rounding.

This module knows nothing about rewards, advantages or the loss.
"""

from __future__ import annotations

import gc
from typing import Iterable, Optional

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from mugrpo.engines.base import Completion, ProgressFn, SamplingConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def eos_ids(tokenizer, model_config=None, generation_config=None) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS plus the model's generation EOS."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    if not ids:
        raise ValueError("the tokenizer has no eos_token; set tokenizer.eos_token so responses can end")
    return sorted(ids)


class HFEngine:
    """Sampling with ``model.generate`` on a private copy of the policy weights."""

    def __init__(self, model_path: str, tokenizer, rollout_cfg, seed: int = 0, device: str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = tokenizer
        self.batch_size = rollout_cfg.batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[rollout_cfg.dtype])
        self.model.to(self.device).eval()
        self.eos = eos_ids(tokenizer, self.model.config, self.model.generation_config)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos[0]
        self.seed = seed
        self._params = dict(self.model.named_parameters())
        self._params.update(dict(self.model.named_buffers()))

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            target = self._params.get(name)
            if target is None:
                raise KeyError(f"HF engine: the policy has parameter {name!r} that the engine model lacks")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 progress: Optional[ProgressFn] = None) -> list[list[Completion]]:
        expanded = [(i, p) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        out: list[list[Completion]] = [[] for _ in prompts]
        greedy = sampling.temperature == 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else sampling.temperature,
            # Explicit "off" values: None would let generate fall back to its defaults (top_k=50).
            top_p=None if greedy else sampling.top_p, top_k=None if greedy else sampling.top_k,
            max_new_tokens=sampling.max_new_tokens, pad_token_id=self.pad_id, eos_token_id=self.eos,
            output_scores=True, return_dict_in_generate=True,
        )
        # fork_rng: sampling must not move the trainer's global RNG (reproducible resume).
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for chunk_idx, start in enumerate(range(0, len(expanded), self.batch_size)):
                torch.manual_seed(sampling.seed * 1_000_003 + chunk_idx)
                chunk = expanded[start:start + self.batch_size]
                for (i, _), completion in zip(chunk, self._generate_batch([p for _, p in chunk], gen_cfg)):
                    out[i].append(completion)
                if progress is not None:
                    progress(len(chunk))
        return out

    def _generate_batch(self, prompts: list[list[int]], gen_cfg: GenerationConfig) -> list[Completion]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding
            input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[row, width - len(p):] = 1
        result = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                     generation_config=gen_cfg)
        new_tokens = result.sequences[:, width:].cpu()
        scores = torch.stack(result.scores, dim=1).float()  # [B, T_new, V] processed logits
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.to(scores.device).unsqueeze(-1))
        logprobs = logprobs.squeeze(-1).cpu()
        eos = torch.tensor(self.eos)
        completions = []
        for row in range(len(prompts)):
            tokens = new_tokens[row]
            is_eos = torch.isin(tokens, eos)
            if is_eos.any():
                end = int(is_eos.nonzero()[0, 0]) + 1
                reason = "stop"
            else:
                end = tokens.numel()
                reason = "length"
            completions.append(Completion(tokens[:end].tolist(), logprobs[row, :end].tolist(), reason))
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
