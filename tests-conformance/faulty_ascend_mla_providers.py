"""Ascend MLA providers with one deliberate mistake each, to show the checks catch it."""

from __future__ import annotations

import dataclasses
import math

from ascend_mla_cases import HostAscendMLAProvider

from npu_attention.mla import LatentCache
from npu_attention.providers import ascend_mla


class CumulativeDecodeKvLengths(HostAscendMLAProvider):
    """Passes cumulative KV ends where paged decode wants per-request lengths."""

    def prepare(self, plan):
        data = super().prepare(plan)
        ends, total = [], 0
        for length in data.decode_seq_kvlen:
            total += length
            ends.append(total)
        return dataclasses.replace(data, decode_seq_kvlen=ends)


class CausalMaskForSingleTokens(HostAscendMLAProvider):
    """Uses sparse_mode=3 with the mask for one-token decodes (documented: 0, no mask)."""

    def prepare(self, plan):
        return dataclasses.replace(super().prepare(plan), decode_sparse_mode=3)


class SpecDecodeWithoutMask(HostAscendMLAProvider):
    """Uses sparse_mode=0 for speculative decoding: draft tokens would see later drafts."""

    def prepare(self, plan):
        return dataclasses.replace(super().prepare(plan), decode_sparse_mode=0)


class InterleavedCacheViews(HostAscendMLAProvider):
    """Hands the fused op strided views of an interleaved latent cache."""

    def decode(self, q_latent, q_rope, cache, plan, out):
        latent = cache.kv_c.new_empty(*cache.kv_c.shape[:2], 576)
        latent[..., :512], latent[..., 512:] = cache.kv_c, cache.k_pe
        views = LatentCache(latent[..., :512], latent[..., 512:])
        ascend_mla._check_planes = lambda cache: None  # the mistake: skip the check
        try:
            super().decode(q_latent, q_rope, views, plan, out)
        finally:
            ascend_mla._check_planes = _CHECK_PLANES


class AbsorbedScale(HostAscendMLAProvider):
    """Scales prefill scores by 1/sqrt(L + R) (the absorbed width) instead of the spec's."""

    def prefill(self, query, cache, plan, kv_up_proj, out):
        wrong = dataclasses.replace(plan.spec, scale=1 / math.sqrt(576))
        super().prefill(query, cache, dataclasses.replace(plan, spec=wrong), kv_up_proj, out)


class RopeAsQuery(HostAscendMLAProvider):
    """Puts the rotary query where the latent query goes (and a latent slice as rope)."""

    def decode(self, q_latent, q_rope, cache, plan, out):
        import torch

        swapped = torch.zeros_like(q_latent)
        swapped[..., :64] = q_rope
        super().decode(swapped, q_latent[..., :64].contiguous(), cache, plan, out)


class TopLeftCausalPrefill(HostAscendMLAProvider):
    """Prefill with sparse_mode=2 (top-left causal), which TND MLA does not take."""

    def prefill(self, query, cache, plan, kv_up_proj, out):
        original = ascend_mla.SPARSE_CAUSAL
        ascend_mla.SPARSE_CAUSAL = 2
        try:
            super().prefill(query, cache, plan, kv_up_proj, out)
        finally:
            ascend_mla.SPARSE_CAUSAL = original


class LseKeylessRowsUnmasked(HostAscendMLAProvider):
    """Takes the ATB op's rows of requests of KV length 0 as they come (undocumented)."""

    def finish_decode(self, q_latent, plan, out, *, lse=None):
        import torch

        every_row_keyed = dataclasses.replace(plan, seq_lens=torch.ones_like(plan.seq_lens))
        super().finish_decode(q_latent, every_row_keyed, out, lse=lse)


class LseUnpaddedHeads(HostAscendMLAProvider):
    """Passes the spec's head count to ATB's MLA unpadded (it takes 8/16/32/64/128)."""

    def decode(self, q_latent, q_rope, cache, plan, out, *, lse=None):
        original = ascend_mla.ATB_MLA_HEADS
        ascend_mla.ATB_MLA_HEADS = tuple(range(1, 129))
        try:
            super().decode(q_latent, q_rope, cache, plan, out, lse=lse)
        finally:
            ascend_mla.ATB_MLA_HEADS = original


class LseWithoutRingCalcType(HostAscendMLAProvider):
    """Asks for the LSE with the default calc type (only calc_type_ring outputs it)."""

    def decode(self, q_latent, q_rope, cache, plan, out, *, lse=None):
        original = ascend_mla.ATB_MLA_CALC_TYPE
        ascend_mla.ATB_MLA_CALC_TYPE = "calc_type_undefined"
        try:
            super().decode(q_latent, q_rope, cache, plan, out, lse=lse)
        finally:
            ascend_mla.ATB_MLA_CALC_TYPE = original


class LseInFloat32(HostAscendMLAProvider):
    """Hands ATB's MLA a float32 LSE buffer (documented: the query's float16/bf16)."""

    def _decode_scratch(self, call, shape, dtype, device, made=False):
        import torch

        buffers = super()._decode_scratch(call, shape, dtype, device, made)
        if call != "lse":
            return buffers
        result, lse = buffers
        return result, lse.to(torch.float32)


_CHECK_PLANES = ascend_mla._check_planes
