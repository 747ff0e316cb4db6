"""The interface every kernel provider implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from npu_attention.plan import AttentionPlan
from npu_attention.spec import AttentionSpec

# The head sizes vLLM's CPU attention backend (CPU_ATTN) accepts.
VLLM_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class AttentionProvider(ABC):
    """One family of kernels (reference PyTorch, Triton, torch_npu).

    A provider is stateless across steps except for caches of its own workspace.
    ``prepare`` runs once per step (inside ``plan``); ``write_kv`` and ``attend`` run
    once per layer (inside ``run``) and must not do host work that ``prepare``
    could have done, nor synchronize with the host on the decode path.
    """

    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]]
    # Head sizes the provider's kernels take; ``plan`` refuses any other.
    head_sizes: ClassVar[tuple[int, ...]] = VLLM_HEAD_SIZES
    # Whether ``attend`` can also write the rows' log-sum-exp (``lse=``).
    returns_lse: ClassVar[bool] = False
    # Whether ``write_kv`` / ``attend`` need contiguous query, key, value and out rows
    # (they refuse others instead of copying: a copy inside a graph task would run
    # outside the graph when the task is re-issued). Callers make them contiguous first.
    contiguous_inputs: ClassVar[bool] = False
    # ``AttentionSpec.kv_cache_dtype`` values the provider reads and writes (``plan``
    # refuses others); a provider that takes quantized kinds gets ``scales=`` in
    # ``write_kv`` and ``attend``.
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    # Whether a step of several query tokens per request (a speculative verify step)
    # over quantized pages can be a captured graph task: a provider that dequantizes
    # such pages with torch ops first cannot have that work re-issued by a task update.
    quantized_verify_in_graphs: ClassVar[bool] = True

    @classmethod
    def is_available(cls) -> bool:
        """Whether the provider's dependencies import on this machine."""
        return True

    def supports_device(self, device: torch.device) -> bool:
        return device.type in self.device_types

    def check_spec(self, spec: AttentionSpec) -> None:
        """Refuse a spec the provider cannot run (called by ``plan`` before any work).

        Raises:
            ValueError: a head size not in ``head_sizes``, naming the provider and its sizes
                (``plan`` checks ``kv_cache_dtypes`` itself).
        """
        if spec.head_size not in self.head_sizes:
            raise ValueError(
                f"attention provider {self.name!r} does not support head_size="
                f"{spec.head_size}; its head sizes are {list(self.head_sizes)}"
            )

    def prepare(self, plan: AttentionPlan) -> Any:
        """Build provider-specific step metadata; stored as ``plan.provider_data``."""
        return None

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> None:
        """Scatter ``key``/``value`` ``[tokens, kv_heads, head_size]`` into the caches
        ``[num_blocks, block_size, kv_heads, head_size]`` at ``plan.slot_mapping``;
        slots ``< 0`` are padding and are skipped.

        A provider with quantized ``kv_cache_dtypes`` also takes ``scales``
        (``npu_attention.kv_quant.KVScales``, checked by ``run``) for a quantized spec:
        it quantizes with per-tensor scales, or writes per-token-head scales beside the
        rows."""

    @abstractmethod
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
    ) -> None:
        """Write attention of ``query`` ``[tokens, heads, head_size]`` into ``out``
        (same shape). Reads K/V from the caches; when the caches are ``None``
        (encoder attention without a cache) reads ``key``/``value`` directly.

        ``lse``: ``None``, or float32 ``[tokens, heads]`` that gets each real row's
        natural-log log-sum-exp of its scores (``-inf``, with an ``out`` row of zeros,
        for a row that sees no key).

        A quantized spec's pages are read dequantized (``scales=``, as in ``write_kv``),
        except that a ``PREFILL_NO_CACHE`` step given its own ``key``/``value`` may
        attend over those rows unquantized."""
