"""Host mode's V2 runner (``host/runner_v2.py``) builds vLLM's DP metadata outside the
host graph's recording in every capture of its graph managers: the target's and the
EAGLE / MTP drafter's (captured at start-up, where vLLM's capture forward enters its
forward context, which with data parallelism builds the DP metadata and asserts on a
value of the CPU token counts; recorded, that capture fails on the host value). The
runner here is the bridge's class on stand-in state, vLLM's ``initialize_kv_cache`` and
``DPMetadata.make`` replaced by recorders; the whole path runs in
tests-integration/test_v2_dp_spec_decode.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import vllm.forward_context as forward_context

from npu_vllm_bridge.graphs.v2_draft_graphs import BridgeSpeculatorGraphManager
from npu_vllm_bridge.graphs.v2_graphs import BridgeModelGraphManager
from npu_vllm_bridge.host import runner_v2
from npu_vllm_bridge.host.runner_v2 import HostModelRunnerV2
from npu_vllm_bridge.worker.bridge_runner import BridgeModelRunnerV2


def test_target_and_drafter_captures_build_dp_metadata_unrecorded(monkeypatch) -> None:
    log: list[str] = []

    @contextlib.contextmanager
    def unrecorded() -> Iterator[None]:
        log.append("unrecorded")
        yield
        log.append("recorded")

    def make(*args, **kwargs) -> str:
        log.append("make")
        return "dp metadata"

    monkeypatch.setattr(runner_v2, "unrecorded_host_work", unrecorded)
    monkeypatch.setattr(runner_v2, "register_pointer_tensors", lambda tensors: None)
    monkeypatch.setattr(BridgeModelRunnerV2, "initialize_kv_cache", lambda self, *a, **k: None)
    monkeypatch.setattr(forward_context.DPMetadata, "make", staticmethod(make))

    def manager(cls: type):
        return cls.__new__(cls)  # without vLLM's set-up

    runner = HostModelRunnerV2.__new__(HostModelRunnerV2)
    runner.cudagraph_manager = manager(BridgeModelGraphManager)
    runner.speculator = SimpleNamespace(
        prefill_cudagraph_manager=manager(BridgeSpeculatorGraphManager),
        decode_cudagraph_manager=manager(BridgeSpeculatorGraphManager),
    )
    runner.block_tables = SimpleNamespace(block_tables=[], input_block_tables=[])
    runner.pcp_manager = None
    runner.initialize_kv_cache(object())

    speculator = runner.speculator
    managers = {
        "target": runner.cudagraph_manager,
        "draft prefill": speculator.prefill_cudagraph_manager,
        "draft decode": speculator.decode_cudagraph_manager,
    }
    for name, graphs in managers.items():
        log.clear()
        with graphs.around_capture():
            assert forward_context.DPMetadata.make(None, 3, None) == "dp metadata"
        assert log == ["unrecorded", "make", "recorded"], name
    log.clear()
    forward_context.DPMetadata.make(None, 3, None)  # outside a capture: as vLLM's
    assert log == ["make"]
