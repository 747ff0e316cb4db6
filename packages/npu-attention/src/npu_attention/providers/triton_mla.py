"""The ``triton`` MLA provider: latent cache writes and absorbed decode as Triton kernels.

``prepare`` (once per step) picks the decode kernel and its number of KV splits:
on GPUs of compute capability 9.x with Triton 3.6, DeepSeek's widths (latent 512,
rope 64) go to a Gluon kernel; everything else (other widths, float32, other GPUs and
Triton versions, triton-ascend) to the portable kernel of ``mla_decode.py``. Of the
two Gluon kernels, ``hopper_mla_wide_decode.py`` (warpgroup MMAs, 64 query rows a
program) takes steps whose requests have more than 32 rows of heads x query tokens
(128 heads; 16 heads with 3 or 4 query tokens) when they have at least
``hopper_wide_min_decodes`` decodes; the rest (16 heads of one or two tokens, single
requests) go to ``hopper_mla_decode.py`` (``mma.sync``, 16 to 64 rows, fewer heads a
program for small batches), which is faster there. ``write_cache`` and ``decode`` only
launch kernels that read the step from the plan's device tensors, so both can be
captured in a device graph and replayed after the plan's fixed buffers are refreshed.

Prefill (non-absorbed, MHA over 192-wide keys and 128-wide values at DeepSeek's
widths) decompresses the prefill requests' keys and values with the caller's
up-projection, then runs a Triton kernel over them: on Hopper GPUs, prefills without
cached context go to the Gluon prefill of ``hopper_prefill.py`` over the requests'
own rows (gathered from the cache by the tokens' slots); everything else (a cached
prefix, other widths, other GPUs, the interpreter) to the portable kernel of
``paged_attention.py`` over the decompressed pages.

An fp8 latent cache (``MLASpec.kv_cache_dtype`` ``fp8`` / ``fp8_e4m3``, one float32
scale for the cache, vLLM's MLA ``_k_scale``): the write kernel stores e4m3 codes of
``x / scale``, the portable decode loads the codes and dequantizes them in registers
(the Gluon decodes keep to ``auto``), and prefills dequantize the gathered latents to
the model dtype before the up-projection, as vLLM's MLA prefill does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from npu_attention import kv_quant
from npu_attention.mla.cache import LatentCache
from npu_attention.mla.run import KVUpProjection, up_projected_heads
from npu_attention.mla.spec import MLA_KV_CACHE_DTYPES, MLASpec
from npu_attention.plan import AttentionPlan
from npu_attention.providers.mla_base import require_cache
from npu_attention.providers.reference import _to
from npu_attention.providers.reference_mla import (
    ReferenceMLAProvider,
    _proxy_spec,
    _ranges,
    decompressed_pages,
)
from npu_attention.providers.triton import TritonProvider, gluon_kernels

if TYPE_CHECKING:  # triton is optional: its kernels are imported where they run
    from npu_attention.providers.triton_kernels import AttentionLaunchConfig
    from npu_attention.providers.triton_kernels.mla_decode import MLADecodeConfig

_MAX_KV_SPLITS = 64


@dataclass(frozen=True)
class HopperMLALaunch:
    """The Gluon decode's launch: ``heads`` query heads a program at most, ``block_n``
    keys a tile, ``stages`` tiles in flight; ``wide``: the warpgroup-MMA kernel of
    ``hopper_mla_wide_decode.py`` (else ``hopper_mla_decode.py``), whose programs take
    ``heads`` query rows of a request's heads x tokens instead."""

    heads: int
    block_n: int
    stages: int
    wide: bool = False


@dataclass(frozen=True)
class TritonMLAPrefill:
    """The prefill requests of a step, as the prefill kernels read them.

    ``cu_seqlens_q`` (int32 ``[prefills + 1]``) counts rows from the first prefill
    token; ``seq_lens`` (int32 ``[prefills]``) is a view of the plan's.
    ``token_blocks``/``token_offsets`` (int64 ``[prefill tokens]``): each token's
    cache slot, when no prefill request has cached context (the Gluon prefill's own
    rows); else ``None``. ``pages`` (int64 ``[num_pages]``): the cache blocks the
    portable kernel's decompressed pages come from, and ``block_tables`` (int32
    ``[prefills, max_pages]``) the requests' pages among them; ``launch``: the
    portable kernel's launch.
    """

    launch: AttentionLaunchConfig
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    token_blocks: torch.Tensor | None
    token_offsets: torch.Tensor | None
    pages: torch.Tensor
    block_tables: torch.Tensor


@dataclass(frozen=True)
class TritonMLAData:
    """``num_kv_splits``: decode programs along each request's keys; ``decode``: the
    portable kernel's decode launch, made once for every layer (``None`` without
    decodes); ``hopper``: the Gluon kernel's launch when it takes the step's decodes
    (``decode`` stays the fallback for tensors it refuses); ``prefill``: the prefill
    requests (``None`` without prefills)."""

    num_kv_splits: int
    prefill: TritonMLAPrefill | None
    decode: MLADecodeConfig | None = None
    hopper: HopperMLALaunch | None = None


class TritonMLAProvider(ReferenceMLAProvider):
    """Triton kernels for CUDA GPUs (and the CPU under ``TRITON_INTERPRET=1``).

    Attributes (tunable per instance):
        block_h, block_n, num_warps, num_stages: the decode launch (see ``MLADecodeConfig``);
            ``block_h`` and ``max_rows`` bound the heads of a program (``heads_per_program``),
            and programs of 64 rows or more take at least 8 warps.
        min_tokens_per_split: a request's keys are split only into shares of at least
            this many tokens.
        target_waves: a split decode launches at most this many programs per
            multiprocessor (the split count is rounded down to fit).
        fixed_kv_splits: when set, every decode launch uses this many splits.
        hopper_decode, hopper_launch: the Gluon decode on or off, and its launch
            (``block_n`` keys a tile, ``num_stages`` tiles in flight).
        hopper_min_tokens_per_split, hopper_min_fill: the Gluon decode's splits: the
            smallest share of a request's keys, and the fill of the waves' program
            slots that stops adding splits (see ``_hopper_splits``).
        hopper_min_programs: decodes with fewer programs than this share of the
            multiprocessors take fewer query heads a program (see ``_hopper_heads``).
        hopper_wide_decode, hopper_wide_min_decodes: the warpgroup-MMA decode on or off,
            and the fewest decodes of a step it takes (see ``_wide_launch``).
        hopper_prefill: prefills without cached context through the Gluon prefill
            (Hopper GPUs, 192-wide keys and 128-wide values, or equal widths it takes).
        attention: the ``triton`` attention provider whose prefill launch the portable
            prefill takes (MHA at the query/key width).
    """

    name: ClassVar[str] = "triton"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    returns_lse: ClassVar[bool] = True
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = MLA_KV_CACHE_DTYPES

    def __init__(self) -> None:
        # The settings taken after measuring on an H100; benchmarks/README.md lists the
        # alternatives tried. Up to 64 query heads per program, as many as keep a program
        # within 64 rows (heads x query tokens): each program reads the latents once for
        # its heads.
        self.block_h = 64
        self.max_rows = 64
        self.block_n = 32
        self.num_warps = 4
        self.num_stages = 2
        # Split counts: the most that keeps the programs within ``target_waves`` waves,
        # in shares of at least 64 tokens.
        self.min_tokens_per_split = 64
        self.target_waves = 2
        self.fixed_kv_splits: int | None = None
        # The Gluon decode (``hopper_mla_decode.py``) on GPUs of compute capability 9.x
        # with Triton 3.6, with the settings taken after measuring on an H200: tiles of
        # 64 keys, two in flight (the most that fit beside 64 query rows), for every
        # program's rows; splits that fill the multiprocessors (``_hopper_splits``); fewer
        # heads a program for small batches of many heads (``_hopper_heads``).
        self.hopper_decode = True
        self.hopper_launch: dict[str, int] = {"block_n": 64, "num_stages": 2}
        self.hopper_min_tokens_per_split = 64
        self.hopper_min_fill = 0.9
        self.hopper_min_programs = 0.25
        # The warpgroup-MMA decode (``hopper_mla_wide_decode.py``) for programs of more
        # than 32 rows, from this many decodes a step.
        self.hopper_wide_decode = True
        self.hopper_wide_min_decodes = 2
        self.hopper_prefill = True
        self.attention = TritonProvider()

    @classmethod
    def is_available(cls) -> bool:
        try:
            import triton  # noqa: F401
        except Exception:
            return False
        return True

    def supports_device(self, device: torch.device) -> bool:
        if device.type == "cpu":
            return os.environ.get("TRITON_INTERPRET") == "1"
        return device.type in self.device_types

    def prepare(self, plan: AttentionPlan) -> TritonMLAData:
        require_cache(plan)
        splits, decode, hopper = 1, None, None
        if plan.num_decodes:
            hopper = self.hopper_launch_for(plan)
            if hopper is None:
                splits = self._num_kv_splits(plan)
            else:
                splits = self._hopper_splits(plan, hopper)
            decode = self.decode_config(plan.spec, splits)
        prefill = None
        if plan.num_decodes < plan.num_reqs:
            proxy = _proxy_spec(plan.spec, plan.spec.num_heads, plan.spec.qk_head_dim)
            prefill = prefill_requests(plan, self.attention.prefill_config(proxy))
        return TritonMLAData(splits, prefill, decode, hopper)

    def prefill(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        kv_up_proj: KVUpProjection,
        out: torch.Tensor,
        *,
        scale: torch.Tensor | None = None,
    ) -> None:
        from npu_attention.providers.triton_kernels import paged_attention

        spec, data = plan.spec, plan.provider_data.prefill
        rows = plan.num_prefill_tokens
        query, out = query[:rows], out[:rows]
        if data.token_blocks is not None and self._prefill_hopper(
            query, cache, plan, kv_up_proj, out, scale
        ):
            return
        keys, values = decompressed_pages(cache, data.pages, spec, kv_up_proj, scale)
        paged_attention(
            query,
            keys,
            values,
            out,
            data.cu_seqlens_q,
            data.seq_lens,
            data.block_tables,
            config=data.launch,
            decode_tiles=False,
            scale=spec.softmax_scale,
        )

    def _prefill_hopper(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        kv_up_proj: KVUpProjection,
        out: torch.Tensor,
        scale: torch.Tensor | None = None,
    ) -> bool:
        """The prefill through the Gluon kernel over the tokens' own rows, when the
        device and the widths let it; ``False``: nothing ran."""
        kernels = gluon_kernels(query.device, "hopper_prefill") if self.hopper_prefill else None
        if kernels is None:
            return False
        spec, data = plan.spec, plan.provider_data.prefill
        kv_c = cache.kv_c[data.token_blocks, data.token_offsets]  # [rows, L]
        k_pe = cache.k_pe[data.token_blocks, data.token_offsets]  # [rows, R]
        if scale is not None:  # fp8 rows, dequantized as decompressed_pages does
            kv_c = kv_quant.dequantize(kv_c, scale).to(spec.dtype)
            k_pe = kv_quant.dequantize(k_pe, scale).to(spec.dtype)
        k_nope, values = up_projected_heads(kv_up_proj, kv_c, spec)
        if k_nope.dtype != spec.dtype:
            raise TypeError(f"kv_up_proj must return {spec.dtype}, got {k_nope.dtype}")
        keys = torch.cat([k_nope, k_pe[:, None].expand(-1, spec.num_heads, -1)], dim=-1)
        values = values.contiguous()
        if not kernels.hopper_prefill_supported(query, keys, values, out):
            return False
        kernels.hopper_prefill(
            query, keys, values, out, data.cu_seqlens_q, scale=spec.softmax_scale, causal=True
        )
        return True

    def write_cache(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        *,
        scale: torch.Tensor | None = None,
    ) -> None:
        from npu_attention.providers.triton_kernels.mla_cache_write import write_latent_cache

        write_latent_cache(
            kv_c, k_pe, cache.kv_c, cache.k_pe, plan.slot_mapping, plan.num_actual_tokens, scale
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
        scale: torch.Tensor | None = None,
    ) -> None:
        from npu_attention.providers.triton_kernels.mla_decode import mla_decode_attention

        spec = plan.spec
        if scale is None and self._decode_hopper(q_latent, q_rope, cache, plan, out, lse):
            return
        mla_decode_attention(
            q_latent,
            q_rope,
            cache.kv_c,
            cache.k_pe,
            plan.block_tables,
            plan.cu_seqlens_q,
            plan.seq_lens,
            out,
            num_decodes=plan.num_decodes,
            num_decode_tokens=plan.num_decode_tokens,
            max_query_len=1 + spec.num_speculative_tokens,
            scale=spec.softmax_scale,
            config=plan.provider_data.decode,
            lse=lse,
            k_scale=scale,
        )

    def hopper_launch_for(self, plan: AttentionPlan) -> HopperMLALaunch | None:
        """The Gluon decode's launch for the plan's decodes, or ``None`` where it does
        not take them (the tensors are checked again at ``decode``)."""
        spec = plan.spec
        if spec.kv_cache_dtype != "auto":  # fp8 latents: the portable kernel
            return None
        kernels = gluon_kernels(plan.device, "hopper_mla_decode") if self.hopper_decode else None
        tokens = 1 + spec.num_speculative_tokens
        if kernels is None or not kernels.shape_supported(
            spec.kv_lora_rank, spec.qk_rope_head_dim, spec.dtype, spec.block_size, tokens
        ):
            return None
        wide = self._wide_launch(plan)
        if wide is not None:
            return wide
        heads = self._hopper_heads(plan, kernels.program_rows)
        launch = self.hopper_launch
        return HopperMLALaunch(heads, launch["block_n"], launch["num_stages"])

    def _wide_launch(self, plan: AttentionPlan) -> HopperMLALaunch | None:
        """The warpgroup-MMA decode's launch where it takes the plan's decodes: its
        switch on, at least ``hopper_wide_min_decodes`` decodes, and a shape it takes
        (more than 32 rows of heads x query tokens a request); else ``None``."""
        spec = plan.spec
        if not self.hopper_wide_decode or plan.num_decodes < self.hopper_wide_min_decodes:
            return None
        wide = gluon_kernels(plan.device, "hopper_mla_wide_decode")
        tokens = 1 + spec.num_speculative_tokens
        if wide is None or not wide.shape_supported(
            spec.kv_lora_rank,
            spec.qk_rope_head_dim,
            spec.dtype,
            spec.block_size,
            spec.num_heads,
            tokens,
        ):
            return None
        rows = wide.program_rows(spec.num_heads, tokens)
        return HopperMLALaunch(rows, wide.BLOCK_N, wide.STAGES, wide=True)

    def _hopper_heads(self, plan: AttentionPlan, program_rows) -> int:
        """Query heads a Gluon program takes: as many as fit its rows, halved (down to
        16) while the requests' programs number fewer than ``hopper_min_programs`` of
        the multiprocessors. Small batches of many heads then read the latents once
        per head group (the second time from the L2) rather than splitting the keys
        into many more shares, each writing float32 partial rows of every head."""
        from npu_attention.providers.triton_kernels.utils import multiprocessor_count

        spec = plan.spec
        heads, _ = program_rows(spec.num_heads, 1 + spec.num_speculative_tokens)
        wanted = self.hopper_min_programs * multiprocessor_count(plan.device)
        while heads > 16 and plan.num_decodes * -(-spec.num_heads // heads) < wanted:
            heads //= 2
        return heads

    def _decode_hopper(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> bool:
        """Run the decodes through the Gluon kernel when the step chose it and it takes
        the tensors; ``False``: nothing ran, and the portable kernel serves them."""
        launch = plan.provider_data.hopper
        if launch is None:
            return False
        kernels = gluon_kernels(q_latent.device, "hopper_mla_decode")
        if kernels is None or not kernels.hopper_mla_decode_supported(
            q_latent, q_rope, cache.kv_c, cache.k_pe, out
        ):
            return False
        if launch.wide:
            gluon_kernels(q_latent.device, "hopper_mla_wide_decode").hopper_mla_wide_decode(
                q_latent,
                q_rope,
                cache.kv_c,
                cache.k_pe,
                out,
                plan.cu_seqlens_q,
                plan.seq_lens,
                plan.block_tables,
                num_decodes=plan.num_decodes,
                num_decode_tokens=plan.num_decode_tokens,
                tokens_per_req=1 + plan.spec.num_speculative_tokens,
                scale=plan.spec.softmax_scale,
                num_splits=plan.provider_data.num_kv_splits,
                lse=lse,
            )
            return True
        kernels.hopper_mla_decode(
            q_latent,
            q_rope,
            cache.kv_c,
            cache.k_pe,
            out,
            plan.cu_seqlens_q,
            plan.seq_lens,
            plan.block_tables,
            num_decodes=plan.num_decodes,
            num_decode_tokens=plan.num_decode_tokens,
            tokens_per_req=1 + plan.spec.num_speculative_tokens,
            scale=plan.spec.softmax_scale,
            num_splits=plan.provider_data.num_kv_splits,
            lse=lse,
            block_n=launch.block_n,
            stages=launch.stages,
            max_heads=launch.heads,
        )
        return True

    def decode_config(self, spec: MLASpec, num_kv_splits: int) -> MLADecodeConfig:
        """The decode launch for ``spec``: programs of 64 rows (heads x query tokens) or
        more get at least 8 warps."""
        from npu_attention.providers.triton_kernels.mla_decode import MLADecodeConfig
        from npu_attention.providers.triton_kernels.utils import next_power_of_2

        block_h = self.heads_per_program(spec)
        rows = block_h * next_power_of_2(1 + spec.num_speculative_tokens)
        return MLADecodeConfig(
            block_h=block_h,
            block_n=self.block_n,
            num_splits=num_kv_splits,
            num_warps=max(self.num_warps, 8) if rows >= 64 else self.num_warps,
            num_stages=self.num_stages,
        )

    def heads_per_program(self, spec: MLASpec) -> int:
        """Query heads of one decode program: at most ``block_h``, the model's heads
        (rounded up to a power of two) and ``max_rows`` rows of heads x query tokens."""
        from npu_attention.providers.triton_kernels.utils import next_power_of_2

        tokens = next_power_of_2(1 + spec.num_speculative_tokens)
        heads = next_power_of_2(spec.num_heads)
        return max(1, min(self.block_h, heads, self.max_rows // tokens))

    def _num_kv_splits(self, plan: AttentionPlan) -> int:
        if self.fixed_kv_splits is not None:
            return self.fixed_kv_splits
        head_groups = -(-plan.spec.num_heads // self.heads_per_program(plan.spec))
        programs = max(1, plan.num_decodes * head_groups)
        from npu_attention.providers.triton_kernels.utils import multiprocessor_count

        by_occupancy = self.target_waves * multiprocessor_count(plan.device) // programs
        by_length = -(-plan.max_seq_len // self.min_tokens_per_split)
        return max(1, min(by_occupancy, by_length, _MAX_KV_SPLITS))

    def _hopper_splits(self, plan: AttentionPlan, launch: HopperMLALaunch) -> int:
        """Splits of the Gluon decode: counts up to 64 whose shares of the longest
        request are whole tiles of at least ``hopper_min_tokens_per_split``
        keys with no split left empty; the fewest whose programs fill
        ``hopper_min_fill`` of their waves' program slots (one block per
        multiprocessor), else the count that fills the most."""
        if self.fixed_kv_splits is not None:
            return self.fixed_kv_splits
        from npu_attention.providers.triton_kernels.utils import multiprocessor_count

        rows = plan.spec.num_heads * (1 + plan.spec.num_speculative_tokens if launch.wide else 1)
        programs = plan.num_decodes * -(-rows // launch.heads)
        slots = multiprocessor_count(plan.device)

        def fill(splits: int) -> Fraction:
            return Fraction(programs * splits, slots * -(-programs * splits // slots))

        tiles = max(1, -(-plan.max_seq_len // launch.block_n))
        longest = min(_MAX_KV_SPLITS, -(-plan.max_seq_len // self.hopper_min_tokens_per_split))
        counts = [n for n in range(1, max(1, longest) + 1) if -(-tiles // -(-tiles // n)) == n]
        enough = [n for n in counts if fill(n) >= self.hopper_min_fill]
        return enough[0] if enough else max(counts, key=lambda n: (fill(n), -n))


def prefill_requests(plan: AttentionPlan, launch: AttentionLaunchConfig) -> TritonMLAPrefill | None:
    """The prefill requests' rows, lengths and pages (``TritonMLAPrefill``); ``None``
    when they have no query token."""
    host, spec = plan.host_arrays, plan.spec
    first, last = plan.num_decodes, plan.num_reqs
    query_lens, seq_lens = host.query_lens[first:], host.seq_lens[first:]
    if not query_lens.sum():
        return None
    device, block_size = plan.device, spec.block_size
    cu = np.concatenate([[0], np.cumsum(query_lens)])
    table_width = plan.block_tables.shape[1]
    table = plan.block_tables.reshape(-1)
    requests = np.arange(first, last)
    # Pages: each request's, in order, one after the other.
    num_pages = -(-seq_lens // block_size)
    first_page = np.concatenate([[0], np.cumsum(num_pages)[:-1]])
    width = max(1, int(num_pages.max()))
    compact = first_page[:, None] + np.minimum(
        np.arange(width), np.maximum(num_pages - 1, 0)[:, None]
    )
    entries = np.repeat(requests, num_pages) * table_width + _ranges(num_pages)
    pages = table.index_select(0, _to(entries, device)).long()
    token_blocks = token_offsets = None
    if not host.context_lens[first:].any():  # every key is a prefill token's own
        positions = _ranges(query_lens)
        entries = np.repeat(requests, query_lens) * table_width + positions // block_size
        token_blocks = table.index_select(0, _to(entries, device)).long()
        token_offsets = _to(positions % block_size, device)
    return TritonMLAPrefill(
        launch=launch,
        cu_seqlens_q=_to(cu, device, np.int32),
        seq_lens=plan.seq_lens[first:last],
        token_blocks=token_blocks,
        token_offsets=token_offsets,
        pages=pages,
        block_tables=_to(compact, device, np.int32),
    )
