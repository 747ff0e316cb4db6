"""The NPU platform's class and start-up checks, on a machine without an NPU.

torch_npu cannot be imported here, so the module is loaded with a stand-in
``torch_npu`` and the NPU probe answering "usable"; nothing here touches a device.
What runs on the device (worker, kernels, graphs) is not exercised by these tests.
"""

from __future__ import annotations

import importlib
import json
import sys
import types

import pytest
import torch
from vllm.config import CacheConfig, CompilationConfig, ModelConfig, VllmConfig
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm_builds import needs_vllm_cpu_platform


@pytest.fixture
def npu_platform(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr("npu_vllm_bridge.plugin.npu_unavailable_reason", lambda: None)
    monkeypatch.delitem(sys.modules, "npu_vllm_bridge.platforms.npu", raising=False)
    module = importlib.import_module("npu_vllm_bridge.platforms.npu")
    yield module.NPUPlatform
    sys.modules.pop("npu_vllm_bridge.platforms.npu", None)


def _config(tmp_path, **cache) -> VllmConfig:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16"),
        cache_config=CacheConfig(**cache),
        compilation_config=CompilationConfig(cudagraph_capture_sizes=[]),
    )


def test_device_identity(npu_platform):
    assert npu_platform.device_type == "npu"
    assert npu_platform.dispatch_key == "PrivateUse1"
    assert npu_platform.device_control_env_var == "ASCEND_RT_VISIBLE_DEVICES"
    assert npu_platform.dist_backend == "hccl"
    assert npu_platform.bridge_settings.attention_provider == "ascend"
    assert npu_platform.bridge_settings.graph_backend == "npu"
    assert npu_platform.bridge_settings.kv_cache_split == "planes"
    assert npu_platform.get_static_graph_wrapper_cls().endswith("BridgeGraphWrapper")


def test_attention_backend_is_the_bridges(npu_platform):
    selector = AttentionSelectorConfig(128, torch.bfloat16, "auto", 128)
    path = npu_platform.get_attn_backend_cls(None, selector)
    assert path == "npu_vllm_bridge.attention.backend.NPUBridgeAttentionBackend"


@needs_vllm_cpu_platform
def test_default_block_size_and_worker(npu_platform, tmp_path):
    config = _config(tmp_path)
    config.parallel_config.worker_cls = "auto"  # this process's CPU platform filled it in
    npu_platform.check_and_update_config(config)
    assert config.cache_config.block_size == 128
    assert config.parallel_config.worker_cls == "npu_vllm_bridge.worker.npu.NPUWorker"


@needs_vllm_cpu_platform
def test_other_block_size_is_refused(npu_platform, tmp_path):
    config = _config(tmp_path)
    config.cache_config.block_size = 64
    config.cache_config.user_specified_block_size = True
    with pytest.raises(ValueError, match=r"block_size=128 on the NPU.*got block_size=64"):
        npu_platform.check_and_update_config(config)


def test_float32_is_refused(npu_platform):
    with pytest.raises(ValueError, match=r"float16 or bfloat16.*got torch.float32"):
        npu_platform.check_if_supports_dtype(torch.float32)
