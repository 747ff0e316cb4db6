"""The vLLM releases the bridge takes (``vllm_version.py``), and the refusal of any other
at start-up, when vLLM loads the bridge's platform."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from npu_vllm_bridge.vllm_version import SUPPORTED_RANGE, require_supported_vllm


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0+empty", "0.33.2", "0.33.1rc1"])
def test_takes_0_32_and_0_33(version: str) -> None:
    assert require_supported_vllm(version).release[:2] in ((0, 32), (0, 33))


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "0.32.dev-broken"])
def test_refuses_other_releases_naming_both(version: str) -> None:
    with pytest.raises(RuntimeError) as raised:
        require_supported_vllm(version)
    assert SUPPORTED_RANGE in str(raised.value) and f"vLLM {version} is installed" in str(
        raised.value
    )


def test_the_installed_vllm_is_taken() -> None:
    require_supported_vllm()


# vLLM resolves its platform with the installed version faked to 0.31.0.
RESOLVE = """
import vllm
vllm.__version__ = "0.31.0"
from vllm.platforms import current_platform
print(type(current_platform).__name__)
"""


@pytest.mark.parametrize("mode", ["cpu", "npu"])
def test_an_unsupported_vllm_stops_at_start_up(mode: str) -> None:
    env = dict(os.environ, NPU_BRIDGE_DEVICE=mode, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = subprocess.run(
        [sys.executable, "-c", RESOLVE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0, proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError:"), proc.stderr[-3000:]
    assert f"vLLM {SUPPORTED_RANGE}" in last and "vLLM 0.31.0 is installed" in last
