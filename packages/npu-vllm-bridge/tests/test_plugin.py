"""The NPU_BRIDGE_DEVICE switch, and how vLLM's own loader sees the plugin."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

from npu_vllm_bridge import plugin


@pytest.fixture
def no_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has no torch_npu; make sure a stray one cannot leak in."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch_npu stand-in that reports one visible NPU."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=lambda: 1), raising=False)


@pytest.mark.parametrize("value", [None, "", "auto", "AUTO", " auto "])
def test_unset_or_auto_without_npu_stays_out_of_the_way(
    monkeypatch: pytest.MonkeyPatch, no_npu: None, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(plugin.DEVICE_ENV, raising=False)
    else:
        monkeypatch.setenv(plugin.DEVICE_ENV, value)
    assert plugin.platform_plugin() is None


def test_auto_with_npu_activates_npu_platform(
    monkeypatch: pytest.MonkeyPatch, fake_npu: None
) -> None:
    monkeypatch.delenv(plugin.DEVICE_ENV, raising=False)
    assert plugin.npu_unavailable_reason() is None
    assert plugin.platform_plugin() == plugin.NPU_PLATFORM


def test_cpu_activates_host_mode(monkeypatch: pytest.MonkeyPatch, no_npu: None) -> None:
    monkeypatch.setenv(plugin.DEVICE_ENV, "cpu")
    assert plugin.platform_plugin() == plugin.HOST_PLATFORM


def test_npu_forced_without_npu_fails_clearly(
    monkeypatch: pytest.MonkeyPatch, no_npu: None
) -> None:
    monkeypatch.setenv(plugin.DEVICE_ENV, "npu")
    assert plugin.platform_plugin() == plugin.NPU_PLATFORM
    with pytest.raises(RuntimeError, match=r"NPU_BRIDGE_DEVICE=npu .* no NPU is usable"):
        plugin.require_npu()


def test_npu_with_zero_devices_is_unusable(monkeypatch: pytest.MonkeyPatch, fake_npu: None) -> None:
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=lambda: 0), raising=False)
    assert plugin.npu_unavailable_reason() == "torch_npu sees no NPU device"


@pytest.mark.parametrize("value", ["host", "HOST", " host "])
def test_host_is_the_cpu_mode(monkeypatch: pytest.MonkeyPatch, no_npu: None, value: str) -> None:
    monkeypatch.setenv(plugin.DEVICE_ENV, value)
    assert plugin.requested_mode() == "cpu"
    assert plugin.platform_plugin() == plugin.HOST_PLATFORM


def test_unknown_mode_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.DEVICE_ENV, "gpu")
    expected = (
        r"one of \('auto', 'cpu', 'npu'\) \(or 'host', the same as 'cpu'\) or unset, got 'gpu'"
    )
    with pytest.raises(ValueError, match=expected):
        plugin.requested_mode()
    # vLLM swallows errors raised during detection: the plugin names a platform whose
    # creation raises instead.
    assert plugin.platform_plugin() == plugin.UNKNOWN_MODE_PLATFORM
    with pytest.raises(ValueError, match=expected):
        plugin.UnknownModePlatform()


def test_vllm_loader_discovers_the_entry_point() -> None:
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.platform_plugins")
    assert plugins.get("npu_bridge") is plugin.platform_plugin


def _platform_in_fresh_process(device_env: str | None) -> subprocess.CompletedProcess[str]:
    """Resolve vLLM's current platform in a new process (vLLM resolves it once)."""
    env = {k: v for k, v in os.environ.items() if k != plugin.DEVICE_ENV}
    if device_env is not None:
        env[plugin.DEVICE_ENV] = device_env
    code = (
        "from vllm.platforms import current_platform as p; "
        "print(type(p).__module__ + '.' + type(p).__qualname__)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(
    importlib.util.find_spec("vllm._C") is None,
    reason="a vLLM built empty has no CPU platform of its own",
)
def test_vllm_resolves_its_own_cpu_platform_when_unset() -> None:
    result = _platform_in_fresh_process(None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "vllm.platforms.cpu.CpuPlatform"


def test_vllm_resolves_host_platform_when_cpu() -> None:
    result = _platform_in_fresh_process("cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == plugin.HOST_PLATFORM


def test_vllm_resolves_host_platform_when_host() -> None:
    result = _platform_in_fresh_process("host")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == plugin.HOST_PLATFORM


def test_vllm_fails_clearly_on_an_unknown_switch_value() -> None:
    """Not vLLM's own CPU platform behind the user's back: the value is named."""
    result = _platform_in_fresh_process("hots")
    assert result.returncode != 0
    assert "NPU_BRIDGE_DEVICE must be one of" in result.stderr
    assert "got 'hots'" in result.stderr


def test_vllm_fails_clearly_when_npu_forced_without_npu() -> None:
    result = _platform_in_fresh_process("npu")
    assert result.returncode != 0
    assert "NPU_BRIDGE_DEVICE=npu asks for the Ascend NPU platform" in result.stderr
