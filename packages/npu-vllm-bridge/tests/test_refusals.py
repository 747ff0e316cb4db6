"""Models, layers and options the bridge cannot run are refused with a message naming them."""

from __future__ import annotations

import pytest
import torch
from tiny_configs import write_config
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.attention.selector import AttentionSelectorConfig

from npu_vllm_bridge.attention.impl import BridgeAttentionImpl
from npu_vllm_bridge.attention.selector import backend_for_selector
from npu_vllm_bridge.platforms import checks
from npu_vllm_bridge.settings import BridgeSettings


def _selector(**overrides) -> AttentionSelectorConfig:
    base = dict(head_size=64, dtype=torch.float16, kv_cache_dtype="auto", block_size=128)
    return AttentionSelectorConfig(**{**base, **overrides})


def test_selector_serves_mla_layers_with_the_bridge_mla_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    path = backend_for_selector(_selector(use_mla=True, head_size=96, block_size=16))
    assert path == "npu_vllm_bridge.attention.backend.NPUBridgeMLABackend"
    assert AttentionBackendEnum.CUSTOM.get_path() == path


def test_selector_accepts_a_supported_layer_and_registers_custom():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    path = backend_for_selector(_selector())
    assert path == "npu_vllm_bridge.attention.backend.NPUBridgeAttentionBackend"
    assert AttentionBackendEnum.CUSTOM.get_path() == path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_mla": True, "use_sparse": True}, "does not support sparse MLA"),
        (
            {"use_mla": True, "kv_cache_dtype": "int8_per_token_head"},
            "MLA cannot serve.*kv_cache_dtype",
        ),
        ({"use_sparse": True}, "sparse attention"),
        (
            {"head_size": 48},
            r"head_size=48.*head_size not supported by the 'reference' attention provider "
            r"\(its head sizes: \[32, 64, 80, 96, 112, 128, 160, 192, 224, 256\]\)",
        ),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype=fp8_e5m2.*kv_cache_dtype not supported"),
        ({"has_sink": True}, "attention sinks not supported"),
        ({"attn_type": "encoder_only"}, "attention type encoder_only not supported"),
        ({"block_size": 8}, "block_size=8.*block_size not supported"),
        ({"dtype": torch.int8}, "dtype not supported"),
    ],
)
def test_selector_refuses_unsupported_layers(overrides, message):
    with pytest.raises(ValueError, match=message):
        backend_for_selector(_selector(**overrides))


IMPL_ARGS = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"alibi_slopes": [0.5] * 4}, "ALiBi"),
        (
            {"kv_cache_dtype": "fp8_e5m2"},
            r"does not support kv_cache_dtype='fp8_e5m2' for attention layers with the "
            r"'reference' attention provider; it takes kv_cache_dtype in \['auto', 'fp8', "
            r"'fp8_e4m3', 'int8_per_token_head', 'fp8_per_token_head'\]",
        ),
        ({"attn_type": "encoder_only"}, "decoder self-attention only.*encoder_only"),
        ({"sinks": torch.zeros(4)}, "attention sinks"),
        ({"use_alibi_sqrt": True}, r"attention options \['use_alibi_sqrt'\]"),
    ],
)
def test_impl_refuses_unsupported_options(overrides, message):
    with pytest.raises(ValueError, match=message):
        BridgeAttentionImpl(**{**IMPL_ARGS, **overrides})


def _vllm_config(model: str, **cache) -> VllmConfig:
    """The config of ``model``; the checks under test run on their own, not inside the
    host platform's (which is vLLM's CPU platform on an empty vLLM build)."""
    checks_of_the_platform = checks.check_model_and_options
    checks.check_model_and_options = lambda vllm_config: None
    try:
        return VllmConfig(
            model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32"),
            cache_config=CacheConfig(**cache),
        )
    finally:
        checks.check_model_and_options = checks_of_the_platform


def test_supported_llama_passes_the_checks(tmp_path):
    checks.check_model_and_options(_vllm_config(write_config(tmp_path, head_dim=64)))


def test_unsupported_head_size_is_named(tmp_path):
    config = _vllm_config(write_config(tmp_path, head_dim=48))
    message = (
        r"head size 48 \(model .*\) with the 'reference' attention provider; supported "
        r"head sizes: \[32, 64, 80, 96, 112, 128, 160, 192, 224, 256\]"
    )
    with pytest.raises(ValueError, match=message):
        checks.check_model_and_options(config)


@pytest.mark.parametrize("head_dim", [32, 112])
def test_head_sizes_of_vllm_cpu_attention_pass_the_checks(tmp_path, head_dim):
    checks.check_model_and_options(_vllm_config(write_config(tmp_path, head_dim=head_dim)))


def test_head_sizes_come_from_the_platforms_provider(tmp_path, monkeypatch):
    from vllm.platforms import current_platform

    from npu_attention.providers.ascend import AscendProvider
    from npu_vllm_bridge.attention.backend import NPUBridgeAttentionBackend

    monkeypatch.setattr(
        type(current_platform), "bridge_settings", BridgeSettings("ascend"), raising=False
    )
    monkeypatch.setattr(AscendProvider, "head_sizes", (128,))
    assert NPUBridgeAttentionBackend.get_supported_head_sizes() == [128]
    config = _vllm_config(write_config(tmp_path, head_dim=64))
    with pytest.raises(
        ValueError, match=r"'ascend' attention provider; supported head sizes: \[128\]"
    ):
        checks.check_model_and_options(config)


@pytest.mark.parametrize("kind", ["fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head"])
def test_8bit_kv_caches_pass_the_checks(tmp_path, kind):
    checks.check_model_and_options(
        _vllm_config(write_config(tmp_path, head_dim=64), cache_dtype=kind)
    )


def test_kv_cache_kind_the_provider_lacks_is_refused_naming_what_it_takes(tmp_path, monkeypatch):
    config = _vllm_config(write_config(tmp_path, head_dim=64), cache_dtype="fp8_e5m2")
    with pytest.raises(
        ValueError,
        match=r"kv_cache_dtype='fp8_e5m2' for attention layers with the 'reference' attention "
        r"provider; it takes kv_cache_dtype in \['auto', 'fp8', 'fp8_e4m3', "
        r"'int8_per_token_head', 'fp8_per_token_head'\]",
    ):
        checks.check_model_and_options(config)
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform), "bridge_settings", BridgeSettings("ascend"), raising=False
    )
    config = _vllm_config(write_config(tmp_path, head_dim=128), cache_dtype="fp8")
    with pytest.raises(
        ValueError,
        match=r"'ascend' attention provider; it takes kv_cache_dtype in "
        r"\['auto', 'int8_per_token_head'\]",
    ):
        checks.check_model_and_options(config)


MLA_FIELDS = dict(
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    kv_lora_rank=64,
    q_lora_rank=None,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    first_k_dense_replace=2,
)


def test_mla_model_is_accepted(tmp_path):
    config = _vllm_config(write_config(tmp_path, **MLA_FIELDS))
    assert config.model_config.use_mla
    checks.check_model_and_options(config)


def test_sparse_mla_model_is_refused(tmp_path):
    config = _vllm_config(write_config(tmp_path, **MLA_FIELDS))
    config.model_config.hf_text_config.index_topk = 2048
    with pytest.raises(ValueError, match=r"does not support sparse MLA \(index_topk=2048"):
        checks.check_model_and_options(config)


def test_mla_widths_the_provider_cannot_take_are_refused(tmp_path):
    config = _vllm_config(write_config(tmp_path, **{**MLA_FIELDS, "kv_lora_rank": 2048}))
    with pytest.raises(
        ValueError,
        match=r"MLA layers of .* with the 'reference' MLA provider \(num_heads=4, "
        r"kv_lora_rank=2048, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, "
        r"block_size=16, dtype=torch.float32\): kv_lora_rank must be",
    ):
        checks.check_model_and_options(config)


def test_mla_refusals_name_the_platforms_provider(tmp_path, monkeypatch):
    """The ascend MLA provider takes only DeepSeek's widths (512 / 64 / 128 / 128)."""
    from vllm.platforms import current_platform

    from npu_attention.providers.ascend_mla import AscendMLAProvider

    monkeypatch.setattr(
        type(current_platform), "bridge_settings", BridgeSettings("ascend"), raising=False
    )
    monkeypatch.setattr(AscendMLAProvider, "is_available", classmethod(lambda cls: True))
    config = _vllm_config(write_config(tmp_path, **MLA_FIELDS))
    with pytest.raises(ValueError, match=r"'ascend' MLA provider.*kv_lora_rank=64.*needs"):
        checks.check_model_and_options(config)


def test_block_size_not_a_multiple_of_16_is_refused(tmp_path):
    config = _vllm_config(write_config(tmp_path, head_dim=64))
    config.cache_config.block_size = 24
    config.cache_config.user_specified_block_size = True
    with pytest.raises(ValueError, match="multiple of 16, got block_size=24"):
        checks.check_model_and_options(config)


def test_host_mode_refuses_expert_parallelism():
    from types import SimpleNamespace

    from npu_vllm_bridge.host.platform import refuse_expert_parallel

    refuse_expert_parallel(SimpleNamespace(enable_expert_parallel=False))
    with pytest.raises(ValueError, match=r"expert parallelism \(enable_expert_parallel=True\)"):
        refuse_expert_parallel(SimpleNamespace(enable_expert_parallel=True))
