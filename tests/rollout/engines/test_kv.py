"""The vLLM CPU KV cache's size under ``rollout.vllm.kv_cache_gb: auto`` (mugrpo/rollout/engines/kv.py),
with numbers worked by hand."""
import pytest

from mugrpo.rollout.engines.kv import kv_bytes_per_token, kv_cache_gb_for, kv_tokens

pytestmark = pytest.mark.unit

# SmolLM2-135M's config.json, the keys that matter: 30 layers, 9 query heads, 3 KV heads of 64.
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "hidden_size": 576, "max_position_embeddings": 8192}


def test_bytes_per_token_of_smollm2():
    # 2 (K and V) x 30 layers x 3 KV heads x 64 = 11,520 numbers: 46,080 bytes in float32, 23,040 in bf16
    assert kv_bytes_per_token(SMOLLM2, 4) == 46_080
    assert kv_bytes_per_token(SMOLLM2, 2) == 23_040


def test_head_dim_and_kv_heads_default_as_in_transformers():
    # no head_dim: 64 / 2 heads = 32; no num_key_value_heads: 2 (no GQA); 2 x 2 layers x 2 x 32 x 4 bytes = 1024
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64}, 4) == 1024
    # a multimodal config: its text part
    assert kv_bytes_per_token({"text_config": SMOLLM2, "vision_config": {}}, 4) == 46_080


def test_tokens_of_the_default_stage():
    # 256 sequences in groups of 8 -> 32 groups; a 100-token prompt holds 100 // 32 = 3 full blocks, shared
    # by its group; each sample's own blocks at the worst remainder: ceil((31 + 48) / 32) = 3.
    # (32 x 3 + 256 x 3) blocks x 32 tokens = 864 x 32 = 27,648
    assert kv_tokens(256, 8, 100, 48, block_tokens=32) == 27_648
    # blocks of 128 share nothing of a 100-token prompt: 2 groups x 0 + 16 x ceil(175 / 128) = 2 -> 32 x 128
    assert kv_tokens(16, 8, 100, 48, block_tokens=128) == 4096
    # one greedy sequence (group of 1) with a 64-token prompt: 1 x 2 shared + 1 x ceil((31 + 1) / 32) = 1, 3 blocks -> 96
    assert kv_tokens(1, 1, 64, 1, block_tokens=32) == 96


def test_gib_of_the_default_stage_in_float32_and_bf16():
    # 27,648 tokens x 46,080 bytes = 1,274,019,840 bytes = 1.18652... GiB (float32), half of it in bf16
    assert kv_cache_gb_for(SMOLLM2, 27_648, 4, min_tokens=8192) == pytest.approx(1_274_019_840 / 2**30)
    assert kv_cache_gb_for(SMOLLM2, 27_648, 2, min_tokens=8192) == pytest.approx(637_009_920 / 2**30)


def test_never_below_one_max_model_len_sequence_nor_above_the_cap():
    # 96 tokens ask for little, but vLLM needs room for one sequence of max_model_len = 8192 tokens:
    # 8192 x 46,080 = 377,487,360 bytes = 0.3515625 GiB exactly
    assert kv_cache_gb_for(SMOLLM2, 96, 4, min_tokens=8192) == 0.3515625
    # 65,536 tokens x 46,080 = 2.8125 GiB, capped at 2
    assert kv_cache_gb_for(SMOLLM2, 65_536, 4, min_tokens=8192) == 2.0
    assert kv_cache_gb_for(SMOLLM2, 65_536, 4, cap_gb=1.5) == 1.5
    # the floor wins over the cap: vLLM would not start below it
    assert kv_cache_gb_for(SMOLLM2, 96, 4, min_tokens=65_536) == 2.8125


@pytest.mark.parametrize("bad", [(0, 8, 100, 48), (256, 0, 100, 48), (256, 8, 0, 48), (256, 8, 100, 0)])
def test_a_count_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="must be >= 1"):
        kv_tokens(*bad)
