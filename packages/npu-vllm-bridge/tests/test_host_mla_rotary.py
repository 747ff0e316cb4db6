"""Host mode rotates MLA queries with vLLM's PyTorch rotary embedding: vLLM's CPU kernel
rotates MLA's 3-D queries wrongly, differently for each batch size (checked here, so that
the work-around can go once vLLM's kernel is fixed)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from tiny_configs import TINY_LLAMA
from vllm.config import CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config

from npu_vllm_bridge.host.platform import mla_rotary_in_pytorch

MLA = {
    **TINY_LLAMA,
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "kv_lora_rank": 64,
    "q_lora_rank": None,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 2,
}


def _config(tmp_path, fields: dict, custom_ops: list[str]) -> VllmConfig:
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32"),
        compilation_config=CompilationConfig(custom_ops=list(custom_ops)),
    )


@pytest.mark.skipif(
    importlib.util.find_spec("vllm._C") is None, reason="vLLM's CPU rotary kernel is a vllm._C op"
)
def test_vllm_cpu_rotary_kernel_rotates_a_3d_query_wrongly():
    from vllm.model_executor.layers.rotary_embedding import get_rope

    tokens, heads, nope, rope_dim = 6, 4, 32, 32
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            rope_dim,
            max_position=512,
            is_neox_style=False,  # DeepSeek's
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            dtype=torch.float32,
        )
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, nope + rope_dim, generator=generator)
    k_pe = torch.randn(tokens, 1, rope_dim, generator=generator)
    positions = torch.arange(tokens) + 3

    def kernel(n: int) -> torch.Tensor:  # q_pe as vLLM's MLA layer passes it: a 3-D view
        return rope.forward_cpu(positions[:n], q[:n].clone()[..., nope:], k_pe[:n].clone())[0]

    expected = rope.forward_native(positions, q[..., nope:].clone(), k_pe.clone())[0]
    flat = q[..., nope:].reshape(tokens, heads * rope_dim)  # how GQA layers pass a query
    torch.testing.assert_close(
        rope.forward_cpu(positions, flat.clone(), k_pe.clone())[0].view_as(expected), expected
    )
    assert (kernel(tokens) - expected).abs().max() > 0.1
    assert (kernel(1)[0] - kernel(tokens)[0]).abs().max() > 0.1  # token 0 moves with the batch


def test_host_mode_rotates_mla_models_in_pytorch(tmp_path):
    mla = _config(tmp_path, MLA, ["all"])
    assert mla.model_config.use_mla
    mla_rotary_in_pytorch(mla)
    assert mla.compilation_config.custom_ops == ["all", "-rotary_embedding"]
    mla_rotary_in_pytorch(mla)  # once
    assert mla.compilation_config.custom_ops == ["all", "-rotary_embedding"]


@pytest.mark.parametrize(
    ("fields", "custom_ops"), [(TINY_LLAMA, ["all"]), (MLA, ["all", "+rotary_embedding"])]
)
def test_host_mode_keeps_the_rotary_kernel_of_gqa_models_and_an_explicit_choice(
    tmp_path, fields, custom_ops
):
    config = _config(tmp_path, fields, custom_ops)
    # As the platform left them (an empty vLLM build has no rotary kernel to keep).
    built = list(config.compilation_config.custom_ops)
    assert built[: len(custom_ops)] == custom_ops
    mla_rotary_in_pytorch(config)
    assert config.compilation_config.custom_ops == built
