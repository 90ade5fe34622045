"""Models: loading (the built-in SmolLM2 included), LoRA adapters, tiny models built in code."""
