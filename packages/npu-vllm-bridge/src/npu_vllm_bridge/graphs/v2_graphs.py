"""npu-graphs graphs in vLLM's Model Runner V2, through its ``ModelCudaGraphManager``.

V2 captures and replays its FULL graphs itself (``vllm/v1/worker/gpu/cudagraph_utils.py``):
``CudaGraphManager.capture`` hard-codes ``torch.cuda.CUDAGraph``, and ``run_fullgraph``
replays with no forward context, so nothing around the model sees the step's attention
metadata. :class:`BridgeModelGraphManager` keeps everything else of vLLM's manager (the
batch descriptors to capture and their dispatch, the capture inputs, the persistent
output buffers) and replaces those two methods:

* ``capture``: per descriptor, vLLM's warm-up forward, then the FULL forward captured by
  an npu-graphs ``GraphWrapper`` keyed by the descriptor, the attention ops recorded as
  tasks named after their layers (``attention/tasks.py``). PIECEWISE descriptors run
  vLLM's compiled model, whose pieces the platform's ``BridgeGraphWrapper`` captures.
* ``run_fullgraph(desc)``: the step's ``{layer_name: attn_metadata}`` (left by the model
  runner in :attr:`BridgeModelGraphManager.step_attn_metadata`, from the model state's
  ``prepare_attn``) updates the tasks, then the graph replays.

The model runner installs the class where vLLM builds its manager (see
``worker/host_v2.py``).
"""

from __future__ import annotations

from typing import Any

from vllm.compilation.counter import compilation_counter
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import (
    BatchExecutionDescriptor,
    CreateForwardFn,
    CudaGraphManager,
    ModelCudaGraphManager,
)

from npu_graphs import (
    GraphWrapper,
    RuntimeMode,
    TaskRegistry,
    capture_all,
    get_backend,
    graph_dispatch,
)
from npu_vllm_bridge.attention.tasks import count_attention_tasks
from npu_vllm_bridge.graphs.counters import graph_counters
from npu_vllm_bridge.graphs.wrapper import graph_backend_name, per_layer_metadata


class NpuGraphsCapture(CudaGraphManager):
    """``CudaGraphManager``'s capture loop and FULL replay over npu-graphs.

    Placed after ``ModelCudaGraphManager`` in :class:`BridgeModelGraphManager`'s
    bases, so that vLLM's model capture (inputs, outputs) calls this capture loop.
    """

    wrapper: GraphWrapper | None = None  # vLLM's ``graphs`` maps descriptors to its entries
    tasks: TaskRegistry | None = None
    step_attn_metadata: dict[str, Any] | None = None

    def capture(
        self, create_forward_fn: CreateForwardFn, progress_bar_desc: str = "Capturing graphs"
    ) -> None:
        """Capture every descriptor of vLLM's plan, PIECEWISE first, then FULL (largest
        first in each); under vLLM's memory profiling, only its sample of FULL graphs,
        each one's bytes appended to its samples."""
        if self.wrapper is None:
            raise ValueError("capture(create_forward_fn) before the model's capture set up graphs")
        backend = self.wrapper.backend
        for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            descs = self._capture_descs.get(mode, [])
            if mode == CUDAGraphMode.FULL and self._max_full_descs_to_capture is not None:
                descs = descs[: self._max_full_descs_to_capture]
            capture_all(
                descs,
                lambda desc: self._capture_one(create_forward_fn, desc),
                backend=backend,
                desc=f"{progress_bar_desc} ({backend.name}, {mode.name})",
            )
        self._graphs_captured = True

    def _capture_one(self, create_forward_fn: CreateForwardFn, desc: Any) -> None:
        warmup = create_forward_fn(desc, warmup=True)
        warmup(CUDAGraphMode.NONE)  # also allocates the persistent outputs, outside graphs
        if desc.cg_mode == CUDAGraphMode.PIECEWISE:
            warmup(CUDAGraphMode.PIECEWISE)  # the compiled model's pieces capture themselves
            return
        forward_fn = create_forward_fn(desc, warmup=False)
        before = self.wrapper.backend.memory_in_use()
        with graph_dispatch(RuntimeMode.FULL, desc):
            self.wrapper(forward_fn)
        if self._capture_mem_samples is not None:
            self._capture_mem_samples.append(self.wrapper.backend.memory_in_use() - before)
        self.graphs[desc] = self.wrapper.entry(desc)
        compilation_counter.num_cudagraph_captured += 1
        graph_counters().captured += 1

    def run_fullgraph(self, desc: BatchExecutionDescriptor) -> None:
        """Replay ``desc``'s graph with its attention tasks brought to the step's
        metadata, in the order the graph backend takes (``updates_follow_replay``): on
        the NPU the replay is launched first and the update follows on the backend's
        update stream, each task released by its event; on the host the update comes
        first.

        Raises:
            ValueError: no step metadata was left since the last replay.
        """
        attn_metadata, self.step_attn_metadata = self.step_attn_metadata, None
        if attn_metadata is None:
            raise ValueError(
                f"FULL graph replay of {desc} without the step's attention metadata: "
                "the model state's prepare_attn did not run for this step"
            )
        counters = graph_counters()
        counters.replayed_steps += 1
        if not self.tasks.num_tasks(desc):
            self.wrapper.replay(desc)
            return
        counters.task_updates += 1
        self.wrapper.replay_with_update(desc, lambda: self._update_tasks(desc, attn_metadata))

    def _update_tasks(self, desc: BatchExecutionDescriptor, attn_metadata: Any) -> None:
        self.tasks.update(desc, per_layer_metadata(attn_metadata))


class BridgeModelGraphManager(ModelCudaGraphManager, NpuGraphsCapture):
    """vLLM's ``ModelCudaGraphManager`` whose graphs are npu-graphs graphs."""

    def capture(self, model: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's model capture (``ModelCudaGraphManager.capture``'s arguments) into a
        ``GraphWrapper`` of the platform's graph backend; each FULL graph must record
        one attention task per attention layer of ``model``."""
        if self.use_breakable_cg:
            raise NotImplementedError(
                "VLLM_USE_BREAKABLE_CUDAGRAPH: breakable CUDA graphs are torch.cuda graphs; "
                "the bridge captures PIECEWISE graphs through vLLM's compiled pieces"
            )
        self.tasks = TaskRegistry(
            "attention", expected_tasks=count_attention_tasks(self.vllm_config, model)
        )
        self.wrapper = GraphWrapper(
            _run_forward,
            backend=get_backend(graph_backend_name()),
            mode=RuntimeMode.FULL,
            pool=self.pool,
            tasks=self.tasks,
            name=f"{type(model).__name__}[FULL]",
        )
        super().capture(model, *args, **kwargs)


def _run_forward(forward_fn: Any) -> None:
    """What a FULL graph records: vLLM's capture forward (inputs and outputs in the
    manager's persistent buffers)."""
    forward_fn(CUDAGraphMode.NONE)
