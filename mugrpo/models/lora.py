"""LoRA through peft: adapters put into the policy, merged weights out of it.

:func:`apply_lora` injects peft LoRA layers into the policy in place
(``peft.inject_adapter_in_model``), so the policy stays the plain transformers causal-LM module:
``model.base_model`` is still the decoder (the shared-prefix forward hooks it), the decoder layers
are where FSDP2 finds them, and only the targeted layers change names
(``...q_proj.weight`` becomes ``...q_proj.base_layer.weight`` beside ``...q_proj.lora_A.default.weight``
and ``...q_proj.lora_B.default.weight``). Only the adapter parameters require grad, so the
optimizer (which takes the ``requires_grad`` parameters) trains only them.

Out of the policy:

- :func:`merged_items`: the weights a plain HF model of the base architecture has, under its names,
  with W + (alpha / r) B @ A in each targeted layer. The engine sync, evaluation and the final export
  use them (through :func:`mugrpo.kit.distributed.full_state_items`); the training model is never
  mutated (no merge/unmerge round trip, so no rounding drift in the trained weights).
- :func:`save_adapter`: the adapter alone as a peft folder (``adapter_config.json`` +
  ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained(base, folder)`` loads.

Both take the (possibly FSDP2-sharded) tensors through a ``full`` function supplied by the caller,
so this module knows nothing about process groups, and nothing about the loss or engines.
Written against peft 0.21.2 (``LoraLayer.scaling``, ``base_layer``, ``fan_in_fan_out``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

from mugrpo.errors import UserError

ADAPTER = "default"
"""peft's adapter name; the only adapter mugrpo creates."""


class LoraError(UserError, ValueError):
    """LoRA settings that do not fit the model; the message says what to change."""


def apply_lora(model: torch.nn.Module, lc) -> torch.nn.Module:
    """Put LoRA adapters (config section ``lc``) into ``model`` in place and freeze everything else.

    Returns ``model`` itself. A no-op when ``lc.rank`` is 0.
    """
    if not lc.rank:
        return model
    PeftLoraConfig, inject_adapter_in_model = _import_peft()
    targets = lc.target_modules if isinstance(lc.target_modules, str) else list(lc.target_modules)
    _check_targets(model, targets)
    _warn_rank_above_width(model, targets, lc.rank)
    peft_cfg = PeftLoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=targets,
                              bias="none")
    inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
    _check_mergeable(model)
    for name, param in model.named_parameters():
        param.requires_grad_(_is_adapter_param(name))
    model._mugrpo_lora = peft_cfg  # read by save_adapter and has_lora
    return model


def _import_peft():
    """peft's (LoraConfig, inject_adapter_in_model); LoraError naming the install command when peft is
    missing (it is an optional dependency: the ``lora`` extra)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import inject_adapter_in_model
    except ModuleNotFoundError as exc:
        raise LoraError(f"lora.rank > 0 needs peft, which is not installed ({exc}). Install it with: "
                        "pip install 'mugrpo[lora]' (or pip install peft), or set lora.rank=0") from exc
    return PeftLoraConfig, inject_adapter_in_model


def _targeted_linears(model: torch.nn.Module, targets) -> list[tuple[str, torch.nn.Linear]]:
    """The linear layers ``targets`` names, by peft's matching rule (see :func:`_check_targets`)."""
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    if targets == "all-linear":
        return linear
    return [(n, m) for n, m in linear if any(n == t or n.endswith(f".{t}") for t in targets)]


def _warn_rank_above_width(model: torch.nn.Module, targets, rank: int) -> None:
    """A warning when ``rank`` exceeds a targeted layer's smaller dimension: the update B @ A of a
    d_out x d_in layer has rank at most min(d_out, d_in), so the extra rank only adds parameters."""
    narrow = [(n, min(m.in_features, m.out_features)) for n, m in _targeted_linears(model, targets)
              if rank > min(m.in_features, m.out_features)]
    if narrow:
        name, width = min(narrow, key=lambda nw: nw[1])
        warnings.warn(f"lora.rank={rank} exceeds the width of {len(narrow)} targeted layer(s) (smallest: {name}, "
                      f"min(in, out) = {width}); an adapter's update has rank at most that width, so the extra "
                      f"rank only adds parameters. Choose lora.rank <= {width}", stacklevel=3)


def _check_targets(model: torch.nn.Module, targets) -> None:
    """LoraError naming the model's linear layers when an entry of ``targets`` matches no module (a typo
    in one name is an error, though peft itself only refuses a list that matches nothing).

    Matching is peft's rule: a target matches a module whose name equals it or ends with ``.target``.
    """
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and name != "lm_head"})
    if targets == "all-linear":
        if not linear:
            raise LoraError(f"lora.target_modules='all-linear' but {type(model).__name__} has no linear layers")
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        raise LoraError(f"lora.target_modules {missing} match no module of {type(model).__name__}. Its linear "
                        f"layers are: {', '.join(linear)} (or use lora.target_modules=all-linear)")


def _check_mergeable(model: torch.nn.Module) -> None:
    """LoraError for an adapter that :func:`merged_items` could not merge into one plain weight."""
    listed = {name for name, _ in model.named_parameters()}  # a tied weight is listed once, under its first name
    for name, module in lora_layers(model).items():
        if not isinstance(module.base_layer, torch.nn.Linear) and not getattr(module, "fan_in_fan_out", False):
            raise LoraError(f"lora.target_modules matched {name!r}, a {type(module.base_layer).__name__}; mugrpo "
                            "merges LoRA only into linear layers. Name linear layers in lora.target_modules")
        if f"{name}.base_layer.weight" not in listed:
            raise LoraError(f"lora.target_modules matched {name!r}, whose weight is tied to another layer's (e.g. "
                            "the LM head to the embedding), so a merged weight would change both. Leave it out of "
                            "lora.target_modules")


def has_lora(model: torch.nn.Module) -> bool:
    return getattr(model, "_mugrpo_lora", None) is not None


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name -> peft LoRA layer, for every layer that holds an adapter."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The plain model's name of a parameter of the LoRA model (``.base_layer`` dropped)."""
    return name.replace(".base_layer.", ".")


def merged_items(model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor], keep: bool = True
                 ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(plain HF name, full tensor) for the base model's weights, LoRA merged in; adapters not listed.

    ``full(t)`` returns the whole tensor behind a parameter (a collective for a sharded one), so every
    rank must consume the whole iterator; with ``keep=False`` it yields None instead of tensors. A
    targeted layer's weight is W + scaling * B @ A, computed in float32 into a new tensor.
    """
    layers = lora_layers(model)
    for name, param in model.named_parameters():
        if _is_adapter_param(name):
            continue
        tensor = full(param.detach())
        owner, _, leaf = name.rpartition(".base_layer.")
        if leaf == "weight" and owner in layers:
            layer = layers[owner]
            a = full(layer.lora_A[ADAPTER].weight.detach())  # gathered on every rank (a collective)
            b = full(layer.lora_B[ADAPTER].weight.detach())
            tensor = _merged_weight(layer, tensor, a, b) if keep else None
        yield base_name(name), tensor if keep else None


def _merged_weight(layer, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W + scaling * B @ A for A [r, in], B [out, r], in float32, returned in W's dtype."""
    delta = (b.float() @ a.float()) * layer.scaling[ADAPTER]  # [out, in]
    if getattr(layer, "fan_in_fan_out", False):  # GPT-2 style Conv1D stores [in, out]
        delta = delta.T
    return (weight.float() + delta).to(weight.dtype)


def adapter_items(model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor], keep: bool = True
                  ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(peft checkpoint key, full tensor) for every adapter parameter; a collective per item, like
    :func:`merged_items`. Keys are what ``PeftModel.save_pretrained`` writes:
    ``base_model.model.<module>.lora_A.weight`` (adapter name dropped)."""
    for name, param in model.named_parameters():
        if _is_adapter_param(name):
            tensor = full(param.detach())
            yield f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}", tensor if keep else None


def save_adapter(model: torch.nn.Module, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Write a peft adapter folder from :func:`adapter_items` output (rank 0 only)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    peft_cfg = model._mugrpo_lora
    peft_cfg.base_model_name_or_path = getattr(model.config, "_name_or_path", None)
    peft_cfg.task_type = "CAUSAL_LM"
    peft_cfg.save_pretrained(str(folder))
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt"})


def describe(model: torch.nn.Module) -> str:
    """One line for the start-up notes: adapters, trainable parameters and their share."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in model.named_parameters() if not _is_adapter_param(n))
    cfg = model._mugrpo_lora
    return (f"LoRA r={cfg.r} alpha={cfg.lora_alpha:g} on {len(lora_layers(model))} layers: {trainable:,} trainable "
            f"parameters ({100 * trainable / max(total, 1):.2f}% of the base model's {total:,})")


def checkpoint_weights(model_path: str, lc, trained: dict[str, torch.Tensor], trust_remote_code: bool = False
                       ) -> list[tuple[str, torch.Tensor]]:
    """The plain model's weights for a checkpoint's ``model.safetensors`` (``trained``): as saved in full
    fine-tuning, merged into the base model at ``model_path`` when the run used LoRA (config ``lc``)."""
    if not lc.rank:
        return list(trained.items())
    from mugrpo.models.loading import load_policy

    model = apply_lora(load_policy(model_path, trust_remote_code), lc)
    missing, unexpected = model.load_state_dict(trained, strict=False)
    missing = [n for n in missing if _is_adapter_param(n)]
    if missing or unexpected:
        raise LoraError(f"the checkpoint's adapters do not fit lora={lc} on {model_path!r} (missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}); evaluate it with the run's own config")
    return list(merged_items(model, lambda t: t))

