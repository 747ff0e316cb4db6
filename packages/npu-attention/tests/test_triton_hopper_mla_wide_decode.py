"""The warpgroup-MMA MLA decode (``hopper_mla_wide_decode``, Gluon) of the ``triton`` provider.

Steps whose requests have more than 32 rows of heads x query tokens (128 heads; 16
heads with 3 or 4 query tokens), from ``hopper_wide_min_decodes`` decodes, take this
kernel on a GPU of compute capability 9.x with Triton 3.6; the rest keep the
``mma.sync`` kernel (``test_triton_hopper_mla_decode.py``). The ``cuda`` cases run it
on a Hopper GPU against the float64 MLA oracle of ``mla_cases`` at the provider's
tolerance (bfloat16 2e-2, float16 3e-3): pages of 16 to 128 tokens with contexts on
either side of page and tile edges, NaN in every cache slot the batch does not hold,
2 to 4 query tokens a request, forced and chosen splits, the log-sum-exp with and
without splits, the token-interleaved cache in float16, and a CUDA graph replayed on
the next batch. Without a GPU, the choice of kernel, its program heads and its split
counts are checked.
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

from npu_attention import plan
from npu_attention.mla import MLASpec, mla_decode, mla_write_cache
from npu_attention.providers import triton as triton_provider
from npu_attention.providers import triton_mla
from npu_attention.providers.triton_mla import HopperMLALaunch, TritonMLAProvider

pytest.importorskip("triton")
hopper = pytest.importorskip("npu_attention.providers.triton_kernels.hopper_mla_decode")
wide = pytest.importorskip("npu_attention.providers.triton_kernels.hopper_mla_wide_decode")

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.x")


def _spec(num_heads: int = 128, spec_tokens: int = 0, **overrides: object) -> MLASpec:
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


# ---------------------------------------------------------------- the choice (any machine)


def _decodes(spec: MLASpec, batch: int, seq_len: int = 4096):
    """A plan (reference provider, on the CPU) of ``batch`` decodes of the spec's tokens."""
    tokens = 1 + spec.num_speculative_tokens
    return plan(
        [i * tokens for i in range(batch + 1)],
        [seq_len] * batch,
        torch.zeros(batch, 64, dtype=torch.int32),
        torch.full((batch * tokens,), -1, dtype=torch.int64),
        batch,
        spec,
        provider="reference",
    )


@pytest.fixture
def pretend_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both Gluon kernels offered on any device, and 132 multiprocessors (an H100 or H200)."""
    utils = pytest.importorskip("npu_attention.providers.triton_kernels.utils")
    monkeypatch.setattr(utils, "multiprocessor_count", lambda device: 132)
    modules = {"hopper_mla_decode": hopper, "hopper_mla_wide_decode": wide}
    monkeypatch.setattr(triton_mla, "gluon_kernels", lambda device, name: modules[name])


def test_devices_other_than_a_hopper_gpu_have_no_wide_kernel() -> None:
    assert triton_provider.gluon_kernels(torch.device("cpu"), "hopper_mla_wide_decode") is None
    assert TritonMLAProvider().hopper_launch_for(_decodes(_spec(), 64)) is None


@pytest.mark.parametrize(
    ("num_heads", "tokens", "rows", "programs"),
    [
        (128, 1, 64, 2),
        (128, 2, 64, 4),
        (128, 3, 64, 6),  # 384 rows: six full programs
        (128, 4, 64, 8),
        (16, 3, 48, 1),
        (16, 4, 64, 1),
        (20, 2, 40, 1),
        (100, 1, 64, 2),  # 64 + 36 rows
    ],
)
def test_programs_take_64_rows_of_heads_x_tokens(
    num_heads: int, tokens: int, rows: int, programs: int
) -> None:
    assert wide.program_rows(num_heads, tokens) == rows
    assert wide.programs_per_request(num_heads, tokens) == programs
    assert wide.shape_supported(512, 64, torch.bfloat16, 64, num_heads, tokens)


def test_shapes_the_wide_kernel_refuses() -> None:
    assert wide.shape_supported(512, 64, torch.float16, 8, 128, 1)
    assert not wide.shape_supported(512, 64, torch.bfloat16, 64, 16, 1)  # 16 rows
    assert not wide.shape_supported(512, 64, torch.bfloat16, 64, 16, 2)  # 32 rows
    assert not wide.shape_supported(512, 64, torch.bfloat16, 64, 20, 1)  # 20 rows
    assert not wide.shape_supported(256, 64, torch.bfloat16, 64, 128, 1)  # latent
    assert not wide.shape_supported(512, 32, torch.bfloat16, 64, 128, 1)  # rope
    assert not wide.shape_supported(512, 64, torch.float32, 64, 128, 1)  # dtype
    assert not wide.shape_supported(512, 64, torch.bfloat16, 4, 128, 1)  # page under 8 rows
    assert not wide.shape_supported(512, 64, torch.bfloat16, 48, 128, 1)  # page not a power of 2
    assert not wide.shape_supported(512, 64, torch.bfloat16, 64, 128, 0)  # no query token


@pytest.mark.parametrize(
    ("num_heads", "spec_tokens", "batch", "expected"),
    [
        (128, 0, 64, HopperMLALaunch(64, 64, 2, wide=True)),
        (128, 0, 256, HopperMLALaunch(64, 64, 2, wide=True)),
        (128, 0, 2, HopperMLALaunch(64, 64, 2, wide=True)),
        (128, 1, 64, HopperMLALaunch(64, 64, 2, wide=True)),
        (128, 3, 64, HopperMLALaunch(64, 64, 2, wide=True)),
        (16, 2, 64, HopperMLALaunch(48, 64, 2, wide=True)),  # 48 rows
        (16, 3, 64, HopperMLALaunch(64, 64, 2, wide=True)),
        (16, 0, 64, HopperMLALaunch(16, 64, 2)),  # 16 rows: mma.sync
        (16, 1, 64, HopperMLALaunch(16, 64, 2)),  # 32 rows: mma.sync
        (128, 0, 1, HopperMLALaunch(16, 64, 2)),  # one request: mma.sync, 8 programs
    ],
)
def test_kernel_choice_by_shape(
    num_heads: int, spec_tokens: int, batch: int, expected: HopperMLALaunch, pretend_hopper
) -> None:
    step = _decodes(_spec(num_heads, spec_tokens), batch)
    assert TritonMLAProvider().hopper_launch_for(step) == expected


def test_switch_and_smallest_batch_keep_the_mma_sync_kernel(pretend_hopper) -> None:
    provider = TritonMLAProvider()
    provider.hopper_wide_decode = False
    assert not provider.hopper_launch_for(_decodes(_spec(), 64)).wide
    provider = TritonMLAProvider()
    provider.hopper_wide_min_decodes = 65
    assert not provider.hopper_launch_for(_decodes(_spec(), 64)).wide
    assert provider.hopper_launch_for(_decodes(_spec(), 65)).wide
    assert provider.hopper_launch_for(_decodes(_spec(16, kv_lora_rank=256), 64)) is None


@pytest.mark.parametrize(
    ("spec_tokens", "batch", "expected"),
    [  # 132 multiprocessors, 4096 keys a request, 64-key tiles
        (0, 64, 1),  # 128 programs: one wave
        (0, 256, 1),  # 512 programs: 3.9 waves
        (0, 16, 4),  # 32 programs: 4 splits fill 128 of 132
        (0, 2, 32),  # 4 programs
        (3, 16, 1),  # 8 programs a request: 128
        (2, 16, 4),  # 6 programs a request: 96 (0.73 of a wave), 4 splits 384 (0.97 of 3)
        (1, 8, 4),  # 4 programs a request: 32, then 128
    ],
)
def test_wide_split_counts_fill_one_wave(
    spec_tokens: int, batch: int, expected: int, pretend_hopper
) -> None:
    step = _decodes(_spec(128, spec_tokens), batch)
    provider = TritonMLAProvider()
    launch = provider.hopper_launch_for(step)
    assert launch.wide
    assert provider._hopper_splits(step, launch) == expected


# ---------------------------------------------------------------- Hopper GPU


def _count_wide_launches(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """The split count of each call of the wide kernel's launcher from here on, and the
    calls of the ``mma.sync`` kernel's (which should be none)."""
    kernels = triton_provider.gluon_kernels(torch.device("cuda"), "hopper_mla_wide_decode")
    assert kernels is not None, "this GPU and Triton should take the wide kernel"
    narrow = triton_provider.gluon_kernels(torch.device("cuda"), "hopper_mla_decode")
    launches = record_launches(
        monkeypatch, kernels, "hopper_mla_wide_decode", lambda kw: kw["num_splits"]
    )
    return launches, record_launches(monkeypatch, narrow, "hopper_mla_decode")


WIDE_CASES = {
    # heads, speculative tokens, block size, context lens
    "page_edges_block_64": (128, 0, 64, [0, 1, 63, 64, 65, 127, 128, 129, 700, 2000]),
    "page_edges_block_16": (128, 0, 16, [0, 15, 16, 17, 31, 33, 500]),
    "block_128": (128, 0, 128, [1, 127, 128, 129, 1500]),
    "spec_2_tokens": (128, 1, 16, [0, 14, 15, 16, 62, 63, 600]),
    "spec_3_tokens": (128, 2, 64, [0, 61, 62, 63, 64, 1000]),
    "spec_4_tokens": (128, 3, 64, [1, 60, 61, 3000]),
    "heads_16_spec_3_tokens": (16, 2, 16, [0, 13, 14, 15, 16, 800]),
    "heads_16_spec_4_tokens": (16, 3, 64, [0, 60, 61, 62, 63, 1200]),
    "heads_20_spec_2_tokens": (20, 1, 16, [0, 15, 16, 300]),  # 40 rows, one program
    "heads_100": (100, 0, 32, [1, 31, 32, 33, 900]),  # 64 + 36 rows
}


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("num_kv_splits", [None, 1, 3, 16])
@pytest.mark.parametrize("case", list(WIDE_CASES))
def test_gpu_wide_decode_matches_oracle(
    case: str, num_kv_splits: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every case with the provider's split count (``None``) and forced ones; a chunked
    prefill rides along in the spec cases (its rows stay with the reference path)."""
    heads, spec_tokens, block_size, contexts = WIDE_CASES[case]
    spec = _spec(heads, spec_tokens, block_size=block_size)
    query_lens = [1 + spec_tokens] * len(contexts)
    num_decodes = len(contexts)
    if spec_tokens:  # a shorter decode and a prefill after the decodes
        query_lens, contexts = [*query_lens[:-1], 1, 7], [*contexts, 9]
    mla = make_mla_case(spec, query_lens, contexts, num_decodes, pad_tokens=3, device="cuda")
    launches, narrow = _count_wide_launches(monkeypatch)
    if num_kv_splits is not None:
        monkeypatch.setattr(
            TritonMLAProvider, "_hopper_splits", lambda self, step, launch: num_kv_splits
        )
    decode_out, prefill_out, _, step = run_mla_case(mla, provider="triton")
    assert step.provider_data.hopper.wide
    assert launches == [step.provider_data.num_kv_splits] and narrow == []
    assert_mla_matches_oracle(mla, decode_out, prefill_out)


@pytest.mark.cuda
@needs_hopper
def test_gpu_wide_decode_on_vllm_cache_views_in_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token-interleaved cache (views of vLLM's ``[blocks, block, 576]``), float16."""
    spec = _spec(128, 1, block_size=16, dtype=torch.float16)
    mla = make_mla_case(spec, [2, 2, 2], [0, 31, 400], 3, pad_tokens=1, device="cuda")
    launches, narrow = _count_wide_launches(monkeypatch)
    decode_out, prefill_out, _, _ = run_mla_case(mla, provider="triton", layout="interleaved")
    assert len(launches) == 1 and narrow == []
    assert_mla_matches_oracle(mla, decode_out, prefill_out)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("num_kv_splits", [1, 4, 32])
@pytest.mark.parametrize("spec_tokens", [0, 3])
def test_gpu_wide_decode_writes_the_log_sum_exp(
    num_kv_splits: int, spec_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(128, spec_tokens, block_size=16)
    q = 1 + spec_tokens
    mla = make_mla_case(spec, [q] * 3, [0, 40, 1000], 3, pad_tokens=2, device="cuda")
    monkeypatch.setattr(
        TritonMLAProvider, "_hopper_splits", lambda self, step, launch: num_kv_splits
    )
    launches, _ = _count_wide_launches(monkeypatch)
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
@pytest.mark.parametrize("num_kv_splits", [1, 8])
def test_gpu_wide_decode_replays_in_a_graph_on_the_next_batch(
    num_kv_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Captured once with fixed plan buffers, replayed for the next step (other lengths,
    pages, queries and latents): each replay matches the oracle of its own step."""
    monkeypatch.setattr(
        TritonMLAProvider, "_hopper_splits", lambda self, step, launch: num_kv_splits
    )
    launches, narrow = _count_wide_launches(monkeypatch)
    assert_decode_graph_replays(_spec(128, block_size=16))
    assert launches == [num_kv_splits] * 2 and narrow == []  # the eager call and the capture
