"""Verify steps of speculative decoding as the bridge plans them, padded to a graph size.

vLLM pads a uniform verify batch (``1 + k`` query tokens per request) up to a captured
size with requests of query length 0 on the null block. The bridge's builders
(``npu_vllm_bridge.attention.builder.fill_padding_requests``, used for GQA and MLA)
give each padding request ``1 + k`` of the spare tokens and as many keys of the
null block, with slot -1: the cumulative query ends are multiples of ``1 + k`` up to
the padded token count, and every request of the op has 1 to 16 query tokens. The
batches here are that layout, built from the ``spec_decoding`` cases: the real
requests first, then ``PADDING_REQUESTS`` padding requests.
"""

from __future__ import annotations

import dataclasses

import torch
from ascend_cases import CASES, Batch, build_batch
from ascend_mla_cases import MLA_CASES, MLABatch, build_mla_batch

PADDING_REQUESTS = 2
NULL_BLOCK = 0


def _spec_case(cases):
    return next(case for case in cases if case.name == "spec_decoding")


def _padded_lengths(cu_seqlens_q, seq_lens, block_tables, padding_len: int):
    """Cumulative query ends, KV lengths and block table with the padding requests."""
    cu = list(cu_seqlens_q)
    for _ in range(PADDING_REQUESTS):
        cu.append(cu[-1] + padding_len)
    null_rows = torch.full(
        (PADDING_REQUESTS, block_tables.shape[1]), NULL_BLOCK, dtype=block_tables.dtype
    )
    return cu, [*seq_lens, *[padding_len] * PADDING_REQUESTS], torch.cat([block_tables, null_rows])


def gqa_verify_batch(seed: int = 0) -> Batch:
    """The ``spec_decoding`` case (3 requests of ``1 + 2`` tokens) and 2 padding requests
    of 3 tokens each, as the bridge plans a verify batch padded from 9 to 15 tokens."""
    case = _spec_case(CASES)
    batch = build_batch(case, seed)
    q = 1 + case.num_speculative_tokens
    cu, seq_lens, tables = _padded_lengths(
        batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, q
    )
    extra = PADDING_REQUESTS * q
    generator = torch.Generator().manual_seed(seed + 1)

    def more(rows: torch.Tensor) -> torch.Tensor:
        pad = torch.randn(extra, *rows.shape[1:], generator=generator).to(rows.dtype)
        return torch.cat([rows, pad])

    return dataclasses.replace(
        batch,
        case=dataclasses.replace(case, num_decodes=case.num_decodes + PADDING_REQUESTS),
        cu_seqlens_q=cu,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=torch.cat([batch.slot_mapping, torch.full((extra,), -1)]),
        query=more(batch.query),
        key=more(batch.key),
        value=more(batch.value),
    )


def mla_verify_batch(padding_len: int | None = None, seed: int = 0) -> MLABatch:
    """The MLA ``spec_decoding`` case (2 requests of ``1 + 2`` tokens) and 2 padding
    requests of ``padding_len`` tokens each (default ``1 + k``, the bridge's layout).
    The null block holds zeros (vLLM allocates KV caches zeroed)."""
    case = _spec_case(MLA_CASES)
    batch = build_mla_batch(case, seed)
    q = 1 + case.num_speculative_tokens
    padding_len = q if padding_len is None else padding_len
    cu, seq_lens, tables = _padded_lengths(
        batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, padding_len
    )
    extra = PADDING_REQUESTS * q  # the padded token count is the same either way
    if padding_len == 0:  # vLLM's own layout: padding requests without tokens or keys
        seq_lens = [*batch.seq_lens, *[0] * PADDING_REQUESTS]
    generator = torch.Generator().manual_seed(seed + 1)
    cache = batch.cache
    if NULL_BLOCK not in batch.block_tables.flatten().tolist():
        cache.kv_c[NULL_BLOCK].zero_()
        cache.k_pe[NULL_BLOCK].zero_()

    def more(rows: torch.Tensor) -> torch.Tensor:
        pad = torch.randn(extra, *rows.shape[1:], generator=generator).to(rows.dtype)
        return torch.cat([rows, pad])

    return dataclasses.replace(
        batch,
        case=dataclasses.replace(case, num_decodes=case.num_decodes + PADDING_REQUESTS),
        cu_seqlens_q=cu,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=torch.cat([batch.slot_mapping, torch.full((extra,), -1)]),
        kv_c=more(batch.kv_c),
        k_pe=more(batch.k_pe),
        q_latent=more(batch.q_latent),
        q_rope=more(batch.q_rope),
    )
