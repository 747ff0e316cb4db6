"""Bad MLA input raises ValueError / TypeError naming what was expected and what came."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mla_cases import SMALL_SPEC, make_mla_case

from npu_attention import AttentionSpec, get_provider, plan, run
from npu_attention.mla import (
    MLASpec,
    allocate_latent_cache,
    latent_cache_planes,
    mla_decode,
    mla_prefill,
    mla_write_cache,
    split_latent_cache,
)

SPEC = MLASpec(**SMALL_SPEC, block_size=16, dtype=torch.float32)


def _step(spec: MLASpec = SPEC, **overrides):
    arguments = dict(
        cu_seqlens_q=[0, 1, 4],
        seq_lens=[10, 3],
        block_tables=[[1], [2]],
        slot_mapping=[25, 32, 33, 34],
        num_decodes=1,
        spec=spec,
    )
    arguments.update(overrides)
    return plan(**arguments)


def _cache(spec: MLASpec = SPEC):
    return allocate_latent_cache(4, spec)


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("num_heads", 0, ValueError, r"num_heads must be an int in \[1, 1024\], got 0"),
        ("kv_lora_rank", 16.0, ValueError, r"kv_lora_rank must be an int .*got 16.0"),
        ("qk_rope_head_dim", True, ValueError, r"qk_rope_head_dim must be an int .*got True"),
        ("v_head_dim", 2048, ValueError, r"v_head_dim must be an int in \[1, 1024\], got 2048"),
        ("kv_lora_rank", 1020, ValueError, r"latent_dim must be <= 1024, got 1028"),
        ("block_size", 24, ValueError, r"block_size must be a multiple of 16 .*got 24"),
        ("dtype", torch.int8, TypeError, r"dtype must be one of .*got torch.int8"),
        ("scale", -1.0, ValueError, r"scale must be positive or None, got -1.0"),
        ("num_speculative_tokens", -1, ValueError, r"num_speculative_tokens must be .*got -1"),
    ],
)
def test_spec_refusals(field: str, value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        MLASpec(**{**SMALL_SPEC, "block_size": 16, field: value})


def test_spec_derived_widths_and_scale() -> None:
    assert (SPEC.latent_dim, SPEC.qk_head_dim) == (40, 24)
    assert SPEC.softmax_scale == pytest.approx(24**-0.5)
    assert MLASpec(**SMALL_SPEC, block_size=16, scale=0.5).softmax_scale == 0.5


def test_cache_helpers_refuse_bad_storage() -> None:
    with pytest.raises(ValueError, match=r"latent cache must be \[num_blocks, 16, 40\], got"):
        split_latent_cache(torch.zeros(2, 16, 41), SPEC)
    with pytest.raises(TypeError, match=r"latent cache must have dtype torch\.float32"):
        split_latent_cache(torch.zeros(2, 16, 40, dtype=torch.float16), SPEC)
    with pytest.raises(ValueError, match="whole blocks of 16 x 40 elements, got 100"):
        latent_cache_planes(torch.zeros(100), SPEC)
    with pytest.raises(ValueError, match="storage must be contiguous"):
        latent_cache_planes(torch.zeros(16 * 40, 2)[:, 0], SPEC)
    planes = latent_cache_planes(torch.zeros(2, 16, 40), SPEC)
    assert planes.kv_c.is_contiguous() and planes.k_pe.is_contiguous()
    assert planes.kv_c.shape == (2, 16, 32) and planes.k_pe.shape == (2, 16, 8)


def test_plan_picks_mla_providers_and_refuses_unknown_ones() -> None:
    step = _step()
    assert step.provider is get_provider("reference", family="mla")
    with pytest.raises(ValueError, match=r"unknown MLA attention provider 'nope'; expected one"):
        _step(provider="nope")
    with pytest.raises(TypeError, match="spec must be an AttentionSpec or an MLASpec, got dict"):
        _step(spec={})
    with pytest.raises(ValueError, match="provider family must be one of"):
        get_provider("reference", family="sparse")


def test_gqa_run_refuses_mla_plans_and_mla_refuses_gqa_plans() -> None:
    step = _step()
    x = torch.zeros(4, 4, 24)
    with pytest.raises(TypeError, match="run takes plans made for an AttentionSpec, got one"):
        run(x, x, x, None, None, step, x)
    gqa = plan([0, 1], [1], [[0]], [0], 1, AttentionSpec(4, 4, 64, 16, dtype=torch.float32))
    with pytest.raises(TypeError, match="plans made for an MLASpec, got one for AttentionSpec"):
        mla_decode(
            torch.zeros(1, 4, 32), torch.zeros(1, 4, 8), _cache(), gqa, torch.zeros(1, 4, 32)
        )


def test_mla_needs_a_paged_cache() -> None:
    with pytest.raises(ValueError, match="plan with block_tables, got block_tables=None"):
        _step(block_tables=None, slot_mapping=None, seq_lens=[1, 3])


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        ("write_short_kv_c", ValueError, r"kv_c must have >= 4 rows, got 3"),
        ("write_wide_k_pe", ValueError, r"k_pe must have shape \[\*, 8\], got \(4, 9\)"),
        ("write_half_k_pe", TypeError, r"k_pe must have dtype torch.float32, got torch.float16"),
        ("decode_wide_latent", ValueError, r"q_latent must have shape \[\*, 4, 32\], got"),
        ("decode_short_out", ValueError, r"out must have >= 1 rows, got 0"),
        ("decode_list", TypeError, r"q_rope must be a torch.Tensor, got list"),
        ("prefill_query", ValueError, r"query must have shape \[\*, 4, 24\], got \(3, 4, 32\)"),
        ("prefill_out", ValueError, r"out must have shape \[\*, 4, 24\], got \(3, 4, 16\)"),
        ("prefill_not_callable", TypeError, "kv_up_proj must be callable, got Tensor"),
        ("prefill_projection", ValueError, r"kv_up_proj must map \[\d+, 32\] to \[\d+, 160\]"),
        ("prefill_projection_dtype", TypeError, "kv_up_proj must return torch.float32"),
        ("cache_blocks", ValueError, "must have as many blocks, got 4 and 3"),
        ("cache_pair", TypeError, "cache must be a LatentCache"),
        ("cache_shape", ValueError, r"cache.kv_c must be \[num_blocks, 16, 32\], got"),
    ],
)
def test_per_layer_refusals(call: str, error: type, message: str) -> None:
    step, cache = _step(), _cache()
    kv_c, k_pe = torch.zeros(4, 32), torch.zeros(4, 8)
    q_latent, q_rope, out = torch.zeros(1, 4, 32), torch.zeros(1, 4, 8), torch.zeros(1, 4, 32)
    query, prefill_out = torch.zeros(3, 4, 24), torch.zeros(3, 4, 24)
    weight = torch.randn(4 * 40, 32)
    calls = {
        "write_short_kv_c": lambda: mla_write_cache(kv_c[:3], k_pe, cache, step),
        "write_wide_k_pe": lambda: mla_write_cache(kv_c, torch.zeros(4, 9), cache, step),
        "write_half_k_pe": lambda: mla_write_cache(kv_c, k_pe.half(), cache, step),
        "decode_wide_latent": lambda: mla_decode(torch.zeros(1, 4, 33), q_rope, cache, step, out),
        "decode_short_out": lambda: mla_decode(q_latent, q_rope, cache, step, out[:0]),
        "decode_list": lambda: mla_decode(q_latent, [0.0], cache, step, out),
        "prefill_query": lambda: mla_prefill(
            torch.zeros(3, 4, 32), cache, step, lambda x: x @ weight.T, prefill_out
        ),
        "prefill_out": lambda: mla_prefill(
            query, cache, step, lambda x: x @ weight.T, torch.zeros(3, 4, 16)
        ),
        "prefill_not_callable": lambda: mla_prefill(query, cache, step, weight, prefill_out),
        "prefill_projection": lambda: mla_prefill(
            query, cache, step, lambda x: x @ weight[:100].T, prefill_out
        ),
        "prefill_projection_dtype": lambda: mla_prefill(
            query, cache, step, lambda x: (x @ weight.T).double(), prefill_out
        ),
        "cache_blocks": lambda: mla_decode(
            q_latent, q_rope, (cache.kv_c, cache.k_pe[:3]), step, out
        ),
        "cache_pair": lambda: mla_decode(q_latent, q_rope, cache.kv_c, step, out),
        "cache_shape": lambda: mla_decode(
            q_latent, q_rope, (torch.zeros(4, 8, 32), cache.k_pe), step, out
        ),
    }
    with pytest.raises(error, match=message):
        calls[call]()


def test_slot_padding_and_rows_past_the_step_are_never_written() -> None:
    case = make_mla_case(SPEC, [1, 3], [9, 0], 1, pad_tokens=2)
    cache = _cache()
    step = _step(slot_mapping=[25, -1, 33, 34, -1, -1])
    kv_c, k_pe = case.new_latents()
    mla_write_cache(kv_c, k_pe, cache, step)
    written = np.zeros(4 * 16, dtype=bool)
    written[[25, 33, 34]] = True
    flat = cache.kv_c.reshape(-1, 32)
    assert (flat[~torch.from_numpy(written)] == 0).all()
    torch.testing.assert_close(flat[[25, 33, 34]], kv_c[[0, 2, 3]])
