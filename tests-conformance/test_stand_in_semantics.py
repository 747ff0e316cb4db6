"""The stand-in computes what torch_npu's documentation says, checked on small cases.

Masks by ``sparse_mode`` (op-plugin's sparse-mode introduction: 2 = causal from the
top-left corner, 3 = causal from the bottom-right corner, 4 = band of
``pre_tokens`` / ``next_tokens`` around the bottom-right diagonal), the
``softmax_lse`` output, and paged K/V gathered through ``block_table``.
"""

from __future__ import annotations

import math

import torch
from schema_stand_in import visible_keys

# 2 queries over 4 keys; 1 = the query sees the key.
TOP_LEFT_CAUSAL = [[1, 0, 0, 0], [1, 1, 0, 0]]
BOTTOM_RIGHT_CAUSAL = [[1, 1, 1, 0], [1, 1, 1, 1]]
BAND_PRE_1_NEXT_0 = [[0, 1, 1, 0], [0, 0, 1, 1]]


def test_masks_follow_the_documented_sparse_modes() -> None:
    assert visible_keys(2, 4, 2, 0, 0).int().tolist() == TOP_LEFT_CAUSAL
    assert visible_keys(2, 4, 3, 0, 0).int().tolist() == BOTTOM_RIGHT_CAUSAL
    assert visible_keys(2, 4, 4, 1, 0).int().tolist() == BAND_PRE_1_NEXT_0
    assert bool(visible_keys(2, 4, 0, 0, 0).all())


def test_fused_attention_lse_and_paging(stand_in) -> None:
    generator = torch.Generator().manual_seed(0)
    heads, head_size, block_size = 2, 64, 128
    query = torch.randn(3, heads, head_size, generator=generator).half()
    cache = torch.randn(4, block_size, heads, head_size, generator=generator).half()
    values = torch.randn(4, block_size, heads, head_size, generator=generator).half()
    table = torch.tensor([[2, 0]], dtype=torch.int32)  # request 0: block 2, then block 0
    kv_len = 130
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    out, lse = stand_in.npu_fused_infer_attention_score(
        query,
        cache.view(4, block_size, -1),
        values.view(4, block_size, -1),
        atten_mask=mask,
        actual_seq_lengths=[3],
        actual_seq_lengths_kv=[kv_len],
        block_table=table,
        num_heads=heads,
        scale=1 / math.sqrt(head_size),
        input_layout="TND",
        num_key_value_heads=heads,
        sparse_mode=3,
        block_size=block_size,
        softmax_lse_flag=True,
    )
    keys = torch.cat([cache[2], cache[0]])[:kv_len].double()
    vals = torch.cat([values[2], values[0]])[:kv_len].double()
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) / math.sqrt(head_size)
    visible = torch.arange(kv_len)[None, :] <= torch.arange(3)[:, None] + kv_len - 3
    scores = scores.masked_fill(~visible, float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
    assert lse.shape == (3, heads, 1) and lse.dtype == torch.float32
    assert torch.allclose(lse.double(), scores.logsumexp(-1).T.unsqueeze(-1), atol=1e-4)
    assert torch.allclose(out.double(), expected, atol=2e-3, rtol=2e-3)
