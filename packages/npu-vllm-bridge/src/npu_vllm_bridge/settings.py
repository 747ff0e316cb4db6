"""The bridge's platform settings, resolved once, and the prefix of its messages.

Each bridge platform (NPU, host) declares one frozen :class:`BridgeSettings`; the
attention backend and the graph wiring read it through :func:`current_settings`
and nowhere else. On a platform that is not the bridge's (vLLM's own CPU platform in
unit tests, say) the defaults apply: the provider npu-attention picks for the
device, packed K/V pages, no graph backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import npu_attention

PREFIX = "npu-vllm-bridge"
KV_CACHE_SPLITS = ("packed", "planes")


@dataclass(frozen=True)
class BridgeSettings:
    """What a bridge platform asks of npu-attention and npu-graphs.

    Attributes:
        attention_provider: npu-attention provider (``reference``, ``triton``,
            ``ascend``); ``None`` picks one by the platform's device type.
        kv_cache_split: what a KV page holds: ``packed`` (K and V side by side, vLLM's
            convention) or ``planes`` (all K, then all V: Ascend's paged kernels).
        graph_backend: npu-graphs backend (``npu``, ``host``); ``None``: no graphs.
        capture_longest_context: whether captures plan the longest context a block
            table addresses (an NPU task's workspace must cover every replay); host
            graphs re-run their tasks with each step's plan and need not.
        capture_on_first_use: capture each batch size's graphs the first time a step
            of that size runs, instead of all of them at start-up (host graphs: start-up
            at vLLM's default 256 requests would record 1616 graphs first).
    """

    attention_provider: str | None = None
    kv_cache_split: str = "packed"
    graph_backend: str | None = None
    capture_longest_context: bool = True
    capture_on_first_use: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_split not in KV_CACHE_SPLITS:
            raise ValueError(
                f"kv_cache_split must be one of {KV_CACHE_SPLITS}, got {self.kv_cache_split!r}"
            )

    def provider_name(self, device_type: str, family: str = "attention") -> str:
        """The npu-attention provider of ``family`` (``attention`` or ``mla``) these
        settings run on a ``device_type`` device."""
        if self.attention_provider is not None:
            return self.attention_provider
        return npu_attention.get_provider(device=device_type, family=family).name


def current_settings() -> BridgeSettings:
    """The current vLLM platform's settings (its ``bridge_settings``), else the defaults."""
    from vllm.platforms import current_platform

    # vLLM platforms answer None for attributes they lack.
    settings = getattr(current_platform, "bridge_settings", None)
    return settings if isinstance(settings, BridgeSettings) else BridgeSettings()


def current_provider(family: str = "attention") -> str:
    """The npu-attention provider of ``family`` the current platform runs."""
    from vllm.platforms import current_platform

    return current_settings().provider_name(current_platform.device_type, family)


def refuse_kv_cache_dtype(kv_cache_dtype: str | None, family: str = "attention") -> None:
    """Raise ``ValueError`` unless the current platform's npu-attention provider of
    ``family`` (``attention`` or ``mla``) takes ``kv_cache_dtype`` (``None``: ``auto``),
    naming the kinds it takes."""
    if kv_cache_dtype in (None, "auto"):
        return
    provider = current_provider(family)
    accepted = npu_attention.supported_kv_cache_dtypes(provider, family)
    if kv_cache_dtype not in accepted:
        layers = "MLA layers" if family == "mla" else "attention layers"
        raise ValueError(
            f"{PREFIX} does not support kv_cache_dtype={kv_cache_dtype!r} for {layers} with "
            f"the {provider!r} attention provider; it takes kv_cache_dtype in {list(accepted)}"
        )
