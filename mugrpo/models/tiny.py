"""Tiny models built in code (no download): a character-level tokenizer and a small Llama.

For tests, the toy benchmark lab and quick experiments. ``build_tiny_model(folder)`` writes a
normal HF folder that every part of mugrpo (and transformers, vLLM) loads like any other model.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def build_char_tokenizer():
    """Printable ASCII, one token per character, plus <pad>/<eos>/<unk>, with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(folder: str | Path, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0,
                     max_positions: int = 1024) -> Path:
    """Write a randomly initialised Llama (about 0.1M parameters at the defaults) and its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 4,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
