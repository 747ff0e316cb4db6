"""The Hopper decode kernel (``hopper_decode``, Gluon) of the ``triton`` provider.

Decodes and speculative decodes that read the pages take the Gluon kernel on a GPU of
compute capability 9.x; every other device, Triton version, feature (sliding window,
soft cap, float32, other head sizes) or cache layout keeps the portable kernel. The
``cuda`` cases run the kernel for real on a Hopper GPU and compare with the dense
float32 reference of ``test_triton_provider`` at its tolerances (float16 4e-3, bfloat16
3e-2). Every page slot the batch does not write is NaN, so a stale key or value that
reached the output would show; padding rows of ``out`` must stay untouched. Without a
GPU, the choice of kernel and the layouts it refuses are checked.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_triton_provider import Batch, assert_matches_reference, record_launches
from triton_interpreter import HAS_CUDA

from npu_attention.providers import triton as triton_provider
from npu_attention.providers.triton import TritonProvider, TritonStepData
from npu_attention.spec import AttentionSpec, BatchState

pytest.importorskip("triton")

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.x")


def _decode(
    spec: AttentionSpec, context_lens: list[int], pad_tokens: int = 3, seed: int = 0
) -> Batch:
    query_len = 1 + spec.num_speculative_tokens
    num_reqs = len(context_lens)
    batch = Batch(
        spec, [query_len] * num_reqs, context_lens, num_decodes=num_reqs,
        pad_tokens=pad_tokens, seed=seed,
    )  # fmt: skip
    assert batch.plan.state in (BatchState.DECODE_ONLY, BatchState.SPEC_DECODING)
    return batch


def _count_hopper_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The split count of each call of the Gluon decode's launcher from here on (the
    launches still run)."""
    kernels = triton_provider._hopper_decode_kernels(torch.device("cuda"))
    assert kernels is not None, "this GPU and Triton should take the Hopper kernel"
    return record_launches(monkeypatch, kernels, "hopper_decode", lambda kw: kw["num_splits"])


# ---------------------------------------------------------------- the choice (any machine)


def test_devices_other_than_a_hopper_gpu_keep_the_portable_kernel() -> None:
    assert triton_provider._hopper_decode_kernels(torch.device("cpu")) is None
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    assert not TritonProvider()._hopper_decode_takes(spec, 1, torch.device("cpu"))
    if HAS_CUDA and not HOPPER:
        assert triton_provider._hopper_decode_kernels(torch.device("cuda")) is None


def test_shapes_and_cache_layouts_the_kernel_refuses() -> None:
    hopper = pytest.importorskip("npu_attention.providers.triton_kernels.hopper_decode")
    assert hopper.shape_supported(128, torch.bfloat16, 16, 4)
    assert hopper.shape_supported(64, torch.float16, 8, 64)
    assert not hopper.shape_supported(96, torch.bfloat16, 16, 4)  # head size
    assert not hopper.shape_supported(128, torch.float32, 16, 4)  # dtype
    assert not hopper.shape_supported(128, torch.bfloat16, 4, 4)  # page under 8 rows
    assert not hopper.shape_supported(128, torch.bfloat16, 24, 4)  # page not a power of 2
    assert not hopper.shape_supported(128, torch.bfloat16, 16, 65)  # rows
    cache = torch.zeros(6, 16, 4, 128, dtype=torch.bfloat16)
    assert hopper._pages_take_descriptor(cache, torch.bfloat16)
    assert hopper._pages_take_descriptor(torch.zeros(2, 6, 16, 4, 128)[0].bfloat16(),
                                         torch.bfloat16)  # fmt: skip
    packed = torch.zeros(6, 4, 16, 256, dtype=torch.bfloat16).transpose(1, 2)[..., :128]
    assert not hopper._pages_take_descriptor(packed, torch.bfloat16)  # heads not adjacent
    interleaved = torch.zeros(6, 2, 16, 4, 128, dtype=torch.bfloat16)[:, 0]
    assert not hopper._pages_take_descriptor(interleaved, torch.bfloat16)  # pages apart
    assert not hopper._pages_take_descriptor(cache.half(), torch.bfloat16)


def test_page_orders_a_descriptor_addresses() -> None:
    """Token-major pages (vLLM's NHD), head-major pages (each KV head's tokens of a page
    contiguous, HND) and what neither is; the key and value caches must share one."""
    hopper = pytest.importorskip("npu_attention.providers.triton_kernels.hopper_decode")
    token_major = torch.zeros(6, 16, 4, 128, dtype=torch.int8)
    head_major = torch.zeros(6, 4, 16, 128, dtype=torch.int8).transpose(1, 2)
    assert hopper._page_order(token_major, torch.int8) == "token_major"
    assert hopper._page_order(head_major, torch.int8) == "head_major"
    one_head = torch.zeros(6, 1, 16, 128, dtype=torch.int8).transpose(1, 2)
    assert hopper._page_order(one_head, torch.int8) == "head_major"  # rows as token-major
    heads_apart = torch.zeros(6, 4, 2, 16, 128, dtype=torch.int8)[:, :, 0].transpose(1, 2)
    assert hopper._page_order(heads_apart, torch.int8) is None
    packed = torch.zeros(6, 4, 16, 256, dtype=torch.int8).transpose(1, 2)[..., :128]
    assert hopper._page_order(packed, torch.int8) is None  # K and V interleaved per token
    assert hopper._page_order(head_major, torch.float8_e4m3fn) is None  # dtype


@pytest.mark.parametrize(
    ("num_reqs", "longest", "expected_splits", "expected_long"),
    [  # 132 multiprocessors, 8 KV heads
        (16, 4096, 1, True),  # 128 programs, unsplit: 4096 keys each
        (16, 2048, 1, True),
        (16, 2047, 1, False),
        (4, 8192, 4, True),  # 32 programs, 4 splits: 2048 keys each
        (1, 4096, 16, False),  # 16 splits: 256 keys each
        (16, 512, 1, False),
    ],
)
def test_programs_of_long_shares_take_the_long_launch(
    num_reqs: int,
    longest: int,
    expected_splits: int,
    expected_long: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``prepare`` marks a Gluon decode whose programs read at least
    ``hopper_decode_long_keys`` keys each; the portable kernel's decodes never."""
    monkeypatch.setattr(triton_provider, "_multiprocessors", lambda device: 132)
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    plan = SimpleNamespace(
        state=BatchState.DECODE_ONLY, spec=spec, num_reqs=num_reqs, max_seq_len=longest,
        device=torch.device("cuda"),
    )  # fmt: skip
    provider = TritonProvider()
    monkeypatch.setattr(TritonProvider, "_hopper_decode_takes", lambda *_: True)
    step = provider.prepare(plan)
    assert (step.num_kv_splits, step.hopper_decode, step.hopper_long) == (
        expected_splits, True, expected_long,
    )  # fmt: skip
    monkeypatch.setattr(TritonProvider, "_hopper_decode_takes", lambda *_: False)
    assert not provider.prepare(plan).hopper_long


# ---------------------------------------------------------------- Hopper GPU

HOPPER_CASES = {
    # context lens, (heads, kv heads), head size, block size, dtype, speculative tokens
    "page_edges_block_16": ([0, 15, 16, 17, 63, 64, 65, 700], (32, 8), 128, 16,
                            torch.bfloat16, 0),
    "long_block_128": ([3000, 127, 128, 129, 1], (32, 8), 128, 128, torch.bfloat16, 0),
    "fp16_block_64": ([5, 63, 64, 65, 200, 1500], (32, 8), 128, 64, torch.float16, 0),
    "block_32_mha": ([31, 32, 33, 999], (16, 16), 128, 32, torch.bfloat16, 0),
    "gqa_7_head_64": ([1, 64, 500, 2047], (28, 4), 64, 16, torch.float16, 0),
    "head_256": ([3, 32, 33, 600], (8, 2), 256, 16, torch.bfloat16, 0),
    "head_256_block_64": ([63, 64, 1200], (16, 4), 256, 64, torch.float16, 0),
    "spec_2_tokens": ([0, 20, 64, 1000], (32, 8), 128, 16, torch.bfloat16, 2),
    "spec_3_tokens_block_128": ([1, 126, 127, 3000], (32, 8), 128, 128, torch.bfloat16, 3),
    "spec_15_mha_head_64": ([0, 16, 200], (4, 4), 64, 16, torch.float16, 15),
    "rows_24": ([0, 17, 300, 1000], (32, 4), 128, 16, torch.bfloat16, 2),
    "rows_64": ([10, 100, 1000], (64, 4), 128, 16, torch.bfloat16, 3),
}  # fmt: skip


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("num_kv_splits", [None, 1, 3, 16])
@pytest.mark.parametrize("case", list(HOPPER_CASES))
def test_gpu_hopper_decode_matches_reference(
    case: str, num_kv_splits: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every case with the provider's split count (``None``) and with forced ones."""
    contexts, (heads, kv_heads), head_size, block_size, dtype, spec_tokens = HOPPER_CASES[case]
    spec = AttentionSpec(
        heads, kv_heads, head_size, block_size=block_size, dtype=dtype,
        num_speculative_tokens=spec_tokens,
    )  # fmt: skip
    batch = _decode(spec, contexts)
    step = batch.plan.provider_data
    assert step.hopper_decode
    if num_kv_splits is not None:
        batch.plan.provider_data = TritonStepData(True, num_kv_splits, False, True)
    launches = _count_hopper_launches(monkeypatch)
    out = batch.run()
    assert_matches_reference(batch, out)
    assert launches == [num_kv_splits or step.num_kv_splits]
    assert out[batch.plan.num_actual_tokens :].isnan().all(), "padding rows must stay untouched"


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_hopper_decode_over_head_major_pages(
    block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same decodes over pages laid head-major (vLLM's HND order: each KV head's
    tokens of a page contiguous), one of them split over programs."""
    spec = AttentionSpec(8, 2, 128, block_size=block_size, dtype=torch.bfloat16)
    batch = _decode(spec, [15, 16, 17, 130, 3000])
    batch.key_cache, batch.value_cache = (
        c.transpose(1, 2).contiguous().transpose(1, 2) for c in (batch.key_cache, batch.value_cache)
    )
    kernels = triton_provider._hopper_decode_kernels(torch.device("cuda"))
    assert kernels._page_order(batch.key_cache, torch.bfloat16) == "head_major"
    launches = _count_hopper_launches(monkeypatch)
    out = batch.run()
    assert launches == [batch.plan.provider_data.num_kv_splits]
    assert_matches_reference(batch, out)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    "launch",
    [
        {"block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_n": 64, "num_warps": 4, "num_stages": 8},
        {"block_n": 64, "num_warps": 8, "num_stages": 2},
        {"block_n": 128, "num_warps": 4, "num_stages": 2},
        {"block_n": 128, "num_warps": 8, "num_stages": 3},
    ],
    ids=lambda launch: "-".join(f"{k}{v}" for k, v in launch.items()),
)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("num_kv_splits", [1, 5])
def test_gpu_hopper_decode_launch_settings(
    launch: dict, head_size: int, num_kv_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tile / warp / ring setting the provider can be given, beyond the default
    that every other case runs: rings shallower than a program's tiles (each stage
    reused many times) and deeper, wider tiles, eight consumer warps."""
    spec = AttentionSpec(32, 8, head_size, block_size=16, dtype=torch.bfloat16)
    batch = _decode(spec, [2000, 1, 700, 64, 129])
    batch.plan.provider.hopper_decode_launch = launch
    batch.plan.provider_data = TritonStepData(True, num_kv_splits, False, True)
    launches = _count_hopper_launches(monkeypatch)
    assert_matches_reference(batch, batch.run())
    assert launches == [num_kv_splits]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    ("num_reqs", "longest", "expected_splits"),
    [  # on an H100 (132 multiprocessors), 8 KV heads: as many as fit one wave
        (1, 3000, 16),  # 8 programs: 16 splits (the length allows 24)
        (1, 400, 4),  # shares of at least 128 keys
        (4, 3000, 4),  # 32 programs
        (16, 3000, 1),  # 128 programs: unsplit
    ],
)
def test_gpu_hopper_decode_split_choices(
    num_reqs: int, longest: int, expected_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the expected choices are an H100's")
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    batch = _decode(spec, [longest] + [(97 * r) % 700 for r in range(1, num_reqs)])
    assert batch.plan.provider_data.num_kv_splits == expected_splits
    launches = _count_hopper_launches(monkeypatch)
    assert_matches_reference(batch, batch.run())
    assert launches == [expected_splits]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_hopper_decode_long_shares(block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests whose programs read at least ``hopper_decode_long_keys`` keys take
    tiles of 128 keys, the other decodes 64 (the provider's own choice each time)."""
    spec = AttentionSpec(32, 8, 128, block_size=block_size, dtype=torch.bfloat16)
    num_reqs = torch.cuda.get_device_properties(0).multi_processor_count // 8
    kernels = triton_provider._hopper_decode_kernels(torch.device("cuda"))
    launches = record_launches(monkeypatch, kernels, "hopper_decode", lambda kw: kw["block_n"])
    long = _decode(spec, [2500] + [(97 * r) % 700 for r in range(1, num_reqs)])
    assert long.plan.provider_data.hopper_long
    assert_matches_reference(long, long.run())
    short = _decode(spec, [2500, 300])
    assert not short.plan.provider_data.hopper_long
    assert_matches_reference(short, short.run())
    assert launches == [128, 64]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("num_kv_splits", [1, 4])
@pytest.mark.parametrize("spec_tokens", [0, 2])
def test_gpu_hopper_decode_writes_the_log_sum_exp(
    num_kv_splits: int, spec_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = AttentionSpec(
        32, 8, 128, block_size=16, dtype=torch.float16, num_speculative_tokens=spec_tokens
    )
    batch = _decode(spec, [0, 40, 1000])
    batch.plan.provider_data = TritonStepData(True, num_kv_splits, False, True)
    launches = _count_hopper_launches(monkeypatch)
    provider = batch.plan.provider
    provider.write_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.plan)
    out = torch.full_like(batch.query, float("nan"))
    lse = torch.full((batch.query.shape[0], 32), float("nan"), device=batch.device)
    provider.attend(batch.query, batch.key_cache, batch.value_cache, batch.plan, out, lse=lse)
    assert launches == [num_kv_splits]
    assert_matches_reference(batch, out)
    real = batch.plan.num_actual_tokens
    expected = []
    for r, (n, c) in enumerate(zip(batch.query_lens, batch.context_lens)):
        start = sum(batch.query_lens[:r])
        q = batch.query[start : start + n].float().cpu()
        k = batch.keys[r].float().repeat_interleave(4, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.softmax_scale
        hidden = torch.arange(c + n)[None, :] > torch.arange(c, c + n)[:, None]
        expected.append(torch.logsumexp(scores.masked_fill(hidden, float("-inf")), -1).T)
    torch.testing.assert_close(lse[:real].cpu(), torch.cat(expected), atol=2e-3, rtol=2e-3)
    assert lse[real:].isnan().all(), "padding rows of lse must be left untouched"


@pytest.mark.cuda
@needs_hopper
def test_gpu_hopper_decode_ignores_stale_block_table_entries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entries past each sequence's pages (negative, past the cache) are never read."""
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    batch = _decode(spec, [5, 20, 40, 3])
    batch.block_tables[::2, -1] = -1
    batch.block_tables[1::2, -1] = batch.key_cache.shape[0] + 1000
    batch.plan.block_tables = batch.block_tables.to(batch.device)
    launches = _count_hopper_launches(monkeypatch)
    assert_matches_reference(batch, batch.run())
    assert launches == [batch.plan.provider_data.num_kv_splits]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    ("features", "packed_kv"),
    [
        ({"sliding_window": 100}, False),
        ({"logits_soft_cap": 30.0}, False),
        ({"dtype": torch.float32}, False),
        ({"head_size": 96}, False),
        ({}, True),
    ],
    ids=["window", "soft_cap", "float32", "head_96", "packed_kv_cache"],
)
def test_gpu_what_the_hopper_decode_lacks_stays_portable(
    features: dict, packed_kv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = {"dtype": torch.bfloat16, "head_size": 128, "block_size": 16, **features}
    spec = AttentionSpec(16, 4, **fields)
    batch = Batch(spec, [1] * 3, [300, 5, 64], num_decodes=3, pad_tokens=2, packed_kv=packed_kv)
    launches = _count_hopper_launches(monkeypatch)
    assert_matches_reference(batch, batch.run())
    assert launches == []


@pytest.mark.cuda
@needs_hopper
def test_gpu_decodes_of_more_than_one_wave_stay_portable(monkeypatch: pytest.MonkeyPatch) -> None:
    """More requests x KV heads than multiprocessors: the portable kernel, unsplit."""
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    num_reqs = torch.cuda.get_device_properties(0).multi_processor_count // 8 + 1
    batch = _decode(spec, [(37 * r) % 900 for r in range(num_reqs)])
    assert not batch.plan.provider_data.hopper_decode
    launches = _count_hopper_launches(monkeypatch)
    assert_matches_reference(batch, batch.run())
    assert launches == []


@pytest.mark.cuda
@needs_hopper
def test_gpu_hopper_decode_off_or_untested_triton_keeps_the_portable_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    batch = _decode(spec, [300, 5])
    launches = _count_hopper_launches(monkeypatch)
    batch.plan.provider.hopper_decode = False
    assert_matches_reference(batch, batch.run())
    assert not batch.plan.provider._hopper_decode_takes(spec, 2, batch.device)
    batch.plan.provider.hopper_decode = True
    monkeypatch.setattr(triton_provider, "_GLUON_TRITON_VERSIONS", ())
    triton_provider.gluon_kernels.cache_clear()
    try:
        assert triton_provider._hopper_decode_kernels(torch.device("cuda")) is None
        assert_matches_reference(batch, batch.run())
    finally:
        triton_provider.gluon_kernels.cache_clear()
    assert launches == []


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("num_kv_splits", [1, 16])
def test_gpu_hopper_decode_replays_in_a_graph_on_refreshed_inputs(
    num_kv_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Captured once, replayed on the next batch of the same shape (other lengths,
    pages, queries and K/V) copied into the captured buffers."""
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    first = _decode(spec, [4000, 70, 1500], pad_tokens=1)
    second = _decode(spec, [4001, 71, 1490], pad_tokens=1, seed=5)  # the same page counts
    for batch in (first, second):
        batch.plan.provider_data = TritonStepData(True, num_kv_splits, False, True)
    provider: TritonProvider = first.plan.provider
    launches = _count_hopper_launches(monkeypatch)
    out = torch.full_like(first.query, float("nan"))

    def step() -> None:
        provider.write_kv(first.key, first.value, first.key_cache, first.value_cache, first.plan)
        provider.attend(first.query, first.key_cache, first.value_cache, first.plan, out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for name in ("query", "key", "value", "key_cache", "value_cache"):
        getattr(first, name).copy_(getattr(second, name))
    for name in ("seq_lens", "slot_mapping", "block_tables", "cu_seqlens_q"):
        getattr(first.plan, name).copy_(getattr(second.plan, name))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(second, out)
    assert launches == [num_kv_splits] * 2  # the eager call and the capture
