"""What the bridge's attention can serve, in one place: block sizes, head sizes, dtypes,
and the refusal of layer options the kernels do not have.

The platforms' start-up checks, the backend classes vLLM selects and the layer impls
all ask here, so a rule changes in one line. The platform modules import this one
while vLLM resolves its platform, so it imports no vLLM module at import time.
"""

from __future__ import annotations

from typing import Any

import torch

import npu_attention
from npu_vllm_bridge.settings import PREFIX, current_provider, refuse_kv_cache_dtype

KERNEL_BLOCK_SIZES = (16, 32, 64, 128)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(npu_attention.SUPPORTED_DTYPES)


def attention_head_sizes() -> tuple[str, tuple[int, ...]]:
    """The npu-attention provider the current platform runs and the head sizes it takes."""
    provider = current_provider()
    return provider, tuple(npu_attention.supported_head_sizes(provider))


def refuse_head_size(head_size: int, what: str) -> None:
    """Raise ``ValueError`` when the current provider cannot take ``head_size``
    (``what``: the model or layer, for the message)."""
    provider, head_sizes = attention_head_sizes()
    if head_size not in head_sizes:
        raise ValueError(
            f"{PREFIX} does not support head size {head_size} ({what}) with the {provider!r} "
            f"attention provider; supported head sizes: {list(head_sizes)}"
        )


def refuse_layer_options(
    *,
    alibi_slopes: list[float] | None,
    kv_cache_dtype: str,
    attn_type: str,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    extra: dict[str, Any] | None = None,
    mla: bool = False,
) -> None:
    """Raise ``ValueError`` naming the first layer option the bridge cannot run.

    GQA layers take sliding windows and soft caps; MLA layers (``mla=True``) take
    neither. ``extra``: the impl's remaining keyword arguments (attention sinks,
    an MLA indexer, anything unknown), refused when set.
    """
    from vllm.v1.attention.backend import AttentionType

    kind = "MLA" if mla else "attention"
    if alibi_slopes is not None:
        raise ValueError(f"{PREFIX} {kind} does not support ALiBi (alibi_slopes)")
    if mla and sliding_window is not None:
        raise ValueError(f"{PREFIX} MLA does not support sliding-window MLA layers")
    if mla and logits_soft_cap:
        raise ValueError(f"{PREFIX} MLA does not support a logits soft cap")
    refuse_kv_cache_dtype(kv_cache_dtype, "mla" if mla else "attention")
    if attn_type != AttentionType.DECODER:
        raise ValueError(
            f"{PREFIX} supports decoder self-attention only, got attn_type={attn_type!r}"
        )
    extra = {name: value for name, value in (extra or {}).items() if value is not None}
    if "sinks" in extra:
        raise ValueError(f"{PREFIX} does not support attention sinks")
    if "indexer" in extra:
        raise ValueError(f"{PREFIX} does not support sparse MLA (an indexer)")
    if extra:
        raise ValueError(f"{PREFIX} does not support the attention options {sorted(extra)}")
