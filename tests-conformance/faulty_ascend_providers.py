"""Ascend providers with one deliberate mistake each, to show the checks catch it."""

from __future__ import annotations

import dataclasses

import torch
from ascend_cases import HostAscendProvider

from npu_attention.providers import ascend


class PerRequestQueryLengths(HostAscendProvider):
    """Passes query lengths where TND wants cumulative ends."""

    def prepare(self, plan):
        return dataclasses.replace(super().prepare(plan), actual_seq_lengths=plan.query_lens_host)


class CumulativeKvLengths(HostAscendProvider):
    """Passes cumulative KV ends where paged attention wants per-request lengths."""

    def prepare(self, plan):
        data = super().prepare(plan)
        ends = torch.tensor(plan.seq_lens_host).cumsum(0).tolist()
        return dataclasses.replace(data, actual_seq_lengths_kv=ends)


class TopLeftCausal(HostAscendProvider):
    """Uses sparse_mode=2 (top-left causal): wrong once a request has cached context."""

    def prepare(self, plan):
        return dataclasses.replace(super().prepare(plan), sparse_mode=2)


class WindowOffByOne(HostAscendProvider):
    """Passes pre_tokens=W, one key too many for a W-token window."""

    def prepare(self, plan):
        return dataclasses.replace(super().prepare(plan), pre_tokens=plan.spec.sliding_window)


class LowerTriangularMask(HostAscendProvider):
    """Passes the keep-matrix (True on and below the diagonal) instead of the mask."""

    def prepare(self, plan):
        data = super().prepare(plan)
        return dataclasses.replace(data, atten_mask=~data.atten_mask)


class UndocumentedSparseMode(HostAscendProvider):
    """Passes a sparse_mode the fused op does not document."""

    def prepare(self, plan):
        return dataclasses.replace(super().prepare(plan), sparse_mode=7)


class PaddingSlotsPassed(HostAscendProvider):
    """Hands the padded slot mapping (with -1) to the KV write op."""

    def write_kv(self, key, value, key_cache, value_cache, plan):
        ascend.torch_npu_module().npu_scatter_pa_kv_cache(
            key, value, key_cache, value_cache, plan.slot_mapping, cache_mode="Norm"
        )


class PagedNzCacheMode(HostAscendProvider):
    """Leaves cache_mode at its PA_NZ default on ND caches."""

    def write_kv(self, key, value, key_cache, value_cache, plan):
        n = plan.num_actual_tokens
        ascend.torch_npu_module().npu_scatter_pa_kv_cache(
            key[:n], value[:n], key_cache, value_cache, plan.slot_mapping[:n]
        )


class SpecDecodeWithoutMask(HostAscendProvider):
    """Uses sparse_mode=0 without the mask in a verify step: draft tokens see later drafts."""

    def prepare(self, plan):
        return dataclasses.replace(super().prepare(plan), sparse_mode=0, atten_mask=None)
