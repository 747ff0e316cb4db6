"""The ``triton`` provider: paged attention and KV-cache writes as Triton kernels.

``prepare`` (once per step) picks the kernel family for the batch state and, for
decode batches, the number of KV splits; ``write_kv`` and ``attend`` (once per
layer) only launch kernels. Every step argument is read on the device from the
plan's tensors and grids depend only on tensor shapes, so both are safe to capture
in a device graph: replays see whatever the plan's fixed buffers hold.

A prefill without cached context (``PREFILL_NO_CACHE``) given its own ``key``/``value``
rows, as ``npu_attention.run`` gives them, reads its keys from those rows: through the
Gluon kernel of ``hopper_prefill.py`` on Hopper GPUs (``hopper_prefill``), else with
the prefill tiles of contiguous keys. Every other batch reads keys from the pages;
decodes whose programs fit one wave do so through the Gluon kernel of
``hopper_decode.py`` on Hopper GPUs (``hopper_decode``), else with the decode tiles.

8-bit caches (``AttentionSpec.kv_cache_dtype``): the write kernel quantizes the rows
(and writes per-token-head scales); the Gluon decode (on Hopper, decodes of any
number of waves) and the portable kernel load 8-bit pages and dequantize them in
registers; a prefill without cached context still attends over its own rows in the
model dtype (the Gluon prefill on Hopper). A prefill that reads cached keys from 8-bit
pages, with enough query tiles over each page, first dequantizes the pages its requests
reference into a 16-bit pool laid out once a step
(``triton_kernels/dequant_pages.py``; not inside graph captures, since the pool's size
follows the step's lengths) and runs the 16-bit kernel over it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from npu_attention import kv_quant
from npu_attention.kv_quant import KVScales
from npu_attention.plan import AttentionPlan
from npu_attention.providers.base import VLLM_HEAD_SIZES, AttentionProvider
from npu_attention.spec import AttentionSpec, BatchState

if TYPE_CHECKING:  # triton is optional: its kernels are imported where they run
    from npu_attention.providers.triton_kernels import AttentionLaunchConfig
    from npu_attention.providers.triton_kernels.dequant_pages import PagePool

_DECODE_STATES = (BatchState.DECODE_ONLY, BatchState.SPEC_DECODING)
_MAX_KV_SPLITS = 64
_SHARED_MEMORY_BUDGET = 224 * 1024  # bytes of tiles per program (H100: 227 KiB)


@dataclass(frozen=True)
class TritonStepData:
    """What ``prepare`` decides once per step (``plan.provider_data``).

    ``decode_tiles``: one program per request and KV head (every request has at
    most ``1 + num_speculative_tokens`` query tokens); ``num_kv_splits``: programs
    along each decode request's keys (1 = no split); ``one_wave``: a decode whose
    programs (splits included) fit one per multiprocessor, launched with the wider
    ``decode_launch_one_wave`` tiles; ``hopper_decode``: the decode goes to the Gluon
    kernel of ``hopper_decode.py`` (splits chosen for one program per multiprocessor,
    ``hopper_decode_programs_per_sm_8bit`` over 8-bit pages);
    ``hopper_long``: each of its programs reads at least ``hopper_decode_long_keys``
    keys (the longest request's share), launched with ``hopper_decode_launch_long``;
    ``pool``: prefill tiles over 8-bit pages read them dequantized once a layer into
    this 16-bit pool (``triton_kernels/dequant_pages.py``), attended as a cache of
    ``pool_spec``; ``None``: they convert in the kernel.
    """

    decode_tiles: bool
    num_kv_splits: int
    one_wave: bool = False
    hopper_decode: bool = False
    hopper_long: bool = False
    pool: PagePool | None = None
    pool_spec: AttentionSpec | None = None


class TritonProvider(AttentionProvider):
    """Triton kernels for CUDA GPUs (and the CPU under ``TRITON_INTERPRET=1``).

    Attributes (tunable per instance):
        min_tokens_per_split: a decode request's keys are split only into shares
            of at least this many tokens.
        target_waves: decode launches aim for this many programs per multiprocessor.
        min_unsplit_fill: a decode of at least this many programs (requests x KV
            heads) per multiprocessor is not split (a merge pass costs more than
            the idle multiprocessors).
        decode_launch, decode_launch_small_pages, decode_launch_one_wave, prefill_launch,
            prefill_launch_small_pages: the portable kernel's launches (``block_m``,
            ``block_n``, ``num_warps``, ``num_stages``, ``pdl``, ``prefetch_tiles``; see
            ``_launch_config``).
        hopper_prefill, hopper_prefill_stages, hopper_decode, hopper_decode_launch,
            hopper_decode_long_keys, hopper_decode_launch_long: the Gluon kernels for
            Hopper GPUs, each on or off, and their settings.
        decode_launch_8bit, decode_launch_one_wave_8bit, min_unsplit_fill_8bit,
            target_waves_8bit: what decodes over 8-bit pages use instead (``None``: the
            16-bit setting).
        hopper_decode_8bit, hopper_decode_launch_8bit, hopper_decode_programs_per_sm_8bit,
            hopper_decode_multi_wave_8bit, hopper_decode_launch_multi_wave_8bit: the Gluon
            decode over 8-bit pages on or off; its launch (``maxnreg`` caps a thread's
            registers, so that several programs share a multiprocessor) and the programs
            per multiprocessor its splits aim for; the kinds whose decodes of more
            programs than multiprocessors it takes too, and their launch.
        fast_dequant_pages: the page dtypes the portable kernel converts by integer and
            float arithmetic (``dequant.py``) rather than conversion instructions.
        prefill_launch_8bit: the portable kernel's launch for prefills that read 8-bit
            pages (``None``: ``prefill_launch``); a ``fast_dequant`` key in it overrides
            ``fast_dequant_pages``.
        dequant_pool_bytes, dequant_pool_min_reuse: a prefill step over 8-bit pages
            dequantizes them once into a 16-bit pool of at most this many bytes (K and
            V) when its query tiles read each page at least this many times on average
            (0 bytes: never).
    """

    name: ClassVar[str] = "triton"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    # The kernels pad the head dimension to the next power of two (HEAD_PAD) and mask
    # the padding lanes on every load and store, so non-power-of-two sizes run too.
    head_sizes: ClassVar[tuple[int, ...]] = VLLM_HEAD_SIZES
    # The attention kernel (or, for split decodes, the merge of the splits) writes
    # each row's natural-log LSE on the device when ``attend`` gets ``lse=``.
    returns_lse: ClassVar[bool] = True
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = kv_quant.KV_CACHE_DTYPES

    def __init__(self) -> None:
        # The settings taken after measuring on an H100 and an H200; benchmarks/README.md
        # lists the alternatives tried and their figures.
        self.min_tokens_per_split = 128
        self.target_waves = 2
        self.min_unsplit_fill = 0.75
        # ``pdl``: programmatic dependent launch (Hopper and later; elsewhere left out of
        # the launch): a split decode's merge kernel launches while the attention kernel
        # runs. ``prefetch_tiles``: each decode program asks the L2 for the K/V rows of its
        # first key tile as it starts, before its lengths arrive (CUDA only).
        self.decode_launch: dict[str, int] = {
            "block_n": 64,
            "num_warps": 2,
            "num_stages": 2,
            "pdl": 1,
            "prefetch_tiles": 1,
        }
        # Pages smaller than a K/V tile (each key's page looked up): one stage deeper.
        self.decode_launch_small_pages: dict[str, int] = {**self.decode_launch, "num_stages": 3}
        # Decodes whose programs, splits included, fit one wave (at most one per
        # multiprocessor): wider K/V tiles keep more bytes in flight.
        self.decode_launch_one_wave: dict[str, int] = {
            "block_n": 128,
            "num_warps": 4,
            "num_stages": 3,
            "pdl": 1,
            "prefetch_tiles": 1,
        }
        self.prefill_launch: dict[str, int] = {
            "block_m": 128,
            "block_n": 128,
            "num_warps": 8,
            "num_stages": 3,
        }
        # Pages smaller than a K/V tile of ``prefill_launch``: keys are gathered row by
        # row, and tiles of one warpgroup with a shallower pipeline do better.
        self.prefill_launch_small_pages: dict[str, int] = {
            "block_m": 64,
            "block_n": 64,
            "num_warps": 4,
            "num_stages": 2,
        }
        # The Gluon kernels, on GPUs of compute capability 9.x with Triton 3.6: a prefill
        # without cached context over its own K/V rows (``hopper_prefill.py``), and decodes
        # whose programs fit one wave, without a sliding window or soft cap
        # (``hopper_decode.py``: ``num_stages`` K/V tiles of ``block_n`` keys in flight,
        # a consumer of ``num_warps`` warps).
        self.hopper_prefill = True
        self.hopper_prefill_stages = 2
        self.hopper_decode = True
        self.hopper_decode_launch: dict[str, int] = {
            "block_n": 64,
            "num_warps": 4,
            "num_stages": 2,
        }
        # Programs of at least this many keys each take tiles of 128 keys: twice the
        # bytes in flight for the same two stages.
        self.hopper_decode_long_keys = 2048
        self.hopper_decode_launch_long: dict[str, int] = {
            **self.hopper_decode_launch,
            "block_n": 128,
        }
        # Decodes over 8-bit pages (the portable kernel): None keeps the 16-bit setting.
        # Splitting keys until 8 programs per multiprocessor: H100, 16 x 16384 int8 per
        # token and head 266 against 312 us unsplit (16-bit 365); other settings tried are
        # in benchmarks/README.md.
        self.decode_launch_8bit: dict[str, int] | None = None
        self.decode_launch_one_wave_8bit: dict[str, int] | None = None
        self.min_unsplit_fill_8bit: float | None = 8.0
        self.target_waves_8bit: int | None = None
        # The Gluon decode over 8-bit pages: half the bytes a tile, converted in registers.
        # Three programs a multiprocessor (80 registers a thread, 64-key tiles, 2 stages):
        # H100, 16 x 16384 block 128 / 16, fp8 214 / 211 us, int8 per token and head
        # 224 / 222 against one program of 128-key tiles and 4 stages, 240 / 252 and
        # 266 / 272 (16-bit 365 / 367). Decodes of more programs than multiprocessors:
        # two programs a multiprocessor, every kind (64 x 4096, head-major pages, block
        # 128 / 16: int8 per token and head 205 / 210 us against the portable kernel's
        # 220 / 223; token-major pages 232 / 228 against 224 / 228; fp8 213 / 215 against
        # 232 / 229). Other settings tried: benchmarks/README.md.
        self.hopper_decode_8bit = True
        self.hopper_decode_launch_8bit: dict[str, int] = {
            "block_n": 64,
            "num_warps": 4,
            "num_stages": 2,
            "maxnreg": 80,
        }
        self.hopper_decode_programs_per_sm_8bit = 3
        self.hopper_decode_multi_wave_8bit: tuple[str, ...] = kv_quant.KV_CACHE_DTYPES[1:]
        self.hopper_decode_launch_multi_wave_8bit: dict[str, int] = {
            "block_n": 128,
            "num_warps": 4,
            "num_stages": 2,
            "maxnreg": 128,
        }
        # H100, 64 x 4096 portable: fp8 233 / 230 us against 265 / 272 with conversion
        # instructions; int8 238 / 239 against 225 / 228.
        # int8 chunks after a prefix took the same time either way (0.251 against
        # 0.248-0.250 ms, 512 after 4096, block 128).
        self.fast_dequant_pages: tuple[torch.dtype, ...] = (torch.float8_e4m3fn,)
        # Prefills that read 8-bit pages (a chunk after a cached prefix): tiles of 64 rows
        # and 128 keys, one warpgroup, twice the programs of ``prefill_launch``. H200, 512
        # after 4096, block 128 / 16, attention alone: int8 per token and head 0.139 /
        # 0.141 ms against 0.241 / 0.186 (16-bit 0.103 / 0.128); fp8 0.136 / 0.144
        # against 0.144 / 0.160. Other settings tried: benchmarks/README.md.
        self.prefill_launch_8bit: dict[str, int] | None = {
            "block_m": 64,
            "block_n": 128,
            "num_warps": 4,
            "num_stages": 3,
        }
        # Prefill steps over cached 8-bit pages read them from a 16-bit pool dequantized
        # once a layer. H100, write + attention against the 16-bit layer, block 128 /
        # 16: a 512-token chunk after 4096 1.045 / 0.999 (int8 per token and head) and
        # 1.030 / 0.984 (fp8) against 1.365 / 1.118 and 1.312 / 1.140 converting in the
        # kernel. The pool is memory vLLM's profile does not see (its profile step reads
        # no cache), so it is capped: 256 MiB takes the 67 MB pools of chunks after 16384
        # (attention 1.11-1.12x / 1.08-1.10x against 1.35-1.41x / 1.12-1.14x).
        self.dequant_pool_bytes = 256 << 20
        # H200, attention alone after 4096, int8 per token and head: a 64-token chunk's
        # tiles read each page 4 times, and the pool would not pay (1.07x / 0.97x either
        # way); a 128-token chunk's 8 times, 0.96x / 0.84x with it, 1.09x / 0.97x without.
        self.dequant_pool_min_reuse = 8

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

    def prepare(self, plan: AttentionPlan) -> TritonStepData:
        decode_tiles = plan.state in _DECODE_STATES
        num_kv_splits, one_wave, gluon, long = 1, False, False, False
        if decode_tiles:
            gluon = self._hopper_decode_takes(plan.spec, plan.num_reqs, plan.device)
            num_kv_splits = self._num_kv_splits(
                plan.num_reqs, plan.spec.num_kv_heads, plan.max_seq_len, plan.device, gluon,
                eight_bit=plan.spec.kv_cache_dtype != "auto",
            )  # fmt: skip
            programs = plan.num_reqs * plan.spec.num_kv_heads * num_kv_splits
            one_wave = programs <= _multiprocessors(plan.device)
            share = -(-plan.max_seq_len // num_kv_splits)
            long = gluon and share >= self.hopper_decode_long_keys
        pool = None if decode_tiles else self._page_pool(plan)
        pool_spec = None
        if pool is not None:
            pool_spec = dataclasses.replace(plan.spec, kv_cache_dtype="auto")
        return TritonStepData(decode_tiles, num_kv_splits, one_wave, gluon, long, pool, pool_spec)

    def _page_pool(self, plan: AttentionPlan) -> PagePool | None:
        """The 16-bit pool a prefill step over cached 8-bit pages reads (outside a graph
        capture), when both pools fit in ``dequant_pool_bytes`` and the 8-bit launch's
        query tiles would read each page ``dequant_pool_min_reuse`` times or more on
        average; else ``None``."""
        spec = plan.spec
        if spec.kv_cache_dtype == "auto" or not plan.has_cache:
            return None
        if plan.state is BatchState.PREFILL_NO_CACHE or _capturing(plan.device):
            return None
        from npu_attention.providers.triton_kernels.dequant_pages import PagePool

        page_shape = (spec.block_size, spec.num_kv_heads, spec.head_size)
        width = plan.block_tables.shape[1]
        pool = PagePool(plan.seq_lens_host, width, page_shape, spec.dtype)  # no memory yet
        if pool.nbytes > self.dequant_pool_bytes:
            return None
        block_m = self.prefill_config(spec).block_m
        reads = sum(
            -(-q * spec.num_queries_per_kv // block_m) * pages
            for q, pages in zip(plan.query_lens_host, pool.counts)
        )
        return pool if reads >= self.dequant_pool_min_reuse * pool.pages else None

    def _hopper_decode_takes(
        self, spec: AttentionSpec, num_reqs: int, device: torch.device
    ) -> bool:
        """Whether ``num_reqs`` decodes of ``spec`` on ``device`` go to the Gluon decode
        kernel (the tensors are checked again at ``attend``)."""
        if not self.hopper_decode or spec.sliding_window is not None or not spec.causal:
            return False
        eight_bit = spec.kv_cache_dtype != "auto"
        if eight_bit and not self.hopper_decode_8bit:
            return False
        if spec.logits_soft_cap is not None:
            return False
        multi_wave = eight_bit and spec.kv_cache_dtype in self.hopper_decode_multi_wave_8bit
        if not multi_wave and num_reqs * spec.num_kv_heads > _multiprocessors(device):
            return False
        kernels = _hopper_decode_kernels(device)
        rows = spec.num_queries_per_kv * (1 + spec.num_speculative_tokens)
        return kernels is not None and kernels.shape_supported(
            spec.head_size, spec.dtype, spec.block_size, rows
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
        from npu_attention.providers.triton_kernels import write_kv_cache

        spec = plan.spec
        for label, tensor in (("key", key), ("value", value)):
            _check_tokens(label, tensor, spec.num_kv_heads, spec.head_size, spec.dtype)
        if key.shape[0] != value.shape[0]:
            raise ValueError(
                f"key and value must have the same number of tokens, got "
                f"{key.shape[0]} and {value.shape[0]}"
            )
        _check_caches(key_cache, value_cache, spec, key.device)
        k_scale, v_scale = _scales(spec, scales)
        write_kv_cache(key, value, key_cache, value_cache, plan.slot_mapping, k_scale, v_scale)

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
        from npu_attention.providers.triton_kernels import paged_attention

        spec = plan.spec
        _check_tokens("query", query, spec.num_heads, spec.head_size, spec.dtype)
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(
                f"out must match query ({tuple(query.shape)}, {query.dtype}), got "
                f"({tuple(out.shape)}, {out.dtype})"
            )
        if lse is not None:
            _check_lse(lse, query, plan.num_actual_tokens)
        step = plan.provider_data
        if not isinstance(step, TritonStepData):
            step = self.prepare(plan)
        paged = key_cache is not None or value_cache is not None
        if paged:
            _check_caches(key_cache, value_cache, spec, query.device)
        k_scale, v_scale = _scales(spec, scales)
        if paged and not _reads_own_keys(plan, key, value):
            k, v, block_tables = key_cache, value_cache, plan.block_tables
            if step.pool is not None and not _capturing(query.device):
                k, v, block_tables = step.pool.fill(
                    k, v, k_scale, v_scale, block_tables, plan.seq_lens
                )
                k_scale = v_scale = None
                spec = step.pool_spec
        else:
            paged = False
            k_scale = v_scale = None
            if key is None or value is None:
                raise ValueError("attend needs key_cache/value_cache or key/value, got neither")
            for label, tensor in (("key", key), ("value", value)):
                _check_tokens(label, tensor, spec.num_kv_heads, spec.head_size, spec.dtype)
            k, v, block_tables = key, value, None
            if self._attend_hopper_prefill(query, k, v, out, plan, lse):
                return
        decode_tiles = step.decode_tiles and paged
        if (
            decode_tiles
            and step.hopper_decode
            and self._attend_hopper_decode(query, k, v, out, plan, step, lse, scales)
        ):
            return
        paged_attention(
            query,
            k,
            v,
            out,
            plan.cu_seqlens_q,
            plan.seq_lens,
            block_tables,
            config=self._launch_config(
                spec, decode_tiles, step.num_kv_splits, step.one_wave, paged
            ),
            decode_tiles=decode_tiles,
            scale=spec.softmax_scale,
            causal=spec.causal,
            sliding_window=spec.sliding_window,
            logits_soft_cap=spec.logits_soft_cap,
            paged=paged,
            lse=lse,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def _attend_hopper_prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        plan: AttentionPlan,
        lse: torch.Tensor | None,
    ) -> bool:
        """Run a prefill without cached context through the Hopper kernel when it takes
        the call; ``False``: nothing ran, and the portable kernel serves it."""
        spec = plan.spec
        if not self.hopper_prefill or plan.state is not BatchState.PREFILL_NO_CACHE:
            return False
        if spec.sliding_window is not None or spec.logits_soft_cap is not None:
            return False
        kernels = _hopper_prefill_kernels(query.device)
        if kernels is None or not kernels.hopper_prefill_supported(query, key, value, out):
            return False
        kernels.hopper_prefill(
            query,
            key,
            value,
            out,
            plan.cu_seqlens_q[: plan.num_reqs + 1],
            scale=spec.softmax_scale,
            causal=spec.causal,
            lse=lse,
            stages=self.hopper_prefill_stages,
        )
        return True

    def _attend_hopper_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        plan: AttentionPlan,
        step: TritonStepData,
        lse: torch.Tensor | None,
        scales: KVScales | None = None,
    ) -> bool:
        """Run a decode through the Gluon kernel when it takes the call's tensors;
        ``False``: nothing ran, and the portable kernel serves it."""
        spec = plan.spec
        kernels = _hopper_decode_kernels(query.device)
        tokens_per_req = 1 + spec.num_speculative_tokens
        rows = spec.num_queries_per_kv * tokens_per_req
        if not self.hopper_decode or kernels is None:
            return False
        k_scale, v_scale = _scales(spec, scales)
        if not kernels.hopper_decode_supported(query, key_cache, value_cache, out, rows, k_scale):
            return False
        launch = self.hopper_decode_launch_long if step.hopper_long else self.hopper_decode_launch
        if k_scale is not None:
            launch = self.hopper_decode_launch_8bit
            if plan.num_reqs * spec.num_kv_heads > _multiprocessors(query.device):
                launch = self.hopper_decode_launch_multi_wave_8bit
        kernels.hopper_decode(
            query,
            key_cache,
            value_cache,
            out,
            plan.cu_seqlens_q,
            plan.seq_lens,
            plan.block_tables,
            scale=spec.softmax_scale,
            tokens_per_req=tokens_per_req,
            num_splits=step.num_kv_splits,
            lse=lse,
            stages=launch["num_stages"],
            block_n=launch["block_n"],
            num_warps=launch["num_warps"],
            k_scale=k_scale,
            v_scale=v_scale,
            maxnreg=_maxnreg(launch.get("maxnreg"), spec.head_size),
        )
        return True

    def prefill_config(self, spec: AttentionSpec, paged: bool = True) -> AttentionLaunchConfig:
        """The portable kernel's launch for a prefill of ``spec``, its keys read from
        the pages (``paged``) or from contiguous rows."""
        return self._launch_config(spec, False, 1, False, paged)

    def _launch_config(
        self,
        spec: AttentionSpec,
        decode_tiles: bool,
        num_kv_splits: int,
        one_wave: bool = False,
        paged: bool = True,
    ) -> AttentionLaunchConfig:
        if not decode_tiles:
            launch = self.prefill_launch
            if paged and spec.block_size % launch["block_n"]:
                launch = self.prefill_launch_small_pages
            if paged and spec.kv_cache_dtype != "auto" and self.prefill_launch_8bit is not None:
                launch = self.prefill_launch_8bit
        elif one_wave:
            launch = self.decode_launch_one_wave
            if spec.kv_cache_dtype != "auto" and self.decode_launch_one_wave_8bit is not None:
                launch = self.decode_launch_one_wave_8bit
        else:
            launch = self.decode_launch
            if spec.block_size % launch["block_n"]:
                launch = self.decode_launch_small_pages
            if spec.kv_cache_dtype != "auto" and self.decode_launch_8bit is not None:
                launch = self.decode_launch_8bit
        if spec.kv_cache_dtype != "auto":
            launch = {"fast_dequant": int(spec.cache_dtype in self.fast_dequant_pages), **launch}
        return _launch_config(spec, decode_tiles, num_kv_splits, tuple(sorted(launch.items())))

    def _num_kv_splits(
        self,
        num_reqs: int,
        num_kv_heads: int,
        max_seq_len: int,
        device: torch.device,
        one_wave: bool = False,
        *,
        eight_bit: bool = False,
    ) -> int:
        """Programs along each decode request's keys: none when the requests' programs
        already fill ``min_unsplit_fill`` of the multiprocessors, else enough for
        ``target_waves`` programs per multiprocessor (``one_wave``: as many as fit one
        per multiprocessor), in shares of at least ``min_tokens_per_split`` keys."""
        programs = max(1, num_reqs * num_kv_heads)
        multiprocessors = _multiprocessors(device)
        min_fill, waves = self.min_unsplit_fill, self.target_waves
        if eight_bit:
            min_fill = (
                min_fill if self.min_unsplit_fill_8bit is None else self.min_unsplit_fill_8bit
            )
            waves = waves if self.target_waves_8bit is None else self.target_waves_8bit
        if programs >= min_fill * multiprocessors:
            return 1
        if one_wave:
            per_sm = self.hopper_decode_programs_per_sm_8bit if eight_bit else 1
            by_occupancy = per_sm * multiprocessors // programs
        else:
            by_occupancy = -(-waves * multiprocessors // programs)
        by_length = -(-max_seq_len // self.min_tokens_per_split)
        return max(1, min(by_occupancy, by_length, _MAX_KV_SPLITS))


def _reads_own_keys(
    plan: AttentionPlan, key: torch.Tensor | None, value: torch.Tensor | None
) -> bool:
    """Whether the step's own ``key``/``value`` rows hold every key it attends to: a
    prefill without cached context. Its keys are then read from those contiguous rows
    rather than gathered back from the pages they were just written to."""
    return key is not None and value is not None and plan.state is BatchState.PREFILL_NO_CACHE


@functools.lru_cache(maxsize=256)
def _launch_config(
    spec: AttentionSpec,
    decode_tiles: bool,
    num_kv_splits: int,
    launch: tuple[tuple[str, int], ...],
) -> AttentionLaunchConfig:
    from npu_attention.providers.triton_kernels import AttentionLaunchConfig

    params = dict(launch)
    queries_per_kv = spec.num_queries_per_kv
    block_n = params["block_n"] if spec.head_size <= 128 else min(params["block_n"], 32)
    if decode_tiles:
        rows = queries_per_kv * (1 + spec.num_speculative_tokens)
        block_m = max(16, 1 << (rows - 1).bit_length())
    else:
        block_m = params.get("block_m", 128) if spec.head_size <= 128 else 64
        block_m = max(block_m, 1 << (queries_per_kv - 1).bit_length())
    num_warps = params["num_warps"] if spec.head_size <= 128 else 4
    num_stages = params["num_stages"]
    # Keep the Q tile and the pipelined K/V tiles within the shared memory of a multiprocessor.
    head_pad = 1 << (spec.head_size - 1).bit_length()
    element = torch.finfo(spec.dtype).bits // 8
    kv_element = spec.cache_dtype.itemsize  # the pipelined K/V tiles: 1 byte for 8-bit pages

    def shared_bytes() -> int:
        return (num_stages * 2 * block_n * kv_element + block_m * element) * head_pad

    while shared_bytes() > _SHARED_MEMORY_BUDGET and block_n > 16:
        block_n //= 2
    while shared_bytes() > _SHARED_MEMORY_BUDGET and num_stages > 1:
        num_stages -= 1
    return AttentionLaunchConfig(
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        num_splits=num_kv_splits if decode_tiles else 1,
        pdl=bool(params.get("pdl", 0)),
        prefetch_tiles=int(params.get("prefetch_tiles", 0)),
        fast_dequant=bool(params.get("fast_dequant", 0)),
    )


# Triton versions the Gluon kernel ran on; others keep the portable kernel, since
# Gluon's API still changes between releases.
_GLUON_TRITON_VERSIONS = ((3, 6),)


@functools.lru_cache(maxsize=16)
def gluon_kernels(device: torch.device, name: str):
    """The Gluon kernel module ``name`` (``hopper_prefill``, ``hopper_decode``,
    ``hopper_mla_decode``) where ``device`` can run it (a CUDA GPU of compute capability
    9.x, a Triton whose Gluon it ran on), else ``None``."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) not in _GLUON_TRITON_VERSIONS:
        return None
    module = importlib.import_module(f"npu_attention.providers.triton_kernels.{name}")
    return module if module.HAVE_GLUON else None


def _hopper_prefill_kernels(device: torch.device):
    """The ``hopper_prefill`` module where ``device`` can run it, else ``None``."""
    return gluon_kernels(device, "hopper_prefill")


def _hopper_decode_kernels(device: torch.device):
    """The ``hopper_decode`` module where ``device`` can run it, else ``None``."""
    return gluon_kernels(device, "hopper_decode")


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _maxnreg(maxnreg: int | None, head_size: int) -> int | None:
    """A launch's register cap at ``head_size``: at least 128 above head size 128 (80
    registers spill a program's 256-wide tiles)."""
    if maxnreg is None or head_size <= 128:
        return maxnreg
    return max(maxnreg, 128)


def _multiprocessors(device: torch.device) -> int:
    # triton_kernels needs triton: imported on first use, like the kernels themselves.
    from npu_attention.providers.triton_kernels.utils import multiprocessor_count

    return multiprocessor_count(device)


def _scales(
    spec: AttentionSpec, scales: KVScales | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The key and value scales the kernels take: ``None`` for a cache in the model dtype."""
    if spec.kv_cache_dtype == "auto":
        return None, None
    if scales is None:
        raise ValueError(
            f"kv_cache_dtype={spec.kv_cache_dtype!r} needs scales (npu_attention.run's "
            "k_scale / v_scale), got None"
        )
    return scales.k, scales.v


def _check_tokens(
    label: str, tensor: torch.Tensor, heads: int, head_size: int, dtype: torch.dtype
) -> None:
    if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (heads, head_size):
        raise ValueError(
            f"{label} must be [tokens, {heads}, {head_size}], got {tuple(tensor.shape)}"
        )
    if tensor.dtype != dtype:
        raise TypeError(f"{label} must be {dtype}, got {tensor.dtype}")


def _check_lse(lse: torch.Tensor, query: torch.Tensor, tokens: int) -> None:
    heads = query.shape[1]
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    if lse.dim() != 2 or lse.shape[1] != heads or lse.shape[0] < tokens:
        raise ValueError(f"lse must be [>= {tokens}, {heads}], got {tuple(lse.shape)}")
    if lse.device != query.device:
        raise ValueError(f"lse must be on {query.device}, got {lse.device}")


def _check_caches(
    key_cache: torch.Tensor | None,
    value_cache: torch.Tensor | None,
    spec: AttentionSpec,
    device: torch.device,
) -> None:
    expected = (spec.block_size, spec.num_kv_heads, spec.head_size)
    for label, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache is None:
            raise ValueError(f"{label} is None while the other cache is given")
        if cache.dim() != 4 or tuple(cache.shape[1:]) != expected:
            raise ValueError(
                f"{label} must be [num_blocks, {', '.join(map(str, expected))}], "
                f"got {tuple(cache.shape)}"
            )
        if cache.dtype != spec.cache_dtype:
            raise TypeError(f"{label} must be {spec.cache_dtype}, got {cache.dtype}")
        if cache.device != device:
            raise ValueError(f"{label} must be on {device}, got {cache.device}")
    if key_cache.shape[0] != value_cache.shape[0]:
        raise ValueError(
            f"key_cache and value_cache must have the same number of blocks, got "
            f"{key_cache.shape[0]} and {value_cache.shape[0]}"
        )
