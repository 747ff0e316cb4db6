"""Host mode on vLLM's Model Runner V2: its CPU runner with npu-graphs graphs.

The graph manager is the bridge's
(:class:`~npu_vllm_bridge.graphs.v2_graphs.BridgeModelGraphManager`), installed where
vLLM builds its own and handed each step's attention metadata by the hook the NPU's V2
runner shares (``graphs/v2_runner.py``); capture, the graph-memory estimate and the rest
of what the NPU's V2 runner adds come from ``bridge_runner.py``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from vllm.config import CompilationMode
from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2

from npu_vllm_bridge.graphs.v2_draft_graphs import draft_graph_managers
from npu_vllm_bridge.graphs.v2_graphs import NpuGraphsCapture
from npu_vllm_bridge.host.moe import moe_layers_through_custom_op
from npu_vllm_bridge.host.v2_kernels import register_pointer_tensors
from npu_vllm_bridge.vllm_seam import dp_metadata_make_inside, pcp_local_block_tables
from npu_vllm_bridge.worker.bridge_runner import BridgeModelRunnerV2


class HostModelRunnerV2(BridgeModelRunnerV2, CPUModelRunnerV2):
    """vLLM's V2 ``CPUModelRunner`` whose graphs are npu-graphs host graphs, with what the
    bridge's V2 runners add on the NPU too (``bridge_runner.py``)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        moe_layers_through_custom_op(self.vllm_config)

    def warming_up_model(self) -> None:
        """A warm-up forward only with something to compile, as vLLM's V1 CPU runner
        (host mode compiles only for PIECEWISE graphs)."""
        if self.compilation_config.mode != CompilationMode.NONE:
            super().warming_up_model()

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's, building the bridge's graph manager; its captures and the
        drafter's build vLLM's DP metadata unrecorded; the block tables' data pointers
        are registered for the PyTorch block-table kernels."""
        super().initialize_kv_cache(*args, **kwargs)
        drafters = draft_graph_managers(getattr(self, "speculator", None))
        for manager in (self.cudagraph_manager, *drafters):  # the drafter's capture too
            if isinstance(manager, NpuGraphsCapture):
                dp_metadata_unrecorded_in_captures(manager)
        tables = self.block_tables
        register_pointer_tensors([table.gpu for table in tables.block_tables])
        register_pointer_tensors(tables.input_block_tables)
        pcp_tables = pcp_local_block_tables(self.pcp_manager)
        if pcp_tables is not None:  # prefill context parallel: each rank's local rows
            register_pointer_tensors(pcp_tables)


def dp_metadata_unrecorded_in_captures(manager: NpuGraphsCapture) -> None:
    """In ``manager``'s captures, vLLM's ``DPMetadata.make`` runs unrecorded.

    vLLM's V2 capture forward enters its forward context inside the capture; with
    data parallelism that builds the DP metadata, which asserts on a value of the CPU
    tensor of token counts. On a device graph that is a host op beside the capture; a
    host graph records every CPU op and refuses one that hands a value back. The
    metadata only wraps the tensor, so no replay needs it redone."""
    manager.around_capture = functools.partial(dp_metadata_make_inside, unrecorded_host_work)


def unrecorded_host_work() -> contextlib.AbstractContextManager[None]:
    """What host-side work inside a capture runs in: outside the host graph's recording."""
    from npu_graphs.backends.host import HostGraphBackend

    return HostGraphBackend.unrecorded()
