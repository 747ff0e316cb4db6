"""The Hopper prefill kernel (``hopper_prefill``, Gluon) of the ``triton`` provider.

A prefill without cached context given its own K/V rows takes the Gluon kernel on a
GPU of compute capability 9.x; every other device, Triton version, feature (sliding
window, soft cap) or row layout keeps the portable kernel. The ``cuda`` cases run
the kernel for real on a Hopper GPU and compare with the dense float32 reference of
``test_triton_provider`` at its tolerances (float16 4e-3, bfloat16 3e-2), pages left
NaN so that only the step's own rows can produce the output; padding rows of ``out``
must stay untouched. Without a GPU, the choice of kernel is checked.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_provider import (
    Batch,
    assert_matches_reference,
    attend_with_own_rows,
    record_launches,
)
from triton_interpreter import HAS_CUDA

from npu_attention.providers import triton as triton_provider
from npu_attention.providers.triton import TritonProvider
from npu_attention.spec import AttentionSpec, BatchState

pytest.importorskip("triton")

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.x")


def _prefill(spec: AttentionSpec, query_lens: list[int], pad_tokens: int = 3) -> Batch:
    batch = Batch(spec, query_lens, [0] * len(query_lens), pad_tokens=pad_tokens)
    assert batch.plan.state is BatchState.PREFILL_NO_CACHE
    return batch


def _count_hopper_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the Gluon kernel's launcher from here on (the launches still run)."""
    kernels = triton_provider._hopper_prefill_kernels(torch.device("cuda"))
    assert kernels is not None, "this GPU and Triton should take the Hopper kernel"
    return record_launches(monkeypatch, kernels, "hopper_prefill")


# ---------------------------------------------------------------- the choice (any machine)


def test_devices_other_than_a_hopper_gpu_keep_the_portable_kernel() -> None:
    assert triton_provider._hopper_prefill_kernels(torch.device("cpu")) is None
    if HAS_CUDA and not HOPPER:
        assert triton_provider._hopper_prefill_kernels(torch.device("cuda")) is None


def test_rows_a_descriptor_cannot_take_are_refused() -> None:
    hopper = pytest.importorskip("npu_attention.providers.triton_kernels.hopper_prefill")
    rows = torch.zeros(10, 4, 128, dtype=torch.bfloat16)
    assert hopper._rows_take_descriptor(rows, torch.bfloat16, 128)
    strided_heads = torch.zeros(10, 128, 4, dtype=torch.bfloat16).transpose(1, 2)
    assert not hopper._rows_take_descriptor(strided_heads, torch.bfloat16, 128)
    odd_row_stride = torch.zeros(10, 4 * 128 + 1, dtype=torch.bfloat16)[:, :512].view(10, 4, 128)
    assert not hopper._rows_take_descriptor(odd_row_stride, torch.bfloat16, 128)
    assert not hopper._rows_take_descriptor(rows.half(), torch.bfloat16, 128)


def test_output_goes_through_shared_memory_where_it_fits() -> None:
    """Two 64-row output tiles beside the query tile and the K/V stages in 224 KiB:
    whole rows, half rows (stored in two halves of columns) or none."""
    hopper = pytest.importorskip("npu_attention.providers.triton_kernels.hopper_prefill")
    assert hopper.output_tile_cols(128, 128, 128, 2) == 128
    assert hopper.output_tile_cols(64, 64, 128, 3) == 64
    assert hopper.output_tile_cols(128, 128, 128, 3) == 0
    assert hopper.output_tile_cols(192, 128, 128, 2) == 64  # MLA's widths
    assert hopper.output_tile_cols(256, 256, 64, 2) == 128


def test_gpu_cases_cover_both_work_orders() -> None:
    """The GPU cases below take both work orders: a fixed stride (fewer tokens than
    ``DYNAMIC_MIN_TOKENS``) and pairs from the run-time counter (at least that many)."""
    hopper = pytest.importorskip("npu_attention.providers.triton_kernels.hopper_prefill")
    tokens = [sum(case[0]) for case in HOPPER_CASES.values()]
    assert min(tokens) < hopper.DYNAMIC_MIN_TOKENS <= max(tokens)


# ---------------------------------------------------------------- Hopper GPU

HOPPER_CASES = {
    # query lens, (heads, kv heads), head size, dtype, causal
    "one_tile_edges": ([1, 63, 64, 65, 127, 128, 129], (32, 8), 128, torch.bfloat16, True),
    "long_mixed": ([2048, 300, 1000, 17], (32, 8), 128, torch.bfloat16, True),
    "fp16_non_causal": ([1, 200, 513], (32, 8), 128, torch.float16, False),
    "mha_head_64": ([5, 64, 200, 511], (16, 16), 64, torch.bfloat16, True),
    "gqa_7_head_128": ([333, 77], (28, 4), 128, torch.float16, True),
    "head_256": ([5, 64, 200, 511], (8, 2), 256, torch.bfloat16, True),
    "head_256_non_causal": ([130, 7], (8, 1), 256, torch.float16, False),
    # DYNAMIC_MIN_TOKENS and more: pairs from the run-time counter, a KV head at a time
    "dynamic_pairs": ([4096, 333, 1000, 17], (32, 8), 128, torch.bfloat16, True),
}


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("case", list(HOPPER_CASES))
def test_gpu_hopper_prefill_matches_reference(
    case: str, stages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    query_lens, (heads, kv_heads), head_size, dtype, causal = HOPPER_CASES[case]
    spec = AttentionSpec(heads, kv_heads, head_size, block_size=16, dtype=dtype, causal=causal)
    batch = _prefill(spec, query_lens)
    batch.plan.provider.hopper_prefill_stages = stages
    launches = _count_hopper_launches(monkeypatch)
    assert_matches_reference(batch, attend_with_own_rows(batch))
    assert launches == [1]


@pytest.mark.cuda
@needs_hopper
def test_gpu_hopper_prefill_output_rows_a_descriptor_cannot_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``out`` whose heads are not adjacent (a view of wider rows) is written from
    registers; its other columns and the padding rows stay untouched."""
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    batch = _prefill(spec, [1, 129, 700])
    wide = torch.full((*batch.query.shape[:2], 256), float("nan"), device=batch.device)
    wide = wide.to(torch.bfloat16)
    out = wide[..., :128]
    launches = _count_hopper_launches(monkeypatch)
    batch.plan.provider.attend(
        batch.query, batch.key_cache, batch.value_cache, batch.plan, out, batch.key, batch.value
    )
    assert launches == [1]
    assert_matches_reference(batch, out)
    assert wide[..., 128:].isnan().all()


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_hopper_prefill_writes_the_log_sum_exp(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=dtype)
    batch = _prefill(spec, [1, 129, 700])
    launches = _count_hopper_launches(monkeypatch)
    out = torch.full_like(batch.query, float("nan"))
    lse = torch.full((batch.query.shape[0], 32), float("nan"), device=batch.device)
    batch.plan.provider.attend(
        batch.query, batch.key_cache, batch.value_cache, batch.plan, out,
        batch.key, batch.value, lse=lse,
    )  # fmt: skip
    assert launches == [1]
    assert_matches_reference(batch, out)
    real = batch.plan.num_actual_tokens
    expected = []
    for r, n in enumerate(batch.query_lens):
        start = sum(batch.query_lens[:r])
        q = batch.query[start : start + n].float().cpu()
        k = batch.keys[r].float().repeat_interleave(4, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.softmax_scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        expected.append(torch.logsumexp(scores, -1).T)
    torch.testing.assert_close(lse[:real].cpu(), torch.cat(expected), atol=2e-3, rtol=2e-3)
    assert lse[real:].isnan().all(), "padding rows of lse must be left untouched"


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    "features",
    [
        {"sliding_window": 100},
        {"logits_soft_cap": 30.0},
        {"dtype": torch.float32},
        {"head_size": 96},
    ],
    ids=["window", "soft_cap", "float32", "head_96"],
)
def test_gpu_what_the_hopper_kernel_lacks_stays_portable(
    features: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = {"dtype": torch.bfloat16, "head_size": 128, **features}
    spec = AttentionSpec(16, 4, block_size=16, **fields)
    batch = _prefill(spec, [300, 5])
    launches = _count_hopper_launches(monkeypatch)
    assert_matches_reference(batch, attend_with_own_rows(batch))
    assert launches == []


@pytest.mark.cuda
@needs_hopper
def test_gpu_hopper_prefill_off_or_untested_triton_keeps_the_portable_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    batch = _prefill(spec, [300, 5])
    launches = _count_hopper_launches(monkeypatch)
    batch.plan.provider.hopper_prefill = False
    assert_matches_reference(batch, attend_with_own_rows(batch))
    batch.plan.provider.hopper_prefill = True
    monkeypatch.setattr(triton_provider, "_GLUON_TRITON_VERSIONS", ())
    triton_provider.gluon_kernels.cache_clear()
    try:
        assert triton_provider._hopper_prefill_kernels(torch.device("cuda")) is None
        assert_matches_reference(batch, attend_with_own_rows(batch))
    finally:
        triton_provider.gluon_kernels.cache_clear()
    assert launches == []


@pytest.mark.cuda
@needs_hopper
def test_gpu_hopper_prefill_replays_in_a_graph_on_refreshed_inputs() -> None:
    """Captured with one batch's rows, replayed after the next batch of the same shape
    is copied into them (the descriptors hold the buffers' addresses)."""
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    first, second = _prefill(spec, [700, 129, 3]), Batch(spec, [700, 129, 3], [0] * 3, seed=4)
    provider: TritonProvider = first.plan.provider
    out = torch.full_like(first.query, float("nan"))

    def attend() -> None:
        provider.attend(
            first.query, first.key_cache, first.value_cache, first.plan, out,
            first.key, first.value,
        )  # fmt: skip

    attend()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend()
    for name in ("query", "key", "value"):
        getattr(first, name)[: getattr(second, name).shape[0]].copy_(getattr(second, name))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    second_out = out[: second.query.shape[0]]
    real = second.plan.num_actual_tokens
    tol = 3e-2
    torch.testing.assert_close(
        second_out[:real].float().cpu(), second.reference(), atol=tol, rtol=tol
    )


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    "heads, causal", [((16, 16), True), ((8, 2), True), ((16, 16), False)], ids=str
)
def test_gpu_hopper_prefill_mla_widths(heads: tuple[int, int], causal: bool) -> None:
    """192-wide queries and keys (read as 128 + 64 columns) with 128-wide values, as
    MLA's prefill has them: output and log-sum-exp against float32 attention, request
    lengths across the tile edges; rows past the requests untouched."""
    from npu_attention.providers.triton_kernels.hopper_prefill import (
        hopper_prefill,
        hopper_prefill_supported,
    )

    num_heads, kv_heads = heads
    query_lens, pad = [1, 63, 64, 65, 128, 129, 300], 3
    tokens = sum(query_lens)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    query, key = rand(tokens + pad, num_heads, 192), rand(tokens + pad, kv_heads, 192)
    value = rand(tokens + pad, kv_heads, 128)
    out = torch.full((tokens + pad, num_heads, 128), float("nan"), device="cuda")
    out = out.to(torch.bfloat16)
    lse = torch.full((tokens + pad, num_heads), float("nan"), device="cuda")
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device="cuda")
    assert hopper_prefill_supported(query, key, value, out)
    scale = 192**-0.5
    hopper_prefill(
        query, key, value, out, cu.int(), scale=scale, causal=causal, lse=lse
    )  # fmt: skip
    group = num_heads // kv_heads
    for r, n in enumerate(query_lens):
        rows = slice(int(cu[r]), int(cu[r]) + n)
        q = query[rows].float()
        k = key[rows].float().repeat_interleave(group, dim=1)
        v = value[rows].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            hidden = torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        torch.testing.assert_close(out[rows].float(), expected, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse[rows], torch.logsumexp(scores, -1).T, atol=2e-3, rtol=2e-3)
    assert out[tokens:].isnan().all() and lse[tokens:].isnan().all()
