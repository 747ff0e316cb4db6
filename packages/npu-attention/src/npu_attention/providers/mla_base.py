"""The interface every MLA kernel provider implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from npu_attention.mla.cache import LatentCache
from npu_attention.mla.run import KVUpProjection
from npu_attention.mla.spec import MLASpec
from npu_attention.plan import AttentionPlan


def require_cache(plan: AttentionPlan) -> None:
    """MLA reads every key from the latent cache: refuse a plan made without block tables.

    Raises:
        ValueError: ``plan`` was made with ``block_tables=None``.
    """
    if not plan.has_cache and plan.max_seq_len > 0:
        raise ValueError(
            "MLA reads every key from the latent cache: plan with block_tables, "
            "got block_tables=None"
        )


class MLAProvider(ABC):
    """One family of MLA kernels (reference PyTorch, Triton, torch_npu).

    ``prepare`` runs once per step (inside ``plan``); the other methods run once
    per layer and must not do host work that ``prepare`` could have done. Decode
    rows are the plan's first ``num_decode_tokens`` tokens; prefill rows are
    numbered from the first prefill token (``plan.num_decode_tokens``) on.
    """

    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]]
    # Whether ``decode`` can also write the rows' log-sum-exp (``lse=``).
    returns_lse: ClassVar[bool] = False
    # Whether ``write_cache`` / ``decode`` need contiguous latent, rope and query rows
    # (refused otherwise: see ``AttentionProvider.contiguous_inputs``).
    contiguous_inputs: ClassVar[bool] = False
    # ``MLASpec.kv_cache_dtype`` values the provider reads and writes (``plan`` refuses
    # others); one that takes ``fp8`` gets the latent cache's ``scale=`` in its calls.
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)

    @classmethod
    def is_available(cls) -> bool:
        """Whether the provider's dependencies import on this machine."""
        return True

    def supports_device(self, device: torch.device) -> bool:
        return device.type in self.device_types

    def check_spec(self, spec: MLASpec) -> None:  # noqa: B027 (no limits by default)
        """Refuse a spec the provider cannot run (called by ``plan`` before any work).

        Raises:
            ValueError / TypeError: naming the provider, what it takes and what came.
        """

    def prepare(self, plan: AttentionPlan) -> Any:
        """Build provider-specific step metadata; stored as ``plan.provider_data``."""
        return None

    @abstractmethod
    def write_cache(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, plan: AttentionPlan
    ) -> None:
        """Scatter ``kv_c`` ``[tokens, L]`` and ``k_pe`` ``[tokens, R]`` into ``cache`` at
        ``plan.slot_mapping``; slots ``< 0`` and tokens past ``num_actual_tokens`` are skipped."""

    def decode_heads(self, spec: MLASpec, with_lse: bool = False) -> int:
        """Query heads the decode kernel reads per row (``spec.num_heads`` unless the
        kernel takes only some head counts). A caller whose ``q_latent``, ``q_rope`` and
        ``out`` are the first ``spec.num_heads`` heads of contiguous ``[rows,
        decode_heads, D]`` buffers (the rest zero) lets the provider read and write them
        in place, with no copy inside a graph task."""
        return spec.num_heads

    @abstractmethod
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
        """Absorbed attention of the decode rows: ``q_latent`` ``[rows, N, L]`` and
        ``q_rope`` ``[rows, N, R]`` against the cached latents; writes ``out`` ``[rows, N, L]``
        (latent space) for rows ``< plan.num_decode_tokens``, and with ``lse`` (float32
        ``[rows, N]``, only asked of providers whose ``returns_lse`` is True) each such
        row's natural-log log-sum-exp of its scaled scores (``-inf`` with no key), once
        ``finish_decode`` has run after it."""

    def finish_decode(  # noqa: B027 (nothing to finish by default)
        self,
        q_latent: torch.Tensor,
        plan: AttentionPlan,
        out: torch.Tensor,
        *,
        lse: torch.Tensor | None = None,
    ) -> None:
        """The device work of a decode that is not its kernel (copies out of the
        kernel's own buffers, dtype conversions, rows without keys), run right after
        ``decode`` with the same arguments. A graph task holds ``decode`` alone, so that
        a task update re-issues only the kernel; this runs after the task, in the graph.
        ``decode`` must issue nothing but its kernel calls and views where the caller
        hands whole rows (``decode_heads``)."""

    @abstractmethod
    def prefill(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: AttentionPlan,
        kv_up_proj: KVUpProjection,
        out: torch.Tensor,
    ) -> None:
        """Non-absorbed attention of the prefill rows: ``query`` ``[rows, N, P + R]``
        against keys and values decompressed from the cached latents by ``kv_up_proj``;
        writes ``out`` ``[rows, N, V]`` for rows ``< plan.num_prefill_tokens``."""
