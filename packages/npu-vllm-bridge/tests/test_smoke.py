"""The package imports, carries a version, and exposes its public names."""

import importlib.metadata

import npu_vllm_bridge


def test_version_matches_distribution() -> None:
    assert npu_vllm_bridge.__version__ == importlib.metadata.version("npu-vllm-bridge")


def test_public_names_present() -> None:
    for name in npu_vllm_bridge.__all__:
        assert hasattr(npu_vllm_bridge, name), name


def test_entry_point_declared() -> None:
    eps = importlib.metadata.entry_points(group="vllm.platform_plugins")
    targets = {ep.name: ep.value for ep in eps}
    assert targets.get("npu_bridge") == "npu_vllm_bridge.plugin:platform_plugin"
