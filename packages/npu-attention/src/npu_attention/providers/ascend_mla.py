"""Ascend NPU MLA kernels through torch_npu's fused attention operators.

Written against torch_npu's published API (operator schemas of torch_npu 2.14.0,
op-plugin documentation of ``npu_fused_infer_attention_score_v2``, the ATB operator
declarations ``AtbOpsInterface.h`` and the schemas ``libop_plugin_atb.so`` registers
for ``torch_npu.atb.npu_multi_head_latent_attention``) and schema-checked in CI
with a stand-in ``torch_npu`` on CPU tensors (``tests-conformance/``). No machine
this package is developed on has an Ascend NPU: this provider has not run on
hardware.

Operators, one per job:

- Latent write: ``torch_npu.npu_scatter_pa_kv_cache(kv_c, k_pe, kv_c_cache, k_pe_cache,
  slot_mapping, cache_mode="Norm")``, ``kv_c`` / ``k_pe`` as ``[tokens, 1, L]`` /
  ``[tokens, 1, R]`` into ``[blocks, block_size, 1, L]`` / ``[..., 1, R]`` views of the
  planes (the op documents different key and value head sizes in this form).
  Padding slots never reach it, as in the attention provider (``ascend.py``), and under
  ``"device"`` slot handling it is issued once per ``block_size`` tokens, so that no call
  names a null-block row twice (``ascend.write_chunks``).
- Decode (absorbed, speculative tokens too): ``npu_fused_infer_attention_score_v2.out``
  in ``TND`` layout with ``query = q_latent`` (D = 512), ``query_rope = q_rope``,
  ``key = value = kv_c`` plane and ``key_rope = k_pe`` plane as paged
  ``(blocknum, blocksize, H)`` caches, ``num_key_value_heads=1``, ``block_table``,
  cumulative ``actual_seq_qlen`` and per-request ``actual_seq_kvlen``. One query
  token per request: ``sparse_mode=0`` without a mask; several (speculative
  decoding): ``sparse_mode=3`` with the 2048x2048 mask (bottom-right causal). The
  ``.out`` form writes into a fixed buffer with a workspace from
  ``_npu_fused_infer_attention_score_v2_get_max_workspace``, so a graph task update
  re-issues the same op with new host lists.
- Decode with the log-sum-exp (``decode(..., lse=)``, what decode context
  parallelism merges by; one query token per request): the v2 op documents no
  LSE with a query D of 512 and ``query_rope``, so this path calls ATB's
  MultiLatentAttention, ``torch_npu.atb.npu_multi_head_latent_attention(q_nope,
  q_rope, ctkv, k_rope, block_tables, context_lens, head_num, qk_scale, kv_headnum,
  return_lse=True, calc_type="calc_type_ring", workspace=, output=, lse=)`` (the
  ``lse_out`` overload), ``ctkv`` / ``k_rope`` the planes viewed ``[blocks,
  block_size, 1, 512 / 64]``, ``block_tables`` int32, ``context_lens`` the
  per-request KV lengths as a host list (the step argument a task update
  re-issues), ``output`` ``[T, N, 512]`` and ``lse`` ``[T, N, 1]`` in the query dtype,
  into fixed scratch buffers with a workspace from
  ``torch_npu.atb._npu_multi_head_latent_attention_get_workspace(..., return_lse=True,
  calc_type="calc_type_ring")``. The first nine arguments go by position: the
  header names the head count ``head_num``, the registered schema ``q_headnum``.
  The rows are then copied out, the LSE converted to float32, and rows of requests
  of KV length 0 set to zeros and ``-inf`` (from ``plan.seq_lens`` on the device):
  ``finish_decode``'s work, not ``decode``'s, so that a graph task holds the ATB call
  alone and a task update re-issues only it (the finish runs after the task, inside
  the graph). Without ``lse`` the decode stays on the v2 op above.
- Prefill (non-absorbed): the prefill requests' latent rows (context and new
  tokens) are gathered from the planes with index ops, decompressed by the
  caller's ``kv_up_proj``, and attended by ``npu_fused_infer_attention_score_v2`` in
  ``TND`` without paging: ``query = q_nope``, ``query_rope = q_pe``, ``key = k_nope``,
  ``key_rope = k_pe`` (broadcast over heads), ``value = v``, cumulative
  ``actual_seq_qlen`` / ``actual_seq_kvlen``, ``sparse_mode=3`` with the mask.

What the documentation of ``npu_fused_infer_attention_score_v2`` (op-plugin
``docs/context/torch_npu-npu_fused_infer_attention_score_v2.md``) allows, and hence
what ``check_spec`` refuses with ``ValueError`` / ``TypeError``:

- with ``query_rope`` and a query D of 512: query N of 32, 64 or 128 (fewer heads
  are zero-padded up to the next of these and the extra rows dropped), key N 1,
  rope D 64, page attention required with block size 16 or 128, 1 to 16 query
  tokens per request, no softmax LSE (hence the ATB call above); so
  ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, ``num_heads <= 128``, ``block_size``
  16 or 128, ``num_speculative_tokens <= 15``;
- with ``query_rope`` and a query D of 128 (``TND``, no page attention): Q, K and V
  D all 128, bfloat16 only; so ``qk_nope_head_dim = v_head_dim = 128``, and float16
  prefills are computed in bfloat16 (as vllm-ascend does);
- inputs must be contiguous: the planes must come from ``latent_cache_planes`` /
  ``allocate_latent_cache``, not views of an interleaved cache.

What the documentation of the ATB operation (torch_npu's docstring of
``torch_npu.atb.npu_multi_head_latent_attention`` in ``_atb_api_docs.py``; CANN ATB
``MultiLatentAttentionOperation``; op-plugin ``MultiHeadLatentAttentionAtb.cpp``)
allows, and hence what the LSE path refuses with ``ValueError``: ``headNum`` 8, 16,
32, 64 or 128 (fewer heads are zero-padded up to the next of these), ``kvHeadNum``
1, ``qkScale`` in (0, 1], query D 512 + rope 64 (``cache_mode`` ``krope_ctkv``,
op-plugin's default), block size <= 128, batch <= 8192, and with ``CALC_TYPE_RING``
("ringAttention, additionally outputs lse") only ``maskType`` UNDEFINED, hence one
query token per request (several need ``calc_type_spec``, which gives no LSE; ATB's
``CALC_TYPE_SPEC_AND_RING`` is not among the ``calc_type`` values op-plugin maps); the
LSE is ``[num_tokens, num_heads, 1]``, float16/bf16 by ATB's table (op-plugin
allocates it in the query dtype; torch_npu's docstring also lists float). The ATB
operators need CANN's NNAL package (``libatb.so``) at run time.

Known gaps of the LSE path, unverified until run on hardware: the documentation
states no log base for the LSE (natural log assumed, as in torch_npu's other
softmax LSE outputs); an LSE in bfloat16 carries about 3 significant digits, so
merging ranks by it weights them less exactly than a float32 LSE would; what the
op writes for a request of ``context_lens`` 0 is undocumented (vllm-ascend passes
0 for padding and overwrites those rows, as this provider does).

Known gaps in the documentation, unverified until run on hardware: with a query
D other than 512 and ``sparse_mode=3`` it asks each request's ``actual_seq_qlen <
actual_seq_kvlen``, which a prefill without cached context (equal lengths) does not
meet, though vllm-ascend makes that call; and it documents ``TND`` paged decode
with ``actual_seq_kvlen`` 0 only implicitly (vllm-ascend pads graph batches so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from npu_attention.mla.cache import LatentCache
from npu_attention.mla.run import KVUpProjection, up_projected_heads
from npu_attention.mla.spec import MLASpec
from npu_attention.plan import AttentionPlan
from npu_attention.providers.ascend import (
    ASCEND_DTYPES,
    CAUSAL_MASK_SIZE,
    SPARSE_CAUSAL,
    SPARSE_NONE,
    check_contiguous_rows,
    scatter_rows,
    torch_npu_module,
    written_slots,
)
from npu_attention.providers.mla_base import MLAProvider, require_cache

MLA_LATENT = 512  # query D of the absorbed (paged) call
MLA_ROPE = 64  # query_rope / key_rope D
MLA_QUERY_HEADS = (32, 64, 128)  # query N the absorbed call takes
MLA_BLOCK_SIZES = (16, 128)  # page attention with query_rope (ND caches)
MLA_MAX_QUERY_TOKENS = 16  # query tokens per request with query_rope
MLA_PREFILL_HEAD_DIM = 128  # Q/K/V D of the non-paged call with query_rope
MLA_PREFILL_DTYPE = torch.bfloat16  # the non-paged TND call takes bfloat16 only
ATB_MLA_HEADS = (8, 16, 32, 64, 128)  # headNum of ATB's MultiLatentAttention
ATB_MLA_MAX_BATCH = 8192
ATB_MLA_CALC_TYPE = "calc_type_ring"  # the calc type that outputs the LSE


@dataclass
class AscendMLAStepData:
    """Per-step arguments of the torch_npu calls, built once by ``prepare``."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_written], slots >= 0
    written_tokens: torch.Tensor | None  # int64 [num_written]; None: the first num_written
    atten_mask: torch.Tensor  # bool [2048, 2048], True above the diagonal
    # decode: paged, absorbed
    decode_seq_qlen: list[int]  # cumulative query ends of the decode requests
    decode_seq_kvlen: list[int]  # their KV lengths
    decode_sparse_mode: int
    decode_block_table: torch.Tensor  # int32 [num_decodes, max_blocks]
    # prefill: gathered, decompressed
    prefill_seq_qlen: list[int]  # cumulative query ends of the prefill requests
    prefill_seq_kvlen: list[int]  # cumulative ends of their full sequences
    prefill_blocks: torch.Tensor | None  # int64 [sum of prefill seq_lens]
    prefill_offsets: torch.Tensor | None  # int64, row in the block


class AscendMLAProvider(MLAProvider):
    """torch_npu MLA kernels for Ascend NPUs (unverified on hardware, see module doc)."""

    name: ClassVar[str] = "ascend"
    device_types: ClassVar[tuple[str, ...]] = ("npu",)
    returns_lse: ClassVar[bool] = True  # through ATB's MultiLatentAttention (module doc)
    contiguous_inputs: ClassVar[bool] = True

    def __init__(self) -> None:
        self._masks: dict[torch.device, torch.Tensor] = {}
        self._workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
        self._lse: dict[torch.device, torch.Tensor] = {}
        # Fixed output buffers of the decode calls, by (call, shape, dtype, device): the
        # ATB call's output and LSE, the v2 op's output where the caller's rows are not
        # whole [T, 32/64/128, 512] rows. decode writes them, finish_decode reads them.
        self._scratch: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}

    @classmethod
    def is_available(cls) -> bool:
        try:
            torch_npu_module()
        except Exception:  # torch_npu absent, or present without CANN libraries
            return False
        return True

    def check_spec(self, spec: MLASpec) -> None:
        check_mla_spec(spec)

    def decode_heads(self, spec: MLASpec, with_lse: bool = False) -> int:
        """The head count the fused op (32, 64, 128) or, with the LSE, ATB's MLA (8, 16,
        32, 64, 128) takes, at or above ``spec.num_heads``."""
        counts = ATB_MLA_HEADS if with_lse else MLA_QUERY_HEADS
        return next(h for h in counts if h >= spec.num_heads)

    def prepare(self, plan: AttentionPlan) -> AscendMLAStepData:
        require_cache(plan)
        n, nd = plan.num_actual_tokens, plan.num_decodes
        slots, written = written_slots(plan, n)
        cu = plan.cu_seqlens_q_host
        blocks, offsets = _prefill_rows(plan)
        prefill_ends = np.cumsum(plan.seq_lens_host[nd:]).tolist()
        return AscendMLAStepData(
            num_actual_tokens=n,
            slot_mapping=slots,
            written_tokens=written,
            atten_mask=self._causal_mask(plan.device),
            decode_seq_qlen=cu[1 : nd + 1],
            decode_seq_kvlen=plan.seq_lens_host[:nd],
            decode_sparse_mode=SPARSE_CAUSAL
            if max(plan.query_lens_host[:nd], default=1) > 1
            else SPARSE_NONE,
            decode_block_table=plan.block_tables[:nd].to(torch.int32),
            prefill_seq_qlen=[end - cu[nd] for end in cu[nd + 1 :]],
            prefill_seq_kvlen=prefill_ends,
            prefill_blocks=blocks,
            prefill_offsets=offsets,
        )

    def write_cache(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, plan: AttentionPlan
    ) -> None:
        data = _step_data(plan)
        _check_planes(cache)
        count = data.slot_mapping.shape[0]
        if count == 0:
            return
        if data.written_tokens is None:
            kv_c, k_pe = kv_c[:count], k_pe[:count]
            check_contiguous_rows(kv_c=kv_c, k_pe=k_pe)
        else:  # host slot handling: the written rows gathered (eager steps only)
            kv_c, k_pe = kv_c[data.written_tokens], k_pe[data.written_tokens]
        num_blocks, block_size = cache.kv_c.shape[:2]
        scatter_rows(
            kv_c.unsqueeze(1),
            k_pe.unsqueeze(1),
            cache.kv_c.view(num_blocks, block_size, 1, -1),
            cache.k_pe.view(num_blocks, block_size, 1, -1),
            data.slot_mapping,
            plan,
        )

    def decode(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        out: torch.Tensor,
        *,
        lse: torch.Tensor | None = None,
    ) -> None:
        if lse is not None:
            self._decode_with_lse(q_latent, q_rope, cache, plan, out, lse)
            return
        npu = torch_npu_module()
        data, spec = _step_data(plan), plan.spec
        _check_planes(cache)
        rows, heads = plan.num_decode_tokens, _padded_heads(spec.num_heads)
        query = _pad_heads(q_latent[:rows], heads)
        query_rope = _pad_heads(q_rope[:rows], heads)
        kwargs: dict[str, Any] = dict(
            query_rope=query_rope,
            key_rope=cache.k_pe,
            atten_mask=data.atten_mask if data.decode_sparse_mode == SPARSE_CAUSAL else None,
            actual_seq_qlen=data.decode_seq_qlen,
            actual_seq_kvlen=data.decode_seq_kvlen,
            block_table=data.decode_block_table,
            num_query_heads=heads,
            num_key_value_heads=1,
            softmax_scale=spec.softmax_scale,
            input_layout="TND",
            sparse_mode=data.decode_sparse_mode,
            block_size=cache.kv_c.shape[1],
        )
        shape_key = (query.shape, cache.kv_c.shape, data.decode_block_table.shape, spec)
        workspace = self._workspaces.get(shape_key)
        if workspace is None:
            workspace = npu._npu_fused_infer_attention_score_v2_get_max_workspace(
                query, cache.kv_c, cache.kv_c, **kwargs
            )
            self._workspaces[shape_key] = workspace
        result = _heads_in_place(out[:rows], heads)
        if result is None:  # copied into out by finish_decode
            (result,) = self._decode_scratch("v2", query.shape, query.dtype, query.device)
        npu.npu_fused_infer_attention_score_v2.out(
            query,
            cache.kv_c,
            cache.kv_c,
            **kwargs,
            workspace=workspace,
            out=[result, self._unused_lse(query.device)],
        )

    def finish_decode(
        self,
        q_latent: torch.Tensor,
        plan: AttentionPlan,
        out: torch.Tensor,
        *,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Copy ``decode``'s rows out of its fixed buffers into ``out`` (and ``lse``, in
        float32), zeros and ``-inf`` for requests of KV length 0; nothing when the fused
        op wrote ``out`` in place."""
        spec, rows = plan.spec, plan.num_decode_tokens
        n, width = spec.num_heads, spec.kv_lora_rank
        if lse is None:
            heads = _padded_heads(n)
            if _heads_in_place(out[:rows], heads) is None:
                shape = (rows, heads, width)
                (result,) = self._decode_scratch("v2", shape, q_latent.dtype, out.device, made=True)
                out[:rows].copy_(result[:, :n])
            return
        shape = (rows, self.decode_heads(spec, with_lse=True), width)
        result, row_lse = self._decode_scratch("lse", shape, q_latent.dtype, out.device, made=True)
        keyed = (plan.seq_lens[:rows] > 0).unsqueeze(1)  # KV length 0: nothing to attend
        out[:rows].copy_(torch.where(keyed.unsqueeze(2), result[:, :n], 0.0))
        lse[:rows].copy_(torch.where(keyed, row_lse[:, :n, 0].float(), float("-inf")))

    def _decode_with_lse(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """One-token decodes through ATB's MultiLatentAttention with ``calc_type_ring``."""
        npu = torch_npu_module()
        data, spec = _step_data(plan), plan.spec
        _check_planes(cache)
        rows = plan.num_decode_tokens
        _check_lse_decode(data, spec, rows)
        heads = next(h for h in ATB_MLA_HEADS if h >= spec.num_heads)
        num_blocks, block_size = cache.kv_c.shape[:2]
        args = (
            _pad_heads(q_latent[:rows], heads),
            _pad_heads(q_rope[:rows], heads),
            cache.kv_c.view(num_blocks, block_size, 1, spec.kv_lora_rank),
            cache.k_pe.view(num_blocks, block_size, 1, spec.qk_rope_head_dim),
            data.decode_block_table,
            data.decode_seq_kvlen,
            heads,
            spec.softmax_scale,
            1,
        )
        kwargs: dict[str, Any] = dict(return_lse=True, calc_type=ATB_MLA_CALC_TYPE)
        query = args[0]
        shape_key = ("lse", query.shape, cache.kv_c.shape, data.decode_block_table.shape, spec)
        workspace = self._workspaces.get(shape_key)
        if workspace is None:
            workspace = npu.atb._npu_multi_head_latent_attention_get_workspace(*args, **kwargs)
            self._workspaces[shape_key] = workspace
        result, row_lse = self._decode_scratch("lse", query.shape, query.dtype, query.device)
        npu.atb.npu_multi_head_latent_attention(
            *args, **kwargs, workspace=workspace, output=result, lse=row_lse
        )

    def prefill(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        kv_up_proj: KVUpProjection,
        out: torch.Tensor,
    ) -> None:
        data, spec = _step_data(plan), plan.spec
        rows, nope = plan.num_prefill_tokens, spec.qk_nope_head_dim
        kv_c = cache.kv_c[data.prefill_blocks, data.prefill_offsets]
        k_pe = cache.k_pe[data.prefill_blocks, data.prefill_offsets]
        k_nope, value = up_projected_heads(kv_up_proj, kv_c, spec)
        heads_rope = k_pe.unsqueeze(1).expand(-1, spec.num_heads, -1)
        inputs = [query[:rows, :, :nope], query[:rows, :, nope:], k_nope, heads_rope, value]
        q_nope, q_pe, key, key_rope, value = (x.to(MLA_PREFILL_DTYPE).contiguous() for x in inputs)
        result, _ = torch_npu_module().npu_fused_infer_attention_score_v2(
            q_nope,
            key,
            value,
            query_rope=q_pe,
            key_rope=key_rope,
            atten_mask=data.atten_mask,
            actual_seq_qlen=data.prefill_seq_qlen,
            actual_seq_kvlen=data.prefill_seq_kvlen,
            num_query_heads=spec.num_heads,
            num_key_value_heads=spec.num_heads,
            softmax_scale=spec.softmax_scale,
            input_layout="TND",
            sparse_mode=SPARSE_CAUSAL,
        )
        out[:rows].copy_(result)

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        mask = self._masks.get(device)
        if mask is None:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
            mask = self._masks[device] = torch.triu(ones, diagonal=1)
        return mask

    def _decode_scratch(
        self,
        call: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        made: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Fixed output buffers of a decode call of query ``shape`` ``[T, N, 512]``:
        ``("v2", ...)``: the v2 op's ``[T, N, 512]``; ``("lse", ...)``: the ATB call's
        ``output`` ``[T, N, 512]`` and ``lse`` ``[T, N, 1]``, all in ``dtype``. With
        ``made``, the buffers a ``decode`` of that shape wrote (``finish_decode``)."""
        key = (call, tuple(shape), dtype, device)
        scratch = self._scratch.get(key)
        if scratch is None:
            if made:
                raise ValueError(
                    "finish_decode of a decode this provider did not run: no "
                    f"{call!r} output of shape {tuple(shape)} {dtype} on {device}"
                )
            output = torch.empty(shape, dtype=dtype, device=device)
            lse = torch.empty(*shape[:2], 1, dtype=dtype, device=device)
            scratch = self._scratch[key] = (output,) if call == "v2" else (output, lse)
        return scratch

    def _unused_lse(self, device: torch.device) -> torch.Tensor:
        lse = self._lse.get(device)
        if lse is None:
            lse = self._lse[device] = torch.empty(1, dtype=torch.float32, device=device)
        return lse


def check_mla_spec(spec: MLASpec) -> None:
    """Raise if ``spec`` asks for something the documented torch_npu MLA calls cannot do."""
    if spec.dtype not in ASCEND_DTYPES:
        raise TypeError(f"the ascend MLA provider needs dtype in {ASCEND_DTYPES}, got {spec.dtype}")
    widths = (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim)
    expected = (MLA_LATENT, MLA_ROPE, MLA_PREFILL_HEAD_DIM, MLA_PREFILL_HEAD_DIM)
    if widths != expected:
        raise ValueError(
            "the ascend MLA provider needs kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, "
            f"v_head_dim = {expected} (the fused op's MLA shapes), got {widths}"
        )
    if spec.num_heads > max(MLA_QUERY_HEADS):
        raise ValueError(
            f"the ascend MLA provider takes up to {max(MLA_QUERY_HEADS)} query heads "
            f"(the fused op takes {MLA_QUERY_HEADS}), got num_heads={spec.num_heads}"
        )
    if spec.block_size not in MLA_BLOCK_SIZES:
        raise ValueError(
            f"the ascend MLA provider needs block_size in {MLA_BLOCK_SIZES} (paged MLA "
            f"attention), got block_size={spec.block_size}"
        )
    if 1 + spec.num_speculative_tokens > MLA_MAX_QUERY_TOKENS:
        raise ValueError(
            f"the ascend MLA provider takes at most {MLA_MAX_QUERY_TOKENS} query tokens per "
            f"decode request, got num_speculative_tokens={spec.num_speculative_tokens}"
        )


def _check_lse_decode(data: AscendMLAStepData, spec: MLASpec, rows: int) -> None:
    """Raise if the decode rows need more than ATB's MLA with ``calc_type_ring`` takes."""
    query_lens = np.diff([0, *data.decode_seq_qlen])
    if data.decode_sparse_mode != SPARSE_NONE or (query_lens != 1).any():
        raise ValueError(
            "the ascend MLA provider returns the LSE of one-token decodes only (ATB's "
            "MultiLatentAttention takes no mask with calc_type_ring and one token per "
            f"request), got decode requests of {sorted(set(query_lens.tolist()))} query tokens"
        )
    if rows > ATB_MLA_MAX_BATCH:
        raise ValueError(
            f"the ascend MLA provider returns the LSE of up to {ATB_MLA_MAX_BATCH} decode "
            f"requests per call, got {rows}"
        )
    if not 0 < spec.softmax_scale <= 1:
        raise ValueError(
            "the ascend MLA provider returns the LSE only for softmax_scale in (0, 1] "
            f"(ATB's qkScale), got {spec.softmax_scale}"
        )


def _prefill_rows(plan: AttentionPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(block, row) of every position of every prefill request, in request order."""
    nd, bs = plan.num_decodes, plan.spec.block_size
    lengths = np.asarray(plan.seq_lens_host[nd:], dtype=np.int64)
    if not lengths.sum():
        return None, None
    requests = np.repeat(np.arange(nd, plan.num_reqs), lengths)
    positions = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    flat = requests * plan.block_tables.shape[1] + positions // bs
    index = torch.from_numpy(flat).to(plan.device)
    blocks = plan.block_tables.reshape(-1).index_select(0, index).long()
    return blocks, torch.from_numpy(positions % bs).to(plan.device)


def _padded_heads(num_heads: int) -> int:
    return next(h for h in MLA_QUERY_HEADS if h >= num_heads)


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x`` ``[T, N, D]`` as a contiguous ``[T, heads, D]``: ``x`` itself, the whole
    rows of the padded buffer ``x`` is a view of (``decode_heads``), or, for callers
    that keep neither, a zero-padded copy (an eager step's; inside a graph task the copy
    would run outside the graph on a task update)."""
    if x.shape[1] == heads:
        check_contiguous_rows(query=x)
        return x
    whole = _heads_in_place(x, heads)
    if whole is not None:
        return whole
    padded = x.new_zeros(x.shape[0], heads, x.shape[2])
    padded[:, : x.shape[1]] = x
    return padded


def _heads_in_place(x: torch.Tensor, heads: int) -> torch.Tensor | None:
    """``[T, heads, D]`` over the same memory when ``x`` ``[T, N, D]`` is contiguous
    (``N == heads``) or the first ``N`` heads of a contiguous ``[T, heads, D]``; else
    None."""
    rows, _, width = x.shape
    if x.shape[1] == heads:
        return x if x.is_contiguous() else None
    if x.stride() != (heads * width, width, 1):
        return None
    end = x.storage_offset() + rows * heads * width
    if end * x.element_size() > x.untyped_storage().nbytes():
        return None
    return x.as_strided((rows, heads, width), x.stride())


def _check_planes(cache: LatentCache) -> None:
    for name, plane in zip(("kv_c", "k_pe"), cache):
        if not plane.is_contiguous():
            raise ValueError(
                f"the ascend MLA provider needs contiguous cache planes (latent_cache_planes or "
                f"allocate_latent_cache), got cache.{name} with strides {plane.stride()}"
            )


def _step_data(plan: AttentionPlan) -> AscendMLAStepData:
    data = plan.provider_data
    if not isinstance(data, AscendMLAStepData):
        raise ValueError(
            "plan was not prepared by the ascend MLA provider: expected AscendMLAStepData in "
            f"plan.provider_data, got {type(data).__name__}"
        )
    return data
