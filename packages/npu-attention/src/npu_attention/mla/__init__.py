"""Multi-head latent attention (DeepSeek-V2/V3 style) over a paged latent cache.

Planning is shared with GQA attention: ``npu_attention.plan(..., spec=MLASpec(...))``
picks an MLA provider (``reference``, ``triton``, ``ascend``) the same way.
"""

from npu_attention.mla.cache import (
    LatentCache,
    allocate_latent_cache,
    latent_cache_planes,
    split_latent_cache,
)
from npu_attention.mla.run import (
    mla_decode,
    mla_finish_decode,
    mla_prefill,
    mla_write_cache,
    up_projected_heads,
)
from npu_attention.mla.spec import MLASpec

__all__ = [
    "LatentCache",
    "MLASpec",
    "allocate_latent_cache",
    "latent_cache_planes",
    "mla_decode",
    "mla_finish_decode",
    "mla_prefill",
    "mla_write_cache",
    "split_latent_cache",
    "up_projected_heads",
]
