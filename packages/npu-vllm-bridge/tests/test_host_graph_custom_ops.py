"""Host graphs run the custom ops that eager steps run (``host/custom_ops.py``).

vLLM picks its custom-op default (``"none"`` where inductor compiles, else ``"all"``)
before host mode turns inductor off for its graphs. At bfloat16 vLLM's C++ rotary
embedding, which eager steps run, and its PyTorch one round differently, so SmolLM2's
prefill gave other logits in an engine with FULL_DECODE_ONLY graphs than in an eager one.
Each case builds an eager engine's config and a graph engine's through the host platform,
vLLM's rotary layer under each, and a prefill-shaped bfloat16 batch: the graph config's
layer, captured in a host graph and replayed on new inputs, must give the eager config's
output bit for bit (the same kernel on the same inputs: tolerance 0).
"""

from __future__ import annotations

import pytest
import torch
import vllm.platforms
from tiny_configs import write_config
from vllm.config import CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config

from npu_graphs import get_backend
from npu_vllm_bridge.host import custom_ops
from npu_vllm_bridge.host.platform import HostPlatform
from npu_vllm_bridge.host.worker import record_cpu_kernels_whole

# SmolLM2-135M's attention: 9 query and 3 KV heads of 64, rope theta 1e5, neox style.
HEADS, KV_HEADS, HEAD_SIZE, THETA, MAX_POSITION = 9, 3, 64, 100000.0, 8192
TOKENS = 37  # the chat prompt's prefill


@pytest.fixture
def host_platform(monkeypatch) -> HostPlatform:
    """The host platform as vLLM's current platform while configs are built."""
    platform = HostPlatform()
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    return platform


def _config(tmp_path, **kwargs) -> VllmConfig:
    model = ModelConfig(
        model=write_config(tmp_path / "model"),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=kwargs.pop("enforce_eager", False),
    )
    return VllmConfig(model_config=model, compilation_config=CompilationConfig(**kwargs))


def _rotary(config: VllmConfig) -> torch.nn.Module:
    """vLLM's rotary layer as the model builds it under ``config`` (made anew: ``get_rope``
    caches one layer per shape, whatever config built it)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(config):
        return RotaryEmbedding(HEAD_SIZE, HEAD_SIZE, MAX_POSITION, THETA, True, torch.bfloat16)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randperm(TOKENS * 40, generator=generator)[:TOKENS]
    query = torch.randn(TOKENS, HEADS * HEAD_SIZE, generator=generator).to(torch.bfloat16)
    key = torch.randn(TOKENS, KV_HEADS * HEAD_SIZE, generator=generator).to(torch.bfloat16)
    return positions, query, key


def _eager(rotary: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    positions, query, key = batch
    return rotary(positions, query.clone(), key.clone())


def _replayed(rotary: torch.nn.Module, batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``rotary`` captured in a host graph on the first batch (the query and key cloned
    first, as the model's are views of its QKV output), replayed on each batch."""
    host = get_backend("host")
    record_cpu_kernels_whole()  # what the host worker registers before a capture
    positions, query, key = (t.clone() for t in batches[0])
    graph = host.new_graph()
    with host.capture(graph):
        out = rotary(positions, query.clone(), key.clone())
    results = []
    for batch in batches:
        for static, new in zip((positions, query, key), batch, strict=True):
            static.copy_(new)
        host.replay(graph)
        results.append(tuple(t.clone() for t in out))
    return results


@pytest.mark.parametrize(
    "graphs",
    [
        {"cudagraph_mode": "FULL_DECODE_ONLY"},  # compilation off
        {},  # vLLM's default, FULL_AND_PIECEWISE: Dynamo with the eager backend
    ],
    ids=["full_decode_only", "default"],
)
def test_graph_replay_rotates_as_eager_steps(host_platform, tmp_path, graphs):
    eager = _rotary(_config(tmp_path, enforce_eager=True))
    graph_config = _config(tmp_path, **graphs)
    assert graph_config.compilation_config.cudagraph_mode.has_full_cudagraphs()
    batches = [_batch(seed) for seed in range(3)]
    for batch, replayed in zip(batches, _replayed(_rotary(graph_config), batches), strict=True):
        expected = _eager(eager, batch)
        assert not torch.equal(expected[0], batch[1])  # it rotates
        for got, want in zip(replayed, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_users_choice_of_custom_ops_stays(host_platform, tmp_path):
    config = _config(tmp_path, cudagraph_mode="FULL_DECODE_ONLY", custom_ops=["none"])
    assert "all" not in config.compilation_config.custom_ops
    assert config.compilation_config.is_custom_op_enabled("rotary_embedding") is False


def test_vllms_rule_is_applied_again_only_where_it_changes(tmp_path):
    from vllm.config import CompilationMode

    compilation = CompilationConfig(custom_ops=["none", "-rotary_embedding"])
    compilation.mode, compilation.backend = CompilationMode.VLLM_COMPILE, "inductor"
    assert custom_ops.redo_vllm_default(compilation) is None  # inductor compiles
    compilation.backend = "eager"
    assert custom_ops.redo_vllm_default(compilation) == "all"
    assert compilation.custom_ops == ["all", "-rotary_embedding"]
    compilation.custom_ops.append("none")
    with pytest.raises(ValueError, match=r"one of 'all' or 'none'.*got \['all'"):
        custom_ops.redo_vllm_default(compilation)


def test_only_a_default_vllm_chose_is_noted():
    chosen, defaulted = CompilationConfig(custom_ops=["none"]), CompilationConfig()
    for compilation in (chosen, defaulted):
        custom_ops.note_user_choice(compilation)
    assert not custom_ops.take_defaulted(chosen)
    assert custom_ops.take_defaulted(defaulted)
    assert not custom_ops.take_defaulted(defaulted)  # forgotten once taken
