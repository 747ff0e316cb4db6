"""The Hopper MLA decode kernel (``hopper_mla_decode``, Gluon) of the ``triton`` provider.

MLA decodes at DeepSeek's widths (latent 512, rope 64, 16-bit) take the Gluon kernel
on a GPU of compute capability 9.x with Triton 3.6; every other device, Triton version,
width, dtype or tensor layout keeps the portable kernel. The ``cuda`` cases run the
kernel on a Hopper GPU against the float64 MLA oracle of ``mla_cases`` at the provider's
tolerance (bfloat16 2e-2, float16 3e-3): pages of 8 to 128 tokens with contexts on
either side of page edges, NaN in every cache slot the batch does not hold, speculative
decodes of 2 to 4 tokens, splits with the log-sum-exp, and a CUDA graph replayed on the
next batch. Without a GPU, the choice of kernel, its program rows and its split counts
are checked. The warpgroup-MMA kernel, which the provider takes for programs of more
than 32 rows, is switched off here (``test_triton_hopper_mla_wide_decode.py`` tests it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mla_cases import (
    assert_decode_graph_replays,
    assert_mla_matches_oracle,
    make_mla_case,
    oracle_decode_lse,
    run_mla_case,
)
from test_triton_provider import record_launches
from triton_interpreter import HAS_CUDA

from npu_attention import get_provider, plan
from npu_attention.mla import MLASpec, mla_decode, mla_write_cache
from npu_attention.providers import triton as triton_provider
from npu_attention.providers import triton_mla
from npu_attention.providers.triton_mla import HopperMLALaunch, TritonMLAProvider

pytest.importorskip("triton")
hopper = pytest.importorskip("npu_attention.providers.triton_kernels.hopper_mla_decode")

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.x")


@pytest.fixture(autouse=True)
def _without_the_wide_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step of this module on the ``mma.sync`` kernel."""
    monkeypatch.setattr(TritonMLAProvider, "_wide_launch", lambda self, step: None)


def _spec(num_heads: int = 16, spec_tokens: int = 0, **overrides: object) -> MLASpec:
    fields = dict(
        num_heads=num_heads,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        block_size=64,
        dtype=torch.bfloat16,
        num_speculative_tokens=spec_tokens,
    )
    return MLASpec(**{**fields, **overrides})


def _count_hopper_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The split count of each call of the Gluon kernel's launcher from here on."""
    kernels = triton_provider.gluon_kernels(torch.device("cuda"), "hopper_mla_decode")
    assert kernels is not None, "this GPU and Triton should take the Hopper kernel"
    return record_launches(monkeypatch, kernels, "hopper_mla_decode", lambda kw: kw["num_splits"])


# ---------------------------------------------------------------- the choice (any machine)


def _decodes(spec: MLASpec, batch: int, seq_len: int = 4096):
    """A plan (reference provider, on the CPU) of ``batch`` one-token decodes."""
    return plan(
        list(range(batch + 1)),
        [seq_len] * batch,
        torch.zeros(batch, 64, dtype=torch.int32),
        torch.full((batch,), -1, dtype=torch.int64),
        batch,
        spec,
        provider="reference",
    )


@pytest.fixture
def pretend_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon kernel offered on any device, and 132 multiprocessors (an H100 or H200)."""
    utils = pytest.importorskip("npu_attention.providers.triton_kernels.utils")
    monkeypatch.setattr(utils, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(triton_mla, "gluon_kernels", lambda device, name: hopper)


def test_devices_other_than_a_hopper_gpu_keep_the_portable_kernel() -> None:
    cpu = torch.device("cpu")
    assert triton_provider.gluon_kernels(cpu, "hopper_mla_decode") is None
    assert TritonMLAProvider().hopper_launch_for(_decodes(_spec(), 4)) is None
    if HAS_CUDA and not HOPPER:
        assert triton_provider.gluon_kernels(torch.device("cuda"), "hopper_mla_decode") is None


def test_widths_dtypes_and_pages_the_kernel_refuses() -> None:
    assert hopper.shape_supported(512, 64, torch.bfloat16, 64, 1)
    assert hopper.shape_supported(512, 64, torch.float16, 8, 512)  # 128 heads x 4 tokens
    assert not hopper.shape_supported(256, 64, torch.bfloat16, 64, 1)  # latent
    assert not hopper.shape_supported(512, 32, torch.bfloat16, 64, 1)  # rope
    assert not hopper.shape_supported(512, 64, torch.float32, 64, 1)  # dtype
    assert not hopper.shape_supported(512, 64, torch.bfloat16, 4, 1)  # page under 8 rows
    assert not hopper.shape_supported(512, 64, torch.bfloat16, 48, 1)  # page not a power of 2


def test_cache_layouts_a_descriptor_takes() -> None:
    planes = torch.zeros(6 * 16 * 576, dtype=torch.bfloat16)
    kv_c, k_pe = planes[: 6 * 16 * 512].view(6, 16, 512), planes[6 * 16 * 512 :].view(6, 16, 64)
    assert hopper._pages_take_descriptor(kv_c, torch.bfloat16)
    assert hopper._pages_take_descriptor(k_pe, torch.bfloat16)
    interleaved = torch.zeros(6, 16, 576, dtype=torch.bfloat16)  # vLLM's cache, as views
    for plane in interleaved.split([512, 64], dim=-1):
        assert hopper._pages_take_descriptor(plane, torch.bfloat16)
    pages_apart = torch.zeros(6, 2, 16, 512, dtype=torch.bfloat16)[:, 0]
    assert not hopper._pages_take_descriptor(pages_apart, torch.bfloat16)
    assert not hopper._pages_take_descriptor(kv_c.half(), torch.bfloat16)


@pytest.mark.parametrize(
    ("num_heads", "tokens", "expected"),
    [
        (16, 1, (16, 16)),  # DeepSeek-V3 on 8 ranks: one program of 16 rows
        (16, 2, (16, 32)),
        (16, 3, (16, 64)),  # 48 rows in a tile of 64
        (16, 4, (16, 64)),
        (128, 1, (64, 64)),  # two programs of 64 heads
        (128, 4, (16, 64)),  # eight programs of 16 heads x 4 tokens
        (20, 1, (32, 32)),  # heads rounded up to a power of two, the rest masked
        (1, 1, (1, 16)),
    ],
)
def test_program_rows(num_heads: int, tokens: int, expected: tuple[int, int]) -> None:
    heads, block_m = hopper.program_rows(num_heads, tokens)
    assert (heads, block_m) == expected
    assert hopper.consumer_warps(block_m) == (4 if block_m == 16 else 8)


@pytest.mark.parametrize(
    ("num_heads", "spec_tokens", "batch", "heads"),
    [
        (16, 0, 64, 16),
        (16, 0, 1, 16),
        (16, 1, 64, 16),  # 32 rows
        (128, 0, 64, 64),  # 128 programs of 64 heads: a quarter of the multiprocessors
        (128, 0, 16, 32),  # 32 programs of 64 heads are too few: 64 of 32
        (128, 0, 1, 16),  # 2 and 4 programs too: 8 of 16 heads
        (128, 3, 4, 16),  # 16 heads x 4 tokens, the fewest heads
    ],
)
def test_small_batches_of_many_heads_take_fewer_heads_a_program(
    num_heads: int, spec_tokens: int, batch: int, heads: int, pretend_hopper
) -> None:
    provider = TritonMLAProvider()
    launch = provider.hopper_launch
    step = _decodes(_spec(num_heads, spec_tokens), batch)
    assert provider.hopper_launch_for(step) == HopperMLALaunch(
        heads, launch["block_n"], launch["num_stages"]
    )


def test_other_widths_and_the_switch_keep_the_portable_kernel(pretend_hopper) -> None:
    provider = TritonMLAProvider()
    assert provider.hopper_launch_for(_decodes(_spec(16, kv_lora_rank=256), 4)) is None
    assert provider.hopper_launch_for(_decodes(_spec(16, dtype=torch.float32), 4)) is None
    provider.hopper_decode = False
    assert provider.hopper_launch_for(_decodes(_spec(16), 4)) is None


@pytest.mark.parametrize(
    ("num_heads", "batch", "min_share", "expected"),
    [  # 132 multiprocessors, 4096 keys a request
        (16, 1, 64, 64),  # one program: as many splits as 64-key shares allow, at most 64
        (16, 1, 128, 32),
        (16, 16, 64, 8),  # 128 programs: one wave
        (16, 64, 64, 2),
        (16, 256, 64, 1),  # two waves whatever the split: none
        (16, 3, 64, 32),  # 96 programs (41 splits: 123 programs, but shares of 2 tiles)
        (128, 64, 64, 1),  # 128 programs of 64 heads
        (128, 16, 64, 2),  # 64 programs of 32 heads
        (128, 1, 64, 16),  # 8 programs of 16 heads (15 would leave one split empty)
    ],
)
def test_split_counts_fill_the_multiprocessors(
    num_heads: int, batch: int, min_share: int, expected: int, pretend_hopper
) -> None:
    step = _decodes(_spec(num_heads), batch)
    provider = TritonMLAProvider()
    provider.hopper_min_tokens_per_split = min_share
    launch = provider.hopper_launch_for(step)
    assert provider._hopper_splits(step, launch) == expected
    provider.fixed_kv_splits = 5
    assert provider._hopper_splits(step, launch) == 5


# ---------------------------------------------------------------- Hopper GPU

HOPPER_CASES = {
    # heads, speculative tokens, block size, context lens
    "page_edges_block_64": (16, 0, 64, [0, 1, 63, 64, 65, 127, 128, 129, 700, 4000]),
    "page_edges_block_16": (16, 0, 16, [0, 15, 16, 17, 31, 33, 500]),
    "block_32": (16, 0, 32, [31, 32, 33, 300]),
    "block_128": (16, 0, 128, [1, 127, 128, 129, 2000]),
    "heads_128": (128, 0, 64, [5, 64, 65, 1500]),  # 16 heads a program
    "heads_128_batch_10": (128, 0, 16, [(97 * i) % 700 for i in range(10)]),  # 32 heads
    "heads_128_batch_20": (128, 0, 16, [(37 * i) % 900 for i in range(20)]),  # 64 heads
    "heads_20": (20, 0, 16, [3, 40, 129]),
    "spec_2_tokens": (16, 1, 16, [0, 14, 15, 16, 600]),
    "spec_3_tokens": (16, 2, 64, [0, 62, 63, 64, 1000]),
    "spec_4_tokens": (16, 3, 64, [1, 60, 61, 3000]),
    "spec_4_tokens_128_heads": (128, 3, 16, [0, 13, 700]),
}


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("num_kv_splits", [None, 1, 3, 16])
@pytest.mark.parametrize("case", list(HOPPER_CASES))
def test_gpu_hopper_mla_decode_matches_oracle(
    case: str, num_kv_splits: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every case with the provider's split count (``None``) and forced ones; a chunked
    prefill rides along in the spec cases (its rows stay with the reference path)."""
    heads, spec_tokens, block_size, contexts = HOPPER_CASES[case]
    spec = _spec(heads, spec_tokens, block_size=block_size)
    query_lens = [1 + spec_tokens] * len(contexts)
    num_decodes = len(contexts)
    if spec_tokens:  # a shorter decode and a prefill after the decodes
        query_lens, contexts = [*query_lens[:-1], 1, 7], [*contexts, 9]
    mla = make_mla_case(spec, query_lens, contexts, num_decodes, pad_tokens=3, device="cuda")
    launches = _count_hopper_launches(monkeypatch)
    if num_kv_splits is not None:
        monkeypatch.setattr(
            TritonMLAProvider, "_hopper_splits", lambda self, step, launch: num_kv_splits
        )
    decode_out, prefill_out, _, step = run_mla_case(mla, provider="triton")
    assert step.provider_data.hopper is not None
    assert launches == [step.provider_data.num_kv_splits]
    assert_mla_matches_oracle(mla, decode_out, prefill_out)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    ("num_heads", "spec_tokens", "ring"),
    [
        (16, 0, (64, 2)),
        (16, 0, (32, 2)),
        (16, 0, (32, 3)),
        (16, 0, (32, 4)),
        (128, 0, (64, 2)),
        (128, 0, (32, 2)),
        (128, 0, (32, 3)),
        (128, 0, (64, 1)),
        (16, 3, (64, 2)),
        (16, 3, (32, 2)),
        (16, 3, (64, 1)),
    ],
    ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else str(value),
)
@pytest.mark.parametrize("num_kv_splits", [1, 5])
def test_gpu_hopper_mla_decode_launch_settings(
    num_heads: int,
    spec_tokens: int,
    ring: tuple[int, int],
    num_kv_splits: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every ring (keys a tile, stages) the provider can be given, beyond the defaults
    that every other case runs: rings shallower than a program's tiles and deeper."""
    spec = _spec(num_heads, spec_tokens, block_size=16)
    q = 1 + spec_tokens
    mla = make_mla_case(spec, [q] * 4, [2000, 0, 700, 129], 4, pad_tokens=1, device="cuda")
    monkeypatch.setattr(
        TritonMLAProvider, "_hopper_splits", lambda self, step, launch: num_kv_splits
    )
    provider = get_provider("triton", torch.device("cuda"), family="mla")
    monkeypatch.setattr(provider, "hopper_launch", {"block_n": ring[0], "num_stages": ring[1]})
    monkeypatch.setattr(provider, "hopper_min_programs", 0)  # every head a program can take
    launches = _count_hopper_launches(monkeypatch)
    decode_out, prefill_out, _, step = run_mla_case(mla, provider="triton")
    hopper_launch = step.provider_data.hopper
    assert (hopper_launch.block_n, hopper_launch.stages) == ring
    assert launches == [num_kv_splits]
    assert_mla_matches_oracle(mla, decode_out, prefill_out)


@pytest.mark.cuda
@needs_hopper
def test_gpu_vllm_cache_views_and_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token-interleaved cache (views of vLLM's ``[blocks, block, 576]``), float16."""
    spec = _spec(16, 1, block_size=16, dtype=torch.float16)
    mla = make_mla_case(spec, [2, 2, 2], [0, 31, 400], 3, pad_tokens=1, device="cuda")
    launches = _count_hopper_launches(monkeypatch)
    decode_out, prefill_out, _, _ = run_mla_case(mla, provider="triton", layout="interleaved")
    assert len(launches) == 1
    assert_mla_matches_oracle(mla, decode_out, prefill_out)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("num_kv_splits", [1, 4, 32])
@pytest.mark.parametrize("spec_tokens", [0, 2])
def test_gpu_hopper_mla_decode_writes_the_log_sum_exp(
    num_kv_splits: int, spec_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(16, spec_tokens, block_size=16)
    q = 1 + spec_tokens
    mla = make_mla_case(spec, [q] * 3, [0, 40, 1000], 3, pad_tokens=2, device="cuda")
    monkeypatch.setattr(
        TritonMLAProvider, "_hopper_splits", lambda self, step, launch: num_kv_splits
    )
    launches = _count_hopper_launches(monkeypatch)
    paged = mla.paged(np.random.default_rng(0))
    step = plan(
        mla.cu_seqlens_q,
        mla.seq_lens,
        paged.block_tables.cuda(),
        paged.slot_mapping.cuda(),
        3,
        spec,
        provider="triton",
    )
    mla_write_cache(*mla.new_latents(), paged.cache, step)
    out = torch.full_like(mla.q_latent, float("nan"))
    lse = torch.full(out.shape[:2], float("nan"), device="cuda")
    mla_decode(mla.q_latent, mla.q_rope, paged.cache, step, out, lse=lse)
    assert launches == [num_kv_splits]
    rows = mla.num_decode_tokens
    torch.testing.assert_close(
        lse[:rows].double().cpu(), oracle_decode_lse(mla), atol=2e-3, rtol=2e-3
    )
    assert lse[rows:].isnan().all() and out[rows:].isnan().all(), "padding rows untouched"


@pytest.mark.cuda
@needs_hopper
def test_gpu_what_the_hopper_kernel_lacks_stays_portable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A query whose last stride is not 1, the switch off, an untested Triton."""
    spec = _spec(16, block_size=16)
    mla = make_mla_case(spec, [1, 1], [30, 300], 2, pad_tokens=1, device="cuda")
    launches = _count_hopper_launches(monkeypatch)
    q_latent = mla.q_latent
    rows = q_latent.shape[0]
    strides = (1, 512 * rows, rows)  # the last one is not 1
    mla.q_latent = torch.empty_strided(q_latent.shape, strides, dtype=q_latent.dtype, device="cuda")
    mla.q_latent.copy_(q_latent)
    decode_out, prefill_out, _, step = run_mla_case(mla, provider="triton")
    assert step.provider_data.hopper is not None
    assert_mla_matches_oracle(mla, decode_out, prefill_out)
    mla.q_latent = q_latent
    provider = step.provider
    provider.hopper_decode = False
    try:
        decode_out, prefill_out, _, step = run_mla_case(mla, provider="triton")
    finally:
        provider.hopper_decode = True
    assert step.provider_data.hopper is None
    assert_mla_matches_oracle(mla, decode_out, prefill_out)
    monkeypatch.setattr(triton_provider, "_GLUON_TRITON_VERSIONS", ())
    triton_provider.gluon_kernels.cache_clear()
    try:
        decode_out, prefill_out, _, step = run_mla_case(mla, provider="triton")
    finally:
        triton_provider.gluon_kernels.cache_clear()
    assert step.provider_data.hopper is None
    assert_mla_matches_oracle(mla, decode_out, prefill_out)
    assert launches == []


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("num_kv_splits", [1, 8])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_gpu_hopper_mla_decode_replays_in_a_graph_on_the_next_batch(
    num_kv_splits: int, num_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Captured once with fixed plan buffers, replayed for the next step (other lengths,
    pages, queries and latents): each replay matches the oracle of its own step."""
    monkeypatch.setattr(
        TritonMLAProvider, "_hopper_splits", lambda self, step, launch: num_kv_splits
    )
    launches = _count_hopper_launches(monkeypatch)
    assert_decode_graph_replays(_spec(num_heads, block_size=16))
    assert launches == [num_kv_splits] * 2  # the eager call and the capture
