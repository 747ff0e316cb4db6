"""The ``triton`` MLA provider over an fp8 latent cache (``kv_cache_dtype`` ``fp8`` /
``fp8_e4m3``, one float32 scale for the cache, as vLLM's MLA layers keep it).

Every batch state against the float64 MLA oracle on the dequantized latents
(``test_mla_kv_quant._dequantized``), at ``MLA_TOLERANCE``; the rows written as e4m3
codes of ``x / scale``; the quantization error against the unquantized latents.
Unmarked cases run small shapes on the CPU through Triton's interpreter (float32);
``cuda`` cases take DeepSeek-V3's widths in bfloat16 (the portable decode: the Gluon
decodes keep an ``auto`` cache) and replay the decode from a CUDA graph for the next
step.
"""

from __future__ import annotations

import pytest
import torch
from mla_cases import MLA_TOLERANCE, make_mla_case, oracle_decode, oracle_prefill
from test_mla_kv_quant import STATES, _dequantized, _quantized_paged, _scale, _spec
from triton_interpreter import DEVICE, HAS_CUDA

from npu_attention import get_provider, kv_quant, plan
from npu_attention.mla import LatentCache, mla_decode, mla_prefill, mla_write_cache
from npu_attention.plan import PlanBuffers

pytest.importorskip("triton")

DEEPSEEK = dict(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128)  # fmt: skip


@pytest.fixture
def triton_mla():
    """The registry's triton MLA provider, its tunables restored afterwards."""
    provider = get_provider("triton", DEVICE, family="mla")
    saved = dict(vars(provider))
    yield provider
    vars(provider).update(saved)


def _run(case, scale: torch.Tensor):
    """plan (triton) + fp8 cache write + decode + prefill; outputs start at -3."""
    paged = _quantized_paged(case, scale.cpu())
    device = case.q_rope.device
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables.to(device),
                paged.slot_mapping.to(device), case.num_decodes, case.spec,
                provider="triton")  # fmt: skip
    kv_c, k_pe = case.new_latents()
    cache = LatentCache(*(plane.to(device) for plane in paged.cache))
    scale = scale.to(device)
    mla_write_cache(kv_c, k_pe, cache, step, k_scale=scale)
    decode_out = torch.full_like(case.q_latent, -3.0)
    prefill_out = case.query.new_full(
        (case.query.shape[0], case.spec.num_heads, case.spec.v_head_dim), -3.0
    )
    mla_decode(case.q_latent, case.q_rope, cache, step, decode_out, k_scale=scale)
    mla_prefill(case.query, cache, step, case.kv_up_proj, prefill_out, k_scale=scale)
    return decode_out.cpu(), prefill_out.cpu(), paged, cache, step


def _check(case, scale, decode_out, prefill_out, paged, cache) -> None:
    """Both outputs against the oracle on the dequantized latents; padding rows
    untouched; the step's rows written as codes of ``x / scale`` (on a GPU, whose
    float32 division is not correctly rounded, at most one e4m3 step off)."""
    expected = _dequantized(case, scale.to(case.q_rope.device))
    nd, npf = case.num_decode_tokens, case.num_tokens - case.num_decode_tokens
    tolerance = MLA_TOLERANCE[case.spec.dtype]
    torch.testing.assert_close(decode_out[:nd].double(), oracle_decode(expected), **tolerance)
    torch.testing.assert_close(prefill_out[:npf].double(), oracle_prefill(expected), **tolerance)
    assert (decode_out[nd:] == -3.0).all() and (prefill_out[npf:] == -3.0).all()
    bs, n = case.spec.block_size, case.num_tokens
    slots = paged.slot_mapping[:n]
    kv_c, k_pe = case.new_latents()
    for plane, rows in ((cache.kv_c, kv_c), (cache.k_pe, k_pe)):
        codes = kv_quant.quantize_per_tensor(rows[:n].cpu(), scale.cpu())
        written = plane.cpu()[slots // bs, slots % bs]
        if HAS_CUDA:
            step = torch.clamp(codes.float().abs() / 8, min=2.0**-9)
            assert ((written.float() - codes.float()).abs() <= step + 1e-6).all()
        else:
            assert torch.equal(written.view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.parametrize("kind", ["fp8", "fp8_e4m3"])
@pytest.mark.parametrize("name", list(STATES))
def test_batch_states_against_the_dequantized_latents(kind: str, name: str) -> None:
    query_lens, context_lens, num_decodes, spec_tokens = STATES[name]
    spec = _spec(kind, num_speculative_tokens=spec_tokens)
    case = make_mla_case(spec, query_lens, context_lens, num_decodes, pad_tokens=2,
                         device=DEVICE)  # fmt: skip
    scale = _scale(case)
    decode_out, prefill_out, paged, cache, step = _run(case, scale)
    assert type(step.provider).__name__ == "TritonMLAProvider"
    _check(case, scale, decode_out, prefill_out, paged, cache)


def test_split_decode_at_page_edges(triton_mla) -> None:
    """Contexts ending one before, at and one past a page edge, keys split over
    three programs and merged."""
    triton_mla.fixed_kv_splits = 3
    spec = _spec("fp8")
    case = make_mla_case(spec, [1, 1, 1], [15, 16, 33], 3, pad_tokens=1, device=DEVICE)
    scale = _scale(case)
    decode_out, prefill_out, paged, cache, step = _run(case, scale)
    assert step.provider_data.num_kv_splits == 3
    _check(case, scale, decode_out, prefill_out, paged, cache)


def test_quantization_error_against_the_unquantized_latents() -> None:
    """Bounded, and not zero (the figures are in the npu-attention README)."""
    spec = _spec("fp8")
    case = make_mla_case(spec, [1, 1, 1, 12], [40, 90, 7, 20], 3, seed=3, device=DEVICE)
    decode_out, prefill_out, _, _, _ = _run(case, _scale(case))
    nd, npf = case.num_decode_tokens, case.num_tokens - case.num_decode_tokens
    errors = [
        (decode_out[:nd].double() - oracle_decode(case)).abs().max().item(),
        (prefill_out[:npf].double() - oracle_prefill(case)).abs().max().item(),
    ]
    assert all(1e-4 < error < 0.1 for error in errors), errors


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fp8", "fp8_e4m3"])
def test_gpu_batch_states_at_deepseek_widths(kind: str) -> None:
    for query_lens, context_lens, num_decodes, spec_tokens in STATES.values():
        spec = _spec(kind, torch.bfloat16, num_speculative_tokens=spec_tokens, **DEEPSEEK)
        case = make_mla_case(spec, query_lens, [c * 9 for c in context_lens], num_decodes,
                             pad_tokens=2, device="cuda")  # fmt: skip
        scale = _scale(case)
        decode_out, prefill_out, paged, cache, _ = _run(case, scale)
        _check(case, scale, decode_out, prefill_out, paged, cache)


@pytest.mark.cuda
def test_gpu_decode_graph_replays_the_next_step() -> None:
    """Write + decode captured once (the scale a static tensor), replayed for the next
    step after the plan's fixed buffers and the cache are refreshed; unused slots hold
    NaN codes."""
    spec = _spec("fp8", torch.bfloat16, **DEEPSEEK)
    buffers = PlanBuffers.allocate(4, 4, max_blocks_per_req=64, device="cuda")
    cache = LatentCache(
        torch.empty(256, 16, spec.kv_lora_rank, dtype=spec.cache_dtype, device="cuda"),
        torch.empty(256, 16, spec.qk_rope_head_dim, dtype=spec.cache_dtype, device="cuda"),
    )
    cases = [
        make_mla_case(spec, [1] * 4, [100, 5, 700, 33], 4, device="cuda", seed=1),
        make_mla_case(spec, [1] * 4, [900, 250, 2, 64], 4, device="cuda", seed=2),
    ]
    scale = torch.maximum(_scale(cases[0]), _scale(cases[1])).cuda()
    q_latent, q_rope = cases[0].q_latent.clone(), cases[0].q_rope.clone()
    kv_c, k_pe = (t.clone() for t in cases[0].new_latents())
    out = torch.full_like(q_latent, float("nan"))
    graph = torch.cuda.CUDAGraph()
    for index, case in enumerate(cases):
        paged = _quantized_paged(case, scale.cpu())
        for plane, pages in zip(cache, paged.cache):
            plane.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
            plane[: paged.num_blocks].copy_(pages)
        tables = torch.zeros(4, 64, dtype=torch.int64)
        tables[:, : paged.block_tables.shape[1]] = paged.block_tables
        step = plan(case.cu_seqlens_q, case.seq_lens, tables.cuda(), paged.slot_mapping.cuda(),
                    4, spec, provider="triton", buffers=buffers)  # fmt: skip
        for dst, src in zip((q_latent, q_rope, kv_c, k_pe), (case.q_latent, case.q_rope,
                                                              *case.new_latents())):  # fmt: skip
            dst.copy_(src)
        if index == 0:  # compile outside the capture
            mla_write_cache(kv_c, k_pe, cache, step, k_scale=scale)
            mla_decode(q_latent, q_rope, cache, step, out, k_scale=scale)
            with torch.cuda.graph(graph):
                mla_write_cache(kv_c, k_pe, cache, step, k_scale=scale)
                mla_decode(q_latent, q_rope, cache, step, out, k_scale=scale)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = _dequantized(case, scale.to(case.q_rope.device))
        torch.testing.assert_close(
            out.cpu().double(), oracle_decode(expected), **MLA_TOLERANCE[spec.dtype]
        )
