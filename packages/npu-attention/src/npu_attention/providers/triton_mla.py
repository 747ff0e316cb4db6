"""The ``triton`` MLA provider: latent cache writes and absorbed decode as Triton kernels.

``prepare`` (once per step) picks the number of KV splits of the decode launch;
``write_cache`` and ``decode`` only launch kernels that read the step from the
plan's device tensors, so both can be captured in a device graph and replayed
after the plan's fixed buffers are refreshed. Prefill (non-absorbed) runs the
reference provider's PyTorch path on the same device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from npu_attention.mla.cache import LatentCache
from npu_attention.mla.spec import MLASpec
from npu_attention.plan import AttentionPlan
from npu_attention.providers.mla_base import require_cache
from npu_attention.providers.reference_mla import PrefillPages, ReferenceMLAProvider, prefill_pages

if TYPE_CHECKING:  # triton is optional: its kernels are imported where they run
    from npu_attention.providers.triton_kernels.mla_decode import MLADecodeConfig

_MAX_KV_SPLITS = 64


@dataclass(frozen=True)
class TritonMLAData:
    """``num_kv_splits``: decode programs along each request's keys; ``decode``: the
    step's decode launch, made once for every layer (``None`` without decodes);
    ``prefill``: the reference provider's prefill pages (``None`` without prefills)."""

    num_kv_splits: int
    prefill: PrefillPages | None
    decode: MLADecodeConfig | None = None


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
    """

    name: ClassVar[str] = "triton"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    returns_lse: ClassVar[bool] = True

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
        splits, decode = 1, None
        if plan.num_decodes:
            splits = self._num_kv_splits(plan)
            decode = self.decode_config(plan.spec, splits)
        prefill = prefill_pages(plan) if plan.num_decodes < plan.num_reqs else None
        return TritonMLAData(num_kv_splits=splits, prefill=prefill, decode=decode)

    def write_cache(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, plan: AttentionPlan
    ) -> None:
        from npu_attention.providers.triton_kernels.mla_cache_write import write_latent_cache

        write_latent_cache(
            kv_c, k_pe, cache.kv_c, cache.k_pe, plan.slot_mapping, plan.num_actual_tokens
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
        from npu_attention.providers.triton_kernels.mla_decode import mla_decode_attention

        spec = plan.spec
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
        )

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
