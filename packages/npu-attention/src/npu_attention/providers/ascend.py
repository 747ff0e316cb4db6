"""Ascend NPU kernels through torch_npu's fused attention operators.

Written against torch_npu's published API (operator schemas of torch_npu 2.14.0,
op-plugin documentation) and checked in CI against those schemas with a stand-in
``torch_npu`` module on CPU tensors (``tests-conformance/``). No machine this
package is developed on has an Ascend NPU: this provider has not run on hardware.

Operators, one per job:

- KV write: ``torch_npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache,
  slot_mapping, cache_mode="Norm")`` on ND caches ``[num_blocks, block_size,
  kv_heads, head_size]``. The op documents slots in ``[0, num_blocks * block_size)``
  only, so padding slots (``-1``) never reach it: graph padding beyond
  ``plan.num_actual_tokens`` is cut off, and ``-1`` slots among the step's tokens are
  treated as the plan's ``slot_handling`` says. ``"host"``: ``prepare`` reads the slots
  on the host and drops the ``-1`` ones (an index gather of the step's K/V: eager steps
  only). ``"device"``: ``prepare`` redirects them in place to rows of the plan's
  ``null_block`` with one device op, and the write takes every token of the step, so a
  graph task re-issues it on the same tensors every step. The op also documents the
  slots of one call as unique ("accuracy is not guaranteed if duplicate values
  exist"), and the null block has ``block_size`` rows, while a step may hold more
  padding tokens than that (a FULL graph of more than 128 tokens; under decode context
  parallelism about half of a prefill's tokens are another rank's). So padding token
  ``t`` goes to null row ``t % block_size`` and the write is issued as one call per
  ``block_size`` tokens (``write_chunks``): within a call every padding row is
  distinct, and calls after it may overwrite a null row, which no request reads. A
  step of ``n`` tokens costs ``ceil(n / block_size)`` scatter calls per layer under
  ``"device"`` handling (one under ``"host"``).
- Every paged state (prefill with or without a cache hit, chunked prefill, decode,
  speculative decode): ``torch_npu.npu_fused_infer_attention_score.out`` in ``TND``
  layout with ``block_table`` (block size 128), cumulative query ends
  (``plan.actual_seq_lengths_q``) and per-request KV lengths (``plan.seq_lens_host``).
  Causal attention uses ``sparse_mode=3`` (bottom-right causal) with the shared
  2048x2048 bool mask (``True`` above the diagonal = masked); a sliding window ``W``
  uses ``sparse_mode=4`` (band) with ``pre_tokens=W - 1, next_tokens=0`` and the
  same mask; non-causal attention over a cache uses ``sparse_mode=0`` without a
  mask. The ``.out`` form writes into the caller's ``out`` so that a graph task
  update re-issues the op into the same buffer; its workspace comes from
  ``_npu_fused_infer_attention_score_get_max_workspace`` once per call shape.
- Attention without a cache (encoder, or a prefill run before caches exist):
  ``torch_npu.npu_fusion_attention`` in ``TND`` layout with cumulative
  ``actual_seq_qlen`` / ``actual_seq_kvlen``; a training op, not graph-capturable.
- The log-sum-exp (``run(..., lse=)``, context parallelism): the paged call passes
  ``softmax_lse_flag=True`` and writes ``softmax_lse`` straight into the caller's
  ``lse`` viewed as ``[T, N, 1]`` float32 (the shape torch_npu documents for
  ``TND``; ``[1]`` when the flag is off), natural log (``log(sum(exp(s - max))) +
  max``). The no-cache call returns ``softmax_max`` and ``softmax_sum``
  (``[T, N, 8]`` in ``TND``, the 8 lanes equal): ``lse = max + log(sum)`` of lane 0.
  Known gap: what the fused op writes for a request with ``actual_seq_lengths_kv``
  0 (a DCP rank holding none of its context) is not documented; ``run`` promises
  ``-inf`` and zeros, which the stand-in models and hardware may not do.

Inputs: query, key, value and out rows must be contiguous (``contiguous_inputs``), as
the fused ops read them; the provider refuses others with ``ValueError`` rather than
copy them inside ``write_kv`` / ``attend``, where a graph task would hold the copy and
re-run it outside the graph on a task update. The caller copies first.

Unsupported here, refused with ``ValueError`` in ``prepare`` (once per step):
``logits_soft_cap`` (the fused op has no soft cap; a silent fallback would hide a
slow path), block sizes other than 128 (paged mode of the fused op takes
multiples of 128 only), more than 256 heads or more than 64 query heads per KV
head (the fused op's limits) and a sliding window on non-causal attention. ``float32``
is refused with ``TypeError`` (the fused op takes float16 / bfloat16).

Head sizes: ``ASCEND_HEAD_SIZES`` (see the comment there for what the documentation
states); ``plan`` refuses others. Known gap: the same documentation's section on
``TND`` layouts says that without ``query_rope`` a ``TND`` call takes only D = 192
(bfloat16, no page attention), which contradicts the paged ``TND`` calls that
other Ascend backends make at other head sizes; which reading holds is
unverified until run on hardware.

Known gap in the documentation: for single-token queries the op documents
``pre_tokens`` as inert (incremental branch); whether a ``TND`` call whose requests
all have one query token takes that branch is not documented, so sliding-window
decode is unverified until run on hardware.

8-bit caches (``kv_cache_dtypes``): ``int8_per_token_head`` only, the one vLLM kind the
fused op documents (torch_npu 2.14, Atlas A2/A3: int8 / int4 keys and values; the fp8
kinds are not documented there and ``plan`` refuses them, naming what this provider
takes). Its scales are float32 ``[num_blocks, block_size, num_kv_heads]`` laid out
head-major (strides ``(num_kv_heads * block_size, 1, block_size)``), so that their
``permute(0, 2, 1)`` is the contiguous ``(blocknum, N, blocksize)`` tensor of the op's
``key_antiquant_mode=5`` ("per token and head, scales managed by page attention");
other layouts are refused before anything is written.

- KV write: the rows are quantized as vLLM defines the kind
  (``npu_attention.kv_quant.quantize_per_token_head``: torch ops; ``npu_quantize`` and
  ``npu_dynamic_quant`` return new tensors, which a captured task cannot re-issue, and
  round half to even where vLLM rounds half away from zero), the int8 rows go through
  ``npu_scatter_pa_kv_cache`` (int8 is a documented dtype) and the scales are put beside
  them in the same step. The quantization is device work that a task update would run
  eagerly: a graph keeps the write out of the attention's task group (vllm-ascend's
  graphs do the same), and only the fused op is re-issued.
- Decode (every request one query token): ``npu_fused_infer_attention_score.out`` in
  ``BNSD`` with the query as ``[B, N, 1, D]`` (the IncreFlashAttention branch, whose
  page attention takes int8 keys and values), the int8 caches as ``(blocknum, blocksize,
  H)``, ``key_antiquant_scale`` / ``value_antiquant_scale`` the head-major scales,
  ``key_antiquant_mode=value_antiquant_mode=5``, per-request ``actual_seq_lengths_kv``,
  no mask; the log-sum-exp lands in ``lse`` viewed as ``[B, N, 1, 1]``. The scales are
  static arguments of the task: an update re-issues the call with the same tensors and
  the next step's lengths.
- Every other state: the documentation's prompt branch (more than one query token)
  takes no antiquant with page attention, so the pages the step's block table names
  are dequantized into a dense ``spec.dtype`` copy (torch ops, eager steps only) and
  the paged ``TND`` call above reads that copy. A prefill without cached context given
  its own keys and values attends over those rows unquantized
  (``npu_fusion_attention``), as ``run`` documents.
- A sliding window is refused with the quantized kind: the single-token branch
  ignores ``pre_tokens``.

torch_npu is imported only when this provider is used, and looked up at call
time, so a stand-in module in ``sys.modules`` can answer the calls.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, ClassVar

import torch

from npu_attention import kv_quant
from npu_attention.kv_quant import KVScales, ScaleKind
from npu_attention.plan import AttentionPlan
from npu_attention.providers.base import AttentionProvider
from npu_attention.spec import AttentionSpec

ASCEND_BLOCK_SIZE = 128
CAUSAL_MASK_SIZE = 2048
SPARSE_NONE = 0  # defaultMask without a mask: nothing masked
SPARSE_CAUSAL = 3  # rightDownCausal: bottom-right aligned causal, 2048 mask
SPARSE_BAND = 4  # band: pre_tokens / next_tokens around the bottom-right diagonal
MAX_TOKENS = 2147483647  # the ops' default for pre_tokens / next_tokens
ASCEND_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEADS = 256  # fused attention: N <= 256
MAX_QUERIES_PER_KV = 64  # fused attention: num_heads / num_key_value_heads <= 64
# Head sizes (D). torch_npu's documentation of npu_fused_infer_attention_score
# (op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md) states: with
# more than one query token (PromptFlashAttention branch) D <= 512 and, for float16 /
# bfloat16 inputs, D a multiple of 16 (a D that is not 32-byte aligned only up to
# 128); with one query token (IncreFlashAttention branch) D <= 512. The no-cache op,
# npu_fusion_attention, documents D as a multiple of 16 up to 512. We take the sizes
# vLLM's models use that meet all of these (every one is a multiple of 16, <= 256)
# and nothing larger: none of them has run on hardware (see the module doc).
ASCEND_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# Paged KV as (blocknum, blocksize, H): the op refuses KV_N * D > 65535.
MAX_KV_HIDDEN = 65535
# The kinds the fused op documents (int8 keys and values, Atlas A2/A3), and its
# antiquant mode for scales per token and head managed by page attention.
ASCEND_KV_CACHE_DTYPES = ("auto", "int8_per_token_head")
ANTIQUANT_PER_TOKEN_HEAD_PAGED = 5


def torch_npu_module() -> ModuleType:
    """The ``torch_npu`` module, from ``sys.modules`` when already imported."""
    module = sys.modules.get("torch_npu")
    return module if module is not None else importlib.import_module("torch_npu")


@dataclass
class AscendStepData:
    """Per-step arguments of the torch_npu calls, built once by ``prepare``.

    Host lists are what the fused ops take as ``SymInt[]``.
    """

    num_actual_tokens: int
    actual_seq_lengths: list[int]  # cumulative query ends, [num_reqs]
    actual_seq_lengths_kv: list[int]  # per-request KV lengths, [num_reqs]
    sparse_mode: int
    pre_tokens: int
    next_tokens: int
    atten_mask: torch.Tensor | None  # bool [2048, 2048], shared
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # [num_written], slots >= 0
    written_tokens: torch.Tensor | None  # int64 [num_written]; None: the first num_written


class AscendProvider(AttentionProvider):
    """torch_npu kernels for Ascend NPUs (unverified on hardware, see module doc).

    Caches must be contiguous ``[num_blocks, block_size, kv_heads, head_size]``
    tensors (the fused op reads them as ``(blocknum, blocksize, H)``); query, key,
    value and out rows contiguous too. Padding slots follow the plan's
    ``slot_handling`` (see the module doc).
    """

    name: ClassVar[str] = "ascend"
    device_types: ClassVar[tuple[str, ...]] = ("npu",)
    head_sizes: ClassVar[tuple[int, ...]] = ASCEND_HEAD_SIZES
    returns_lse: ClassVar[bool] = True  # softmax_lse_flag / softmax_max + softmax_sum
    contiguous_inputs: ClassVar[bool] = True
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ASCEND_KV_CACHE_DTYPES
    # The quantizing write is device work a task update cannot re-issue: graphs issue it
    # before the attention's task group (module doc).
    quantized_write_outside_task: ClassVar[bool] = True
    # Steps of several query tokens read a dequantized copy of their pages (module doc).
    quantized_verify_in_graphs: ClassVar[bool] = False

    def __init__(self) -> None:
        self._masks: dict[torch.device, torch.Tensor] = {}
        # Workspace of the fused op per call shape, and its unused lse output per
        # device: allocated on first use, so a graph task update re-issues one op.
        self._workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
        self._lse: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def is_available(cls) -> bool:
        try:
            torch_npu_module()
        except Exception:  # torch_npu absent, or present without CANN libraries
            return False
        return True

    def prepare(self, plan: AttentionPlan) -> AscendStepData:
        """Validate the spec for torch_npu and build the step's host arguments."""
        check_spec(plan.spec)
        spec = plan.spec
        n = plan.num_actual_tokens
        sparse_mode, pre_tokens, next_tokens = sparse_arguments(spec)
        mask = self._causal_mask(plan.device) if spec.causal else None
        slots, written_tokens = written_slots(plan, n)
        return AscendStepData(
            num_actual_tokens=n,
            actual_seq_lengths=list(plan.actual_seq_lengths_q),
            actual_seq_lengths_kv=list(plan.seq_lens_host),
            sparse_mode=sparse_mode,
            pre_tokens=pre_tokens,
            next_tokens=next_tokens,
            atten_mask=mask,
            block_table=plan.block_tables.to(torch.int32),
            slot_mapping=slots,
            written_tokens=written_tokens,
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        *,
        scales: KVScales | None = None,
    ) -> None:
        data = _step_data(plan)
        _check_contiguous(key_cache, value_cache)
        quantized = plan.spec.kv_scales is not ScaleKind.NONE
        if quantized:
            check_head_major_scales(scales, key_cache)
        num_written = data.slot_mapping.shape[0]
        if num_written == 0:
            return
        if data.written_tokens is None:
            key, value = key[:num_written], value[:num_written]
            check_contiguous_rows(key=key, value=value)
        else:  # host slot handling: the written rows gathered (eager steps only)
            key, value = key[data.written_tokens], value[data.written_tokens]
        if quantized:
            key, value = self._quantize_rows(key, value, scales, data.slot_mapping, plan)
        scatter_rows(key, value, key_cache, value_cache, data.slot_mapping, plan)

    @staticmethod
    def _quantize_rows(
        key: torch.Tensor,
        value: torch.Tensor,
        scales: KVScales,
        slots: torch.Tensor,
        plan: AttentionPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 codes of the rows (vLLM's per-token-head definition); their scales are put
        at the rows' slots of ``scales`` in the same step."""
        block_size = plan.spec.block_size
        where = (torch.div(slots, block_size, rounding_mode="floor"), slots % block_size)
        codes = []
        for rows, scale_cache in ((key, scales.k), (value, scales.v)):
            row_codes, row_scales = kv_quant.quantize_per_token_head(rows, torch.int8)
            scale_cache.index_put_(where, row_scales)
            codes.append(row_codes)
        return codes[0], codes[1]

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor | None,
        value_cache: torch.Tensor | None,
        plan: AttentionPlan,
        out: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        lse: torch.Tensor | None = None,
        scales: KVScales | None = None,
    ) -> None:
        data = _step_data(plan)
        quantized = plan.spec.kv_scales is not ScaleKind.NONE
        if key_cache is None or value_cache is None:
            if key is None or value is None:
                raise ValueError(
                    "attend without caches needs key and value, got "
                    f"key={_kind(key)}, value={_kind(value)}"
                )
            self._attend_no_cache(query, key, value, plan, data, out, lse)
            return
        _check_contiguous(key_cache, value_cache)
        if not quantized:
            self._attend_paged(query, key_cache, value_cache, plan, data, out, lse)
            return
        check_head_major_scales(scales, key_cache)
        if key is not None and value is not None and not plan.has_context:
            self._attend_no_cache(query, key, value, plan, data, out, lse)  # own rows
        elif _one_token_each(data):
            self._attend_quantized_decode(
                query, key_cache, value_cache, scales, plan, data, out, lse
            )
        else:
            key_pages, value_pages, table = dequantized_pages(
                key_cache, value_cache, scales, data.block_table, plan.spec.dtype
            )
            dense = replace(data, block_table=table)
            self._attend_paged(query, key_pages, value_pages, plan, dense, out, lse)

    def _attend_quantized_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scales: KVScales,
        plan: AttentionPlan,
        data: AscendStepData,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """One query token per request over the int8 pages: ``BNSD`` ``[B, N, 1, D]``, the
        op's own dequantization (antiquant mode 5, head-major scales)."""
        npu = torch_npu_module()
        spec = plan.spec
        n = data.num_actual_tokens
        num_blocks, block_size = key_cache.shape[:2]
        kwargs: dict[str, Any] = dict(
            actual_seq_lengths_kv=data.actual_seq_lengths_kv,
            key_antiquant_scale=scales.k.permute(0, 2, 1),
            value_antiquant_scale=scales.v.permute(0, 2, 1),
            block_table=data.block_table,
            num_heads=spec.num_heads,
            scale=spec.softmax_scale,
            input_layout="BNSD",
            num_key_value_heads=spec.num_kv_heads,
            sparse_mode=SPARSE_NONE,
            block_size=block_size,
            key_antiquant_mode=ANTIQUANT_PER_TOKEN_HEAD_PAGED,
            value_antiquant_mode=ANTIQUANT_PER_TOKEN_HEAD_PAGED,
            softmax_lse_flag=lse is not None,
        )
        check_contiguous_rows(query=query[:n], out=out[:n])
        q = query[:n].unsqueeze(2)
        k = key_cache.view(num_blocks, block_size, -1)
        v = value_cache.view(num_blocks, block_size, -1)
        shape_key = ("bnsd", q.shape, k.shape, data.block_table.shape, q.dtype, q.device, spec, lse is not None)  # fmt: skip
        workspace = self._workspaces.get(shape_key)
        if workspace is None:
            workspace = npu._npu_fused_infer_attention_score_get_max_workspace(q, k, v, **kwargs)
            self._workspaces[shape_key] = workspace
        if lse is None:
            softmax_lse = self._unused_lse(q.device)
        else:  # BNSD: [B, N, Q_S, 1] float32, a view of the caller's rows
            softmax_lse = lse[:n].view(n, spec.num_heads, 1, 1)
            check_contiguous_rows(lse=softmax_lse)
        npu.npu_fused_infer_attention_score.out(
            q, k, v, **kwargs, workspace=workspace, out=[out[:n].unsqueeze(2), softmax_lse]
        )

    def _unused_lse(self, device: torch.device) -> torch.Tensor:
        """The ``[1]`` float32 lse output the op takes with the flag off, one per device."""
        softmax_lse = self._lse.get(device)
        if softmax_lse is None:
            softmax_lse = self._lse[device] = torch.empty(1, dtype=torch.float32, device=device)
        return softmax_lse

    def _attend_paged(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        data: AscendStepData,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        npu = torch_npu_module()
        spec = plan.spec
        n = data.num_actual_tokens
        num_blocks, block_size = key_cache.shape[:2]
        kwargs: dict[str, Any] = dict(
            atten_mask=data.atten_mask,
            actual_seq_lengths=data.actual_seq_lengths,
            actual_seq_lengths_kv=data.actual_seq_lengths_kv,
            block_table=data.block_table,
            num_heads=spec.num_heads,
            scale=spec.softmax_scale,
            pre_tokens=data.pre_tokens,
            next_tokens=data.next_tokens,
            input_layout="TND",
            num_key_value_heads=spec.num_kv_heads,
            sparse_mode=data.sparse_mode,
            block_size=block_size,
            softmax_lse_flag=lse is not None,
        )
        q = query[:n]
        check_contiguous_rows(query=q, out=out[:n])
        k = key_cache.view(num_blocks, block_size, -1)
        v = value_cache.view(num_blocks, block_size, -1)
        shape_key = (
            q.shape, k.shape, data.block_table.shape, q.dtype, q.device, spec, lse is not None
        )  # fmt: skip
        workspace = self._workspaces.get(shape_key)
        if workspace is None:
            workspace = npu._npu_fused_infer_attention_score_get_max_workspace(q, k, v, **kwargs)
            self._workspaces[shape_key] = workspace
        if lse is None:  # the op still takes an lse output: [1] with the flag off
            softmax_lse = self._unused_lse(q.device)
        else:  # TND: [T, N, 1] float32, a view of the caller's rows
            softmax_lse = lse[:n].unsqueeze(-1)
            check_contiguous_rows(lse=softmax_lse)
        npu.npu_fused_infer_attention_score.out(
            q, k, v, **kwargs, workspace=workspace, out=[out[:n], softmax_lse]
        )

    def _attend_no_cache(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: AttentionPlan,
        data: AscendStepData,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        spec = plan.spec
        n = data.num_actual_tokens
        check_contiguous_rows(query=query[:n], key=key[:n], value=value[:n])
        result = torch_npu_module().npu_fusion_attention(
            query[:n],
            key[:n],
            value[:n],
            spec.num_heads,
            "TND",
            atten_mask=data.atten_mask,
            scale=spec.softmax_scale,
            keep_prob=1.0,
            pre_tockens=data.pre_tokens,
            next_tockens=data.next_tokens,
            actual_seq_qlen=data.actual_seq_lengths,
            actual_seq_kvlen=data.actual_seq_lengths,
            sparse_mode=data.sparse_mode,
        )
        out[:n].copy_(result[0])
        if lse is not None:  # softmax_max, softmax_sum: [T, N, 8], lanes equal
            torch.add(result[1][..., 0], torch.log(result[2][..., 0]), out=lse[:n])

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        """The shared 2048x2048 bool mask, ``True`` strictly above the diagonal."""
        mask = self._masks.get(device)
        if mask is None:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
            mask = self._masks[device] = torch.triu(ones, diagonal=1)
        return mask


def sparse_arguments(spec: AttentionSpec) -> tuple[int, int, int]:
    """``(sparse_mode, pre_tokens, next_tokens)`` of the fused ops for ``spec``.

    Causal: bottom-right causal (3). A window of ``W`` keys, the query's own
    included: band (4) with ``W - 1`` tokens before the diagonal and none after.
    Non-causal: no mask (0).
    """
    if not spec.causal:
        return SPARSE_NONE, MAX_TOKENS, MAX_TOKENS
    if spec.sliding_window is None:
        return SPARSE_CAUSAL, MAX_TOKENS, 0
    return SPARSE_BAND, spec.sliding_window - 1, 0


def check_spec(spec: AttentionSpec) -> None:
    """Raise if ``spec`` asks for something the torch_npu ops cannot do."""
    if spec.logits_soft_cap is not None:
        raise ValueError(
            "the ascend provider does not support logits_soft_cap (the fused attention "
            f"op has no soft cap), got logits_soft_cap={spec.logits_soft_cap}"
        )
    if spec.block_size != ASCEND_BLOCK_SIZE:
        raise ValueError(
            f"the ascend provider needs block_size={ASCEND_BLOCK_SIZE} (paged fused "
            f"attention takes multiples of 128), got block_size={spec.block_size}"
        )
    if spec.dtype not in ASCEND_DTYPES:
        raise TypeError(f"the ascend provider needs dtype in {ASCEND_DTYPES}, got {spec.dtype}")
    if spec.num_heads > MAX_HEADS or spec.num_queries_per_kv > MAX_QUERIES_PER_KV:
        raise ValueError(
            f"the ascend provider needs num_heads <= {MAX_HEADS} and num_heads / num_kv_heads "
            f"<= {MAX_QUERIES_PER_KV} (fused attention limits), got num_heads={spec.num_heads}, "
            f"num_kv_heads={spec.num_kv_heads}"
        )
    if spec.num_kv_heads * spec.head_size > MAX_KV_HIDDEN:
        raise ValueError(
            f"the ascend provider reads caches as (blocks, block_size, kv_heads * head_size) "
            f"and the fused op takes kv_heads * head_size <= {MAX_KV_HIDDEN}, got "
            f"num_kv_heads={spec.num_kv_heads}, head_size={spec.head_size}"
        )
    if spec.sliding_window is not None and spec.kv_scales is not ScaleKind.NONE:
        raise ValueError(
            "the ascend provider reads an 8-bit cache through the fused op's single-token "
            "branch, which ignores pre_tokens: sliding_window needs kv_cache_dtype='auto', got "
            f"sliding_window={spec.sliding_window} with kv_cache_dtype={spec.kv_cache_dtype!r}"
        )
    if spec.sliding_window is not None and not spec.causal:
        raise ValueError(
            "the ascend provider supports sliding_window only with causal attention, "
            f"got sliding_window={spec.sliding_window} with causal=False"
        )


def written_slots(plan: AttentionPlan, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots the KV write of the first ``num_tokens`` tokens gets, and which tokens
    they belong to (None: all ``num_tokens``), as ``plan.slot_handling`` says.

    ``"host"``: the slots are read on the host and ``-1`` entries dropped. ``"device"``:
    ``-1`` entries are redirected in place to rows of ``plan.null_block`` (padding token
    ``t`` to row ``t % block_size``, distinct within each call of ``write_chunks``), by
    one device op that reads nothing back.
    """
    slots = plan.slot_mapping[:num_tokens]
    if plan.slot_handling == "device":
        block_size = plan.spec.block_size
        rows = torch.arange(num_tokens, device=slots.device) % block_size
        null_rows = rows + plan.null_block * block_size
        torch.where(slots < 0, null_rows, slots, out=slots)
        return slots, None
    valid = slots.cpu() >= 0
    if bool(valid.all()):
        return slots, None
    tokens = torch.nonzero(valid).flatten().to(slots.device)
    return slots[tokens], tokens


def write_chunks(num_written: int, plan: AttentionPlan) -> list[slice]:
    """The token ranges of the step's ``npu_scatter_pa_kv_cache`` calls.

    ``"device"`` slot handling sends padding token ``t`` to null row ``t % block_size``
    (``written_slots``), so a call of at most ``block_size`` consecutive tokens names
    each slot once, as the op documents; ``"host"`` handling writes no padding row, so
    one call takes every written token.
    """
    if plan.slot_handling != "device":
        return [slice(0, num_written)]
    size = plan.spec.block_size
    return [slice(start, min(start + size, num_written)) for start in range(0, num_written, size)]


def scatter_rows(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    plan: AttentionPlan,
) -> None:
    """Write ``key`` / ``value`` ``[num_written, N, D]`` (contiguous) at ``slots``
    ``[num_written]`` through ``npu_scatter_pa_kv_cache`` (``cache_mode="Norm"``), one
    call per range of ``write_chunks``; the ranges are views, so a task update re-issues
    the same calls on the same tensors."""
    for rows in write_chunks(slots.shape[0], plan):
        torch_npu_module().npu_scatter_pa_kv_cache(
            key[rows], value[rows], key_cache, value_cache, slots[rows], cache_mode="Norm"
        )


def check_contiguous_rows(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming each tensor the fused ops cannot read as it is."""
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(
                f"the ascend provider needs a contiguous {name} (it does not copy inside a "
                f"graph task; make the rows contiguous before run), got strides "
                f"{tensor.stride()} for shape {tuple(tensor.shape)}"
            )


def check_head_major_scales(scales: KVScales | None, key_cache: torch.Tensor) -> None:
    """Raise ``ValueError`` unless both scales are float32 ``[num_blocks, block_size,
    num_kv_heads]`` laid out head-major, the ``(blocknum, N, blocksize)`` contiguous
    tensor antiquant mode 5 reads, seen through ``permute(0, 2, 1)``."""
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    shape = (num_blocks, block_size, num_kv_heads)
    strides = (num_kv_heads * block_size, 1, block_size)
    if scales is None:
        raise ValueError(
            f"an int8 cache needs scales: float32 {list(shape)} with strides {strides}, got none"
        )
    for name, scale in (("k_scale", scales.k), ("v_scale", scales.v)):
        fits = tuple(scale.shape) == shape and (
            scale.stride() == strides or scale.permute(0, 2, 1).is_contiguous()
        )
        if not fits or scale.dtype != torch.float32:
            raise ValueError(
                f"the ascend provider reads {name} as the fused op's (blocknum, N, blocksize) "
                f"scales: expected float32 {list(shape)} with strides {strides} (head-major), "
                f"got {scale.dtype} {list(scale.shape)} with strides {scale.stride()}"
            )


def dequantized_pages(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scales: KVScales,
    block_table: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pages ``block_table`` names, dequantized into a dense ``dtype`` paged copy
    ``[num_reqs * max_blocks, block_size, num_kv_heads, head_size]``, and the int32 block
    table over that copy (request ``r``'s pages at rows ``r * max_blocks ...``)."""
    num_reqs, max_blocks = block_table.shape
    blocks = block_table.reshape(-1).long()
    pages = []
    for cache, scale in ((key_cache, scales.k), (value_cache, scales.v)):
        codes = cache.index_select(0, blocks)
        pages.append(
            kv_quant.dequantize(codes, scale.index_select(0, blocks).unsqueeze(-1)).to(dtype)
        )
    table = torch.arange(num_reqs * max_blocks, dtype=torch.int32, device=block_table.device)
    return pages[0], pages[1], table.view(num_reqs, max_blocks)


def _one_token_each(data: AscendStepData) -> bool:
    ends = data.actual_seq_lengths
    return all(end - start == 1 for start, end in zip([0, *ends[:-1]], ends))


def _step_data(plan: AttentionPlan) -> AscendStepData:
    data = plan.provider_data
    if not isinstance(data, AscendStepData):
        raise ValueError(
            "plan was not prepared by the ascend provider: expected AscendStepData in "
            f"plan.provider_data, got {type(data).__name__}"
        )
    return data


def _check_contiguous(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not cache.is_contiguous():
            raise ValueError(
                f"the ascend provider needs a contiguous {name} [num_blocks, block_size, "
                f"kv_heads, head_size], got strides {cache.stride()} for shape {tuple(cache.shape)}"
            )


def _kind(tensor: torch.Tensor | None) -> str:
    return "None" if tensor is None else f"Tensor{tuple(tensor.shape)}"
