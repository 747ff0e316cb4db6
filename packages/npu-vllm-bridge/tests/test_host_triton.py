"""Host mode's Triton interpreter for V2 (``host/triton_interpreter.py``), each case in a
fresh process: it acts once, when vLLM loads the platform."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

# What vLLM and the process look like once vLLM has loaded its platform and checked
# for Triton.
STATE = """
import json, os, sys
import torch.utils._triton
import triton.backends
import triton.language as tl
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction
from vllm.config import VllmConfig  # vLLM checks for Triton on the way
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON
from npu_vllm_bridge.host import triton_interpreter

print("STATE " + json.dumps({
    "platform": type(current_platform).__name__,
    "has_triton": HAS_TRITON,
    "interpreting": triton_interpreter.interpreting(),
    "interpret_knob": bool(knobs.runtime.interpret),
    "helpers_interpreted": isinstance(tl.max, InterpretedFunction),
    "cpu_backend_visible": "cpu" in triton.backends.backends,
    "stand_in_visible": triton_interpreter.ACTIVE_STAND_IN_BACKEND in triton.backends.backends,
    "torch_sees_triton": torch.utils._triton.has_triton(),
    "env_interpret": os.environ.get("TRITON_INTERPRET"),
    # A config only where V2 runs (vLLM's own CPU platform refuses V2 without Triton).
    "jit_warmup": (
        VllmConfig().kernel_config.enable_jit_warmup if triton_interpreter.interpreting() else None
    ),
}))
"""

# A Triton kernel launched outside a host-graph capture, then inside one.
CAPTURE = """
import torch
from vllm.platforms import current_platform
current_platform.device_type  # the platform module sets the interpreter up
import triton
import triton.language as tl
from npu_graphs import GraphCaptureError, GraphWrapper, RuntimeMode, graph_dispatch

@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)

x = torch.zeros(8)
add_one[(1,)](x, 8, BLOCK=8)
assert x.tolist() == [1.0] * 8, x
graph = GraphWrapper(lambda t: add_one[(1,)](t, 8, BLOCK=8), backend="host", mode=RuntimeMode.FULL)
try:
    with graph_dispatch(RuntimeMode.FULL, 8):
        graph(x)
except GraphCaptureError as exc:
    print("REFUSED " + str(exc).replace(chr(10), " "))
"""


def _run(code: str, **env: str) -> str:
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NPU_BRIDGE_DEVICE", "VLLM_USE_V2_MODEL_RUNNER")
    }
    environ.update(env, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _state(**env: str) -> dict:
    (line,) = [line for line in _run(STATE, **env).splitlines() if line.startswith("STATE ")]
    return json.loads(line[len("STATE ") :])


def test_v2_in_host_mode_interprets_and_nothing_else_sees_the_stand_in() -> None:
    state = _state(NPU_BRIDGE_DEVICE="cpu", VLLM_USE_V2_MODEL_RUNNER="1")
    assert state == {
        "platform": "HostPlatform",
        "has_triton": True,
        "interpreting": True,
        "interpret_knob": True,
        "helpers_interpreted": True,
        "cpu_backend_visible": False,  # torch's inductor would take it for Triton CPU
        "stand_in_visible": False,
        "torch_sees_triton": False,
        "env_interpret": None,  # the knob, not the environment
        "jit_warmup": False,  # interpreted kernels: nothing to warm up
    }


@pytest.mark.parametrize(
    "env",
    [
        {"NPU_BRIDGE_DEVICE": "cpu"},  # host mode's default runner: V1
        {"NPU_BRIDGE_DEVICE": "cpu", "VLLM_USE_V2_MODEL_RUNNER": "0"},
        pytest.param(
            {"VLLM_USE_V2_MODEL_RUNNER": "1"},  # not host mode: vLLM's own CPU platform
            marks=pytest.mark.skipif(
                importlib.util.find_spec("vllm._C") is None,
                reason="an empty vLLM build has no CPU platform of its own",
            ),
        ),
    ],
)
def test_without_v2_in_host_mode_triton_is_left_alone(env: dict[str, str]) -> None:
    state = _state(**env)
    assert not state["has_triton"] and not state["interpreting"]
    assert not state["interpret_knob"] and not state["helpers_interpreted"]
    assert not state["cpu_backend_visible"] and state["env_interpret"] is None
    assert not state["stand_in_visible"]


def test_an_interpreted_kernel_inside_a_host_graph_capture_is_refused() -> None:
    out = _run(CAPTURE, NPU_BRIDGE_DEVICE="cpu", VLLM_USE_V2_MODEL_RUNNER="1")
    refused = [line for line in out.splitlines() if line.startswith("REFUSED ")]
    assert refused, out
    assert "add_one was launched under Triton's interpreter" in refused[0]
    assert "register_kernels" in refused[0]


@pytest.mark.parametrize("interpreting", [True, False])
def test_kernel_warm_up_is_off_only_under_the_interpreter(monkeypatch, interpreting) -> None:
    """vLLM 0.33's CPU worker warms V2's Triton kernels up when ``enable_jit_warmup``
    (some launches fail under the interpreter); host mode turns it off when it
    interprets them, and leaves it otherwise."""
    from types import SimpleNamespace

    from npu_vllm_bridge.host import triton_interpreter

    monkeypatch.setattr(triton_interpreter, "_interpreting", interpreting)
    config = SimpleNamespace(kernel_config=SimpleNamespace(enable_jit_warmup=True))
    assert triton_interpreter.no_jit_warmup_when_interpreting(config) is interpreting
    assert config.kernel_config.enable_jit_warmup is not interpreting
    assert not triton_interpreter.no_jit_warmup_when_interpreting(config)  # nothing left to do
