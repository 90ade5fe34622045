"""The trainer's forward pass: per-token log-probs of a micro-batch's responses under a model.

Two layouts (see :mod:`mugrpo.kit.batching`): the plain one (:class:`mugrpo.stages.data.MicroBatch`, one
row per sequence, a 2-D padding mask that the model turns into a causal mask itself) and the
shared-prefix one (:class:`mugrpo.kit.batching.SharedBatch`, one row per prompt group, a 4-D block
mask). Either way the result is ``logprobs`` [S, R] aligned with the micro-batch's
``response_mask``, so the loss never knows which layout produced it.

Only the positions that predict a response token reach the LM head: the plain layout keeps the
last R + 1 positions (``logits_to_keep``); the shared layout gathers exactly the N predicting
positions from the decoder's output before the head (a forward hook on ``model.base_model``,
so the call still goes through the causal-LM module and, under FSDP2, through its root's
parameter gathering). The head's output is then [N, V] floats, not [B, L, V].

What the shared layout relies on (transformers 5.19, checked for the families in
:data:`SHARED_PREFIX_FAMILIES`): a 4-D ``attention_mask`` is passed to the attention function
as is (``masking_utils._preprocess_mask_arguments``), explicit ``position_ids`` drive the
rotary embedding, and the causal-LM module applies its head to ``base_model``'s
``last_hidden_state``. Anything else gets the plain layout (:func:`shared_prefix_support`).

Exactness: the shared layout gives the plain one's log-probs, and its gradients up to rounding.
In a float64 Llama that rounding is float32-sized (1e-7 relative), not float64-sized: transformers'
``LlamaRMSNorm`` computes in float32 whatever the model's dtype, and the shared row sums the G
responses' gradients at a prompt position before that float32 backward, the plain rows after it.
Not the attention kernel (sdpa's math backend gives the same numbers); with the norm in float64
the layouts agree to 1e-14 (docs/ALGORITHM.md section 9, ``tests/kit/test_batching.py``).
"""

from __future__ import annotations

import contextlib

import torch

from mugrpo.kit.batching import MicroBatch, SharedBatch
from mugrpo.algo.logprobs import token_entropy, token_logprobs

SHARED_PREFIX_FAMILIES = ("llama", "qwen2", "qwen3")
"""Model types whose decoder the block mask is known to serve exactly (tests compare gradients)."""


def shared_prefix_support(model: torch.nn.Module) -> tuple[bool, torch.dtype | None, str]:
    """(supported, mask dtype, reason): whether :class:`SharedBatch` rows give this model's exact forward."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SHARED_PREFIX_FAMILIES:
        return False, None, f"model type {model_type!r} is not one of {', '.join(SHARED_PREFIX_FAMILIES)}"
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        return False, None, f"attention implementation {impl!r} takes no custom 4-D mask (sdpa and eager do)"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return False, None, "sliding-window attention layers are not expressed by the block mask"
    return True, torch.bool if impl == "sdpa" else torch.float32, ""


def response_logprobs(model, mb: MicroBatch, temperature: float, autocast: bool,
                      with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the micro-batch's response tokens at ``temperature``, [S, R].

    ``mb`` is a plain :class:`~mugrpo.stages.data.MicroBatch` or its shared-prefix subclass."""
    device_type = mb.input_ids.device.type
    ctx = torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    if isinstance(mb, SharedBatch):
        with ctx, _head_sees_only(model, mb.predict_index):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                           use_cache=False).logits[0]  # [N, V]
        targets = mb.response_ids[mb.token_seq, mb.token_pos]
    else:
        with ctx:
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                           logits_to_keep=mb.response_len + 1, use_cache=False).logits[:, :-1]  # [S, R, V]
        targets = mb.response_ids
    logprobs, entropy = token_logprobs(logits, targets, temperature, with_entropy and entropy_grad)
    if with_entropy and not entropy_grad:
        with torch.no_grad():
            entropy = token_entropy(logits.detach(), temperature)
    if isinstance(mb, SharedBatch):
        logprobs = _to_sequences(logprobs, mb)
        entropy = None if entropy is None else _to_sequences(entropy, mb)
    return logprobs, entropy


def _to_sequences(values: torch.Tensor, mb: SharedBatch) -> torch.Tensor:
    """[N] per-token values -> [S, R], zero where ``response_mask`` is False (differentiable)."""
    out = values.new_zeros(mb.response_ids.shape)
    return out.index_put((mb.token_seq, mb.token_pos), values)


@contextlib.contextmanager
def _head_sees_only(model: torch.nn.Module, flat_index: torch.Tensor):
    """While active, the decoder's ``last_hidden_state`` [B, L, H] becomes [1, N, H]: the rows of
    ``flat_index`` into B * L, so the LM head runs on the N positions that predict a response token."""
    def keep(module, args, output):
        hidden = output.last_hidden_state
        output.last_hidden_state = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_index).unsqueeze(0)
        return output

    handle = model.base_model.register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()
