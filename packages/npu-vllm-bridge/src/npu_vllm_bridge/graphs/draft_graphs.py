"""FULL graphs of the drafter's own forwards (EAGLE heads, draft models, MTP).

vLLM 0.32 captures nothing but PIECEWISE graphs for a drafter: its proposer keeps a
``CudagraphDispatcher`` of its own forced to PIECEWISE (or NONE), dispatches without
a uniform-batch flag, and its ``dummy_run`` (what vLLM's capture calls) runs without
attention metadata. The bridge adds the drafter's FULL graphs beside that:

* the drafter's model is wrapped in a :class:`DraftGraphWrapper`, a FULL
  ``BridgeGraphWrapper`` with a task registry of its own (never the target's);
* sizes: per request count ``R`` of the target's FULL verify graphs, a draft step of
  one token per request (``R`` tokens) and, for drafters whose first pass brings the
  verify step's ``1 + k`` tokens per request (EAGLE heads, MTP), a first pass of
  ``R * (1 + k)`` tokens. A draft model's first pass (``k + 2`` tokens per request)
  is not a decode batch and stays PIECEWISE or eager;
* they are captured at start-up with attention metadata that the drafter's own
  builders make for a dummy uniform batch;
* at run time :class:`DraftGraphDispatch`, installed on the proposer, answers FULL
  for a uniform pass whose size has a graph: the batch is padded to the captured
  size as vLLM pads the target's batch (requests of query length 0 on the null
  block, slot -1 tokens; the bridge's builders turn them into decodes over the null
  block) and the draft wrapper updates its tasks from the pass's per-layer metadata
  before replaying. Everything else goes to vLLM's own drafter dispatcher;
* the padded passes' device tensors (slots, block table, lengths) are copied into
  :class:`DraftStepBuffers`, where the capture's were too: an NPU task update
  re-issues an op on the tensors of its capture with new host arguments only, so a
  pass's own (padded, newly made) tensors cannot reach a graphed op.

Host mode runs all of it in CI; the NPU platform shares the runner mixin and runs the
same path through npu-graphs' NPU backend, unverified on hardware.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import (
    BatchDescriptor,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from npu_graphs import GraphBackend, capture_all
from npu_vllm_bridge.attention.tasks import count_attention_tasks
from npu_vllm_bridge.graphs.counters import graph_counters
from npu_vllm_bridge.graphs.wrapper import BridgeGraphWrapper, per_layer_metadata
from npu_vllm_bridge.spec_methods import GRAPHED_DRAFT_METHODS, mtp_methods

logger = init_logger(f"vllm.{__name__}")

# vLLM's padding of graph batches: null block 0 in block tables, slot -1 for tokens.
NULL_BLOCK_ID = 0
PADDING_SLOT_ID = -1


class DraftGraphWrapper(BridgeGraphWrapper):
    """The drafter's FULL graph wrapper: its own ``TaskRegistry`` and counters.

    vLLM's proposer puts only ``BatchDescriptor(num_tokens)`` in its forward context;
    the draft dispatch hands the wrapper the key of the pass it chose FULL for
    (``dispatch_key``; the capture passes its key in the context). Replays, task
    updates and captures are counted apart from the target's (``graph_counters().draft_*`` and the attributes here).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts_steps = False  # the target's wrapper counts eager steps
        self.dispatch_key: BatchDescriptor | None = None
        self.captured = self.replays = self.updates = self.other_forwards = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        context = get_forward_context()
        if context.cudagraph_runtime_mode != CUDAGraphMode.FULL:
            self.other_forwards += 1
            graph_counters().draft_other_forwards += 1
            return self.runnable(*args, **kwargs)
        if self.dispatch_key is not None:
            # vLLM's proposer sets only BatchDescriptor(num_tokens) in its context.
            context.batch_descriptor = self.dispatch_key
        key = context.batch_descriptor
        had_graph = key is not None and self.graphs.has_graph(key)
        outputs = super().__call__(*args, **kwargs)
        if not had_graph and self.graphs.has_graph(key):
            self.captured += 1
            graph_counters().draft_captured += 1
        return outputs

    def _before_replay(self, key: Any, attn_metadata: Any) -> None:
        self.replays += 1
        graph_counters().draft_replayed_steps += 1
        if self.tasks is not None and self.tasks.num_tasks(key):
            self._update_tasks(key, attn_metadata)

    def _update_tasks(self, key: Any, attn_metadata: Any) -> None:
        """Re-issue the drafter's tasks with the pass's per-layer metadata (counted)."""
        self.tasks.update(key, per_layer_metadata(attn_metadata))
        self.updates += 1
        graph_counters().draft_task_updates += 1


class DraftStepBuffers:
    """The device step tensors of the drafter's FULL passes, at fixed addresses.

    A FULL graph's attention tasks hold the tensors of their capture; an NPU task
    update re-issues each op on those tensors and changes only host arguments. Every
    graphed drafter pass, its capture included, therefore plans on views of these
    buffers: ``query_start_loc`` and ``seq_lens`` (int32 ``[max_reqs + 1]`` /
    ``[max_reqs]``), ``block_table`` (int32 ``[max_reqs, width]``) and
    ``slot_mapping`` (int64 ``[max_tokens]``), allocated on the first ``load`` with the
    dtypes and width of its metadata.
    """

    def __init__(self, max_reqs: int, max_tokens: int) -> None:
        if max_reqs < 1 or max_tokens < 1:
            raise ValueError(
                f"DraftStepBuffers needs max_reqs, max_tokens >= 1, got {max_reqs}, {max_tokens}"
            )
        self.max_reqs, self.max_tokens = max_reqs, max_tokens
        self.tensors: dict[str, torch.Tensor] = {}

    def load(self, cm: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """``cm`` with its device tensors copied into the buffers (views of them).

        Raises:
            ValueError: a batch larger than the buffers, or a block table of another
                width, dtype or device than the first one loaded.
        """
        num_reqs, num_tokens = cm.num_reqs, cm.num_actual_tokens
        if num_reqs > self.max_reqs or num_tokens > self.max_tokens:
            raise ValueError(
                f"the drafter's step buffers hold {self.max_reqs} requests / "
                f"{self.max_tokens} tokens, got {num_reqs} / {num_tokens}"
            )
        rows = {
            "query_start_loc": (cm.query_start_loc[: num_reqs + 1], self.max_reqs + 1),
            "seq_lens": (cm.seq_lens[:num_reqs], self.max_reqs),
            "block_table": (cm.block_table_tensor[:num_reqs], self.max_reqs),
            "slot_mapping": (cm.slot_mapping[:num_tokens], self.max_tokens),
        }
        views = {name: self._view(name, x, size) for name, (x, size) in rows.items()}
        return dataclasses.replace(
            cm,
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_table_tensor=views["block_table"],
            slot_mapping=views["slot_mapping"],
        )

    def _view(self, name: str, rows: torch.Tensor, size: int) -> torch.Tensor:
        buffer = self.tensors.get(name)
        if buffer is None:
            shape = (size, *rows.shape[1:])
            buffer = self.tensors[name] = torch.zeros(shape, dtype=rows.dtype, device=rows.device)
        if (buffer.shape[1:], buffer.dtype, buffer.device) != (
            rows.shape[1:],
            rows.dtype,
            rows.device,
        ):
            raise ValueError(
                f"the drafter's {name} buffer is {tuple(buffer.shape[1:])} {buffer.dtype} on "
                f"{buffer.device} per row, got {tuple(rows.shape[1:])} {rows.dtype} on "
                f"{rows.device}"
            )
        view = buffer[: rows.shape[0]]
        view.copy_(rows)
        return view


def pad_common_metadata(
    cm: CommonAttentionMetadata,
    num_reqs_padded: int,
    num_tokens_padded: int,
    buffers: DraftStepBuffers | None = None,
) -> CommonAttentionMetadata:
    """``cm`` padded to a graph batch as vLLM's model runner pads the target's.

    Padding requests have query length 0 (``query_start_loc`` repeats its last
    value), sequence length 0 and block-table rows of the null block; padding
    tokens have slot -1. ``num_reqs`` and ``num_actual_tokens`` count the padding,
    like the runner's ``CommonAttentionMetadata`` of a padded batch. With ``buffers``
    the device tensors are views of them (``DraftStepBuffers.load``).

    Raises:
        ValueError: the padded sizes are smaller than the batch, or exceed ``buffers``.
    """
    num_reqs, num_tokens = cm.num_reqs, cm.num_actual_tokens
    if num_reqs_padded < num_reqs or num_tokens_padded < num_tokens:
        raise ValueError(
            f"cannot pad a batch of {num_reqs} requests / {num_tokens} tokens to "
            f"{num_reqs_padded} requests / {num_tokens_padded} tokens"
        )
    pad_reqs, pad_tokens = num_reqs_padded - num_reqs, num_tokens_padded - num_tokens

    def pad_rows(x: torch.Tensor | None, value: Any) -> torch.Tensor | None:
        if x is None:
            return None
        x = x[:num_reqs]
        fill = x.new_full((pad_reqs, *x.shape[1:]), value)
        return torch.cat([x, fill])

    qsl = cm.query_start_loc[: num_reqs + 1]
    qsl_cpu = cm.query_start_loc_cpu[: num_reqs + 1]
    slots = cm.slot_mapping[:num_tokens]
    padded = dataclasses.replace(
        cm,
        query_start_loc=torch.cat([qsl, qsl[-1:].repeat(pad_reqs)]),
        query_start_loc_cpu=torch.cat([qsl_cpu, qsl_cpu[-1:].repeat(pad_reqs)]),
        seq_lens=pad_rows(cm.seq_lens, 0),
        seq_lens_cpu_upper_bound=pad_rows(cm.seq_lens_cpu_upper_bound, 0),
        num_reqs=num_reqs_padded,
        num_actual_tokens=num_tokens_padded,
        block_table_tensor=pad_rows(cm.block_table_tensor, NULL_BLOCK_ID),
        slot_mapping=torch.cat([slots, slots.new_full((pad_tokens,), PADDING_SLOT_ID)]),
        is_prefilling=pad_rows(cm.is_prefilling, False),
        positions=None,
    )
    return padded if buffers is None else buffers.load(padded)


def uniform_query_len(cm: CommonAttentionMetadata) -> int | None:
    """The query length every request of ``cm`` has, or ``None`` (mixed, empty)."""
    cu = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
    lengths = {b - a for a, b in itertools.pairwise(cu)}
    if len(lengths) != 1:
        return None
    (length,) = lengths
    return length if length > 0 and length * cm.num_reqs == cm.num_actual_tokens else None


def draft_descriptors(
    request_counts: list[int], num_speculative_tokens: int, first_pass: bool
) -> list[BatchDescriptor]:
    """The drafter's FULL batch keys, largest first: draft steps (``R`` requests of
    one token) and, with ``first_pass``, first passes (``R`` requests of ``1 + k``)."""
    query_lens = [1] if num_speculative_tokens > 1 else []
    if first_pass:
        query_lens.append(1 + num_speculative_tokens)
    descs = {
        BatchDescriptor(num_tokens=r * q, num_reqs=r, uniform=True)
        for r in set(request_counts)
        for q in query_lens
    }
    return sorted(descs, key=lambda d: (d.num_tokens, d.num_reqs), reverse=True)


def padded_descriptor(
    descs: list[BatchDescriptor], num_reqs: int, query_len: int
) -> BatchDescriptor | None:
    """The smallest key of ``descs`` for ``num_reqs`` requests of ``query_len`` tokens."""
    fits = [
        d
        for d in descs
        if d.num_reqs is not None
        and d.num_reqs >= num_reqs
        and d.num_tokens == d.num_reqs * query_len
    ]
    return min(fits, key=lambda d: d.num_reqs, default=None)


class DraftGraphDispatch:
    """Installed on a vLLM proposer: FULL dispatch and padding of its uniform passes.

    It wraps three of the proposer's methods on the instance. ``propose`` marks a
    proposal (its first pass, then its draft steps); the metadata build pads a
    uniform pass to the captured size the pass will replay; the batch-execution
    decision answers FULL with that size and hands the key to the draft wrapper.
    Outside a proposal (``dummy_run``: profiling, vLLM's PIECEWISE capture) and for
    passes without a graph, vLLM's own decision stands.
    """

    def __init__(self, drafter: Any, wrapper: DraftGraphWrapper, first_pass: bool) -> None:
        self.drafter = drafter
        self.wrapper = wrapper
        self.first_pass = first_pass
        self.descs: list[BatchDescriptor] = []
        self.phase: str | None = None
        self.first_key: BatchDescriptor | None = None
        self.first_tokens = 0
        self.step_key: BatchDescriptor | None = None
        self.buffers: DraftStepBuffers | None = None  # set with descs, by the capture
        self._propose = drafter.propose
        self._build = drafter.build_per_group_and_layer_attn_metadata
        self._determine = drafter._determine_batch_execution_and_padding
        drafter.propose = self.propose
        drafter.build_per_group_and_layer_attn_metadata = self.build
        drafter._determine_batch_execution_and_padding = self.determine

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        self.phase, self.first_key, self.step_key = "first", None, None
        try:
            return self._propose(*args, **kwargs)
        finally:
            self.phase = None
            self.wrapper.dispatch_key = None

    def build(self, cm: CommonAttentionMetadata, draft_index: int = 0) -> Any:
        key = None
        if self.phase == "first" and draft_index == 0:
            query_len = uniform_query_len(cm) if self.first_pass else None
            if query_len is not None:
                key = self._graphed(padded_descriptor(self.descs, cm.num_reqs, query_len))
            self.first_key = key
            self.first_tokens = cm.num_actual_tokens
        elif self.phase == "steps" and draft_index > 0:
            key = self.step_key
        if key is None:
            return self._build(cm, draft_index=draft_index)
        padded = pad_common_metadata(cm, key.num_reqs, key.num_tokens, self.buffers)
        return self._build(padded, draft_index=draft_index)

    def determine(self, num_tokens: int, use_cudagraphs: bool = True) -> Any:
        key = None
        if self.phase == "first":
            # The first pass's metadata was built (padded when graphed) just before.
            self.phase = "steps"
            key = self.first_key
            assert key is None or (use_cudagraphs and num_tokens == self.first_tokens), (
                f"the drafter's first pass was padded for {key} but runs {num_tokens} tokens"
            )
        elif self.phase == "steps" and use_cudagraphs:
            # Draft steps: one token per request; their metadata is built after this.
            key = self.step_key = self._graphed(padded_descriptor(self.descs, num_tokens, 1))
        if key is None:
            self.wrapper.dispatch_key = None
            return self._determine(num_tokens, use_cudagraphs=use_cudagraphs)
        self.wrapper.dispatch_key = key
        return CUDAGraphMode.FULL, key.num_tokens, None

    def _graphed(self, key: BatchDescriptor | None) -> BatchDescriptor | None:
        return key if key is not None and self.wrapper.has_graph(key) else None


class DraftGraphs:
    """The drafter's FULL graphs in a model runner: wrapper, dispatch and capture."""

    def __init__(self, runner: Any, drafter: Any, main_wrapper: BridgeGraphWrapper) -> None:
        vllm_config: VllmConfig = runner.vllm_config
        self.runner, self.drafter, self.vllm_config = runner, drafter, vllm_config
        model = drafter.model
        self.wrapper = DraftGraphWrapper(
            model,
            vllm_config,
            CUDAGraphMode.FULL,
            num_attention_layers=count_attention_tasks(vllm_config, model),
        )
        # Main and draft graphs never share a registry (nor its step buffers).
        assert self.wrapper.tasks is not None and self.wrapper.tasks is not main_wrapper.tasks
        drafter.model = self.wrapper
        self.k = vllm_config.speculative_config.num_speculative_tokens
        # EAGLE heads and MTP run the verify step's 1 + k tokens per request first;
        # a draft model takes one more (its first pass is not a decode batch).
        self.first_pass = not drafter.needs_extra_input_slots
        self.dispatch = DraftGraphDispatch(drafter, self.wrapper, self.first_pass)
        self.buffers: DraftStepBuffers | None = None

    def descriptors(self, main_descs: list[tuple[CUDAGraphMode, list]]) -> list[BatchDescriptor]:
        """Keys to capture: per request count of the target's FULL uniform graphs."""
        max_reqs = self.vllm_config.scheduler_config.max_num_seqs
        counts = [
            d.num_reqs if d.num_reqs is not None else d.num_tokens // (1 + self.k)
            for mode, descs in main_descs
            if mode == CUDAGraphMode.FULL
            for d in descs
            if d.uniform
        ]
        return draft_descriptors([r for r in counts if 0 < r <= max_reqs], self.k, self.first_pass)

    def capture(self, backend: GraphBackend, main_descs: list) -> Any:
        """Capture every draft key, largest first; sets the keys the dispatch uses."""
        descs = self.descriptors(main_descs)
        self.dispatch.descs = descs
        self.dispatch.buffers = self.step_buffers(descs)
        # The drafter's builders (and whatever step buffers they keep) are its own.
        main_builders = {
            id(builder)
            for groups in getattr(self.runner, "attn_groups", [])
            for group in groups
            for builder in group.metadata_builders
        }
        assert not any(
            id(builder) in main_builders
            for group in self.drafter.draft_attn_groups
            for builder in group.metadata_builders
        ), "the drafter shares a metadata builder with the target"
        if not descs:
            logger.info("No FULL drafter graphs to capture (no FULL uniform target graphs)")
            return None
        return capture_all(
            descs,
            self.capture_one,
            backend=backend,
            desc=f"Capturing {backend.name} graphs (drafter, FULL)",
        )

    def step_buffers(self, descs: list[BatchDescriptor]) -> DraftStepBuffers | None:
        """The step buffers of every graphed pass (and capture) of ``descs``: one set,
        sized for the largest key, kept across calls."""
        if not descs:
            return None
        max_reqs = max(d.num_reqs or 0 for d in descs)
        max_tokens = max(d.num_tokens for d in descs)
        held = self.buffers
        if held is None or held.max_reqs < max_reqs or held.max_tokens < max_tokens:
            self.buffers = DraftStepBuffers(max_reqs, max_tokens)
        return self.buffers

    def estimate(self, backend: GraphBackend, main_descs: list) -> int:
        """Own bytes of every draft graph, fit on the largest and smallest capture."""
        descs = self.descriptors(main_descs)
        if not descs:
            return 0
        self.step_buffers(descs)
        samples = []
        for desc in {descs[0].num_tokens: descs[0], descs[-1].num_tokens: descs[-1]}.values():
            before, _ = backend.memory_breakdown()
            self.capture_one(desc)
            after, _ = backend.memory_breakdown()
            samples.append((desc.num_tokens, after - before))
        (n_big, m_big), (n_small, m_small) = samples[0], samples[-1]
        slope = (m_big - m_small) / (n_big - n_small) if n_big != n_small else 0.0
        return int(sum(m_small + slope * (d.num_tokens - n_small) for d in descs))

    def capture_one(self, desc: BatchDescriptor) -> None:
        """Warm up (as vLLM's capture does) and capture one key with real metadata."""
        drafter, num_tokens = self.drafter, desc.num_tokens
        per_layer = self.capture_metadata(desc.num_reqs, num_tokens // desc.num_reqs)
        kwargs = self.model_inputs(num_tokens)
        # The proposer's slot buffer, all slot -1 (no KV writes), as its passes pass it.
        no_writes = torch.full((num_tokens,), PADDING_SLOT_ID, dtype=torch.int64)
        slots = drafter._get_slot_mapping(num_tokens, no_writes.to(drafter.device))
        for _ in range(self.vllm_config.compilation_config.cudagraph_num_of_warmups):
            with set_forward_context(
                per_layer, self.vllm_config, num_tokens=num_tokens, slot_mapping=slots
            ):
                self.wrapper(**kwargs)
        with set_forward_context(
            per_layer,
            self.vllm_config,
            num_tokens=num_tokens,
            cudagraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=desc,
            slot_mapping=slots,
        ):
            self.wrapper(**kwargs)
        if not self.wrapper.has_graph(desc):
            raise RuntimeError(f"the drafter's FULL graph for {desc} was not captured")

    def capture_metadata(self, num_reqs: int, query_len: int) -> dict[str, Any]:
        """Per-layer metadata of the drafter's builders for a dummy uniform batch."""
        cm = dummy_uniform_metadata(
            num_reqs,
            query_len,
            self.block_table_width(),
            self.vllm_config.model_config.max_model_len,
            self.drafter.device,
        )
        if self.buffers is not None:  # the tensors every replay of the key plans on
            cm = self.buffers.load(cm)
        per_layer: dict[str, Any] = {}
        for group in self.drafter.draft_attn_groups:
            metadata = group.build_metadata_for_cudagraph_capture(cm, 0)
            for name in group.layer_names:
                per_layer[name] = metadata
        return per_layer

    def block_table_width(self) -> int:
        table = self.runner.input_batch.block_table[self.drafter.kv_cache_gid]
        return table.get_device_tensor(1).shape[1]

    def model_inputs(self, num_tokens: int) -> dict[str, Any]:
        """The proposer's fixed input buffers sliced as its passes slice them."""
        drafter = self.drafter
        if drafter.supports_mm_inputs:
            kwargs = {"input_ids": None, "inputs_embeds": drafter.inputs_embeds[:num_tokens]}
        else:
            kwargs = {"input_ids": drafter.input_ids[:num_tokens], "inputs_embeds": None}
        kwargs["positions"] = drafter._get_positions(num_tokens)
        if drafter.pass_hidden_states_to_model:
            kwargs["hidden_states"] = drafter.hidden_states[:num_tokens]
        return kwargs


def dummy_uniform_metadata(
    num_reqs: int, query_len: int, block_table_width: int, max_seq_len: int, device: Any
) -> CommonAttentionMetadata:
    """A uniform batch of ``num_reqs`` requests of ``query_len`` tokens for capture:
    null-block tables, no KV writes (slot -1); the builders' capture path plans the
    longest context."""
    num_tokens = num_reqs * query_len
    cu = torch.arange(num_reqs + 1, dtype=torch.int32) * query_len
    seq_lens = torch.full((num_reqs,), query_len, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=cu.to(device),
        query_start_loc_cpu=cu,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=query_len,
        max_seq_len=max_seq_len,
        block_table_tensor=torch.full(
            (num_reqs, block_table_width), NULL_BLOCK_ID, dtype=torch.int32, device=device
        ),
        slot_mapping=torch.full((num_tokens,), PADDING_SLOT_ID, dtype=torch.int64, device=device),
        causal=True,
    )


def install_draft_graphs(runner: Any, main_wrapper: BridgeGraphWrapper) -> DraftGraphs | None:
    """Wrap the runner's drafter for FULL graphs, or log why it keeps vLLM's
    PIECEWISE/eager drafter forwards; ``None`` when nothing was installed."""
    drafter = getattr(runner, "drafter", None)
    if not isinstance(drafter, SpecDecodeBaseProposer) or getattr(drafter, "model", None) is None:
        return None
    config = runner.vllm_config
    spec = config.speculative_config
    reason = why_not_graphed(spec, config, mtp_methods())
    if reason is not None:
        logger.info("The %s drafter runs without FULL graphs: %s", spec.method, reason)
        return None
    graphs = DraftGraphs(runner, drafter, main_wrapper)
    logger.info(
        "The %s drafter gets FULL graphs of its own (task registry apart from the "
        "target's; %d updatable tasks per graph; first pass graphed: %s)",
        spec.method,
        graphs.wrapper.tasks.expected_tasks if graphs.wrapper.tasks else 0,
        graphs.first_pass,
    )
    return graphs


def why_not_graphed(spec: Any, config: VllmConfig, mtp: tuple[str, ...]) -> str | None:
    """Why the drafter of ``spec`` keeps vLLM's PIECEWISE/eager forwards, or ``None``
    when the bridge gives it FULL graphs (``mtp``: vLLM's names of MTP methods)."""
    if spec.method == "eagle3":
        return (
            "vLLM's proposer asserts the EAGLE-3 head's model class (it unwraps only its own "
            "graph wrapper), so the head cannot be wrapped; vLLM's PIECEWISE/eager drafter runs"
        )
    if spec.method not in (*GRAPHED_DRAFT_METHODS, *mtp):
        return (
            f"method {spec.method!r} is not one the bridge graphs "
            f"({list(GRAPHED_DRAFT_METHODS)} and MTP); vLLM's PIECEWISE/eager drafter runs"
        )
    if spec.enforce_eager:
        return "speculative_config.enforce_eager is set"
    if spec.disable_padded_drafter_batch:
        return "disable_padded_drafter_batch is set (passes of varying size per request)"
    if config.parallel_config.data_parallel_size > 1:
        return "data parallelism would need the drafter's padding agreed across ranks"
    return None
