"""The ``triton`` provider over 8-bit KV caches: the write kernel quantizes as vLLM
defines each kind, the attention kernels (the portable one, and on Hopper GPUs the
Gluon decode) dequantize 8-bit pages in registers; all against the float64 oracle on
the dequantized cache (``kv_quant_cases``), at the provider's tolerances
(``npu_attention_cases.TOLERANCE``). Without a GPU the kernels run under Triton's
interpreter (small cases, float32); on a GPU in bfloat16 (and float16 for the Gluon
decode), with a CUDA graph replaying the next batch, and the register conversions of
``dequant.py`` checked on every code against torch's."""

from __future__ import annotations

import pytest
import torch
from kv_quant_cases import (
    QUANTIZED_KINDS,
    assert_rows_written,
    oracle,
    quantized_paged,
    run_quantized,
)
from npu_attention_cases import TOLERANCE, make_case
from test_triton_provider import record_launches
from triton_interpreter import DEVICE, HAS_CUDA

from npu_attention import AttentionSpec, BatchState, plan, run
from npu_attention.kv_quant import ScaleKind
from npu_attention.providers import triton as triton_provider
from npu_attention.registry import get_provider

pytest.importorskip("triton")

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9

DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
BATCHES = {  # (query_lens, context_lens, num_decodes, num_speculative_tokens, state)
    "prefill_no_cache": ([5, 9], [0, 0], 0, 0, BatchState.PREFILL_NO_CACHE),
    "prefill_cache_hit": ([7, 3], [16, 17], 0, 0, BatchState.PREFILL_CACHE_HIT),
    "decode_only": ([1, 1, 1], [15, 16, 33], 3, 0, BatchState.DECODE_ONLY),
    "spec_decoding": ([3, 3], [5, 32], 2, 2, BatchState.SPEC_DECODING),
    "chunked_prefill": ([1, 1, 6], [31, 2, 10], 2, 0, BatchState.CHUNKED_PREFILL),
}


def _check(case, out, quant, step) -> None:
    n = case.num_tokens
    expected = oracle(case, quant, step.state)
    torch.testing.assert_close(out[:n].cpu().double(), expected.cpu(), **TOLERANCE[case.spec.dtype])
    assert (out[n:] == -3.0).all(), "padding rows of out must be left untouched"
    assert_rows_written(case, quant, exact=not HAS_CUDA)


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
@pytest.mark.parametrize("name", list(BATCHES))
def test_batch_states(kind: str, name: str) -> None:
    query_lens, context_lens, num_decodes, spec_tokens, state = BATCHES[name]
    spec = AttentionSpec(4, 2, 64, 16, dtype=DTYPE, kv_cache_dtype=kind,
                         num_speculative_tokens=spec_tokens)  # fmt: skip
    case = make_case(spec, query_lens, context_lens, num_decodes, pad_tokens=2, device=DEVICE)
    out, quant, step = run_quantized(case, provider="triton")
    assert step.state is state and type(step.provider).__name__ == "TritonProvider"
    _check(case, out, quant, step)


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
@pytest.mark.parametrize("head_size", [128, 256])
def test_head_sizes_at_page_edges(kind: str, head_size: int) -> None:
    """Decodes whose contexts end one before and at a page boundary, and a prefill
    chunk that starts one past it."""
    spec = AttentionSpec(2, 1, head_size, 16, dtype=DTYPE, kv_cache_dtype=kind)
    case = make_case(spec, [1, 1, 3], [15, 16, 17], 2, seed=head_size, device=DEVICE)
    out, quant, step = run_quantized(case, provider="triton")
    _check(case, out, quant, step)


@pytest.mark.parametrize("kind", ["fp8", "int8_per_token_head"])
def test_split_decode_with_window_and_soft_cap(kind: str) -> None:
    """One request on one KV head: its keys are split over programs and merged."""
    spec = AttentionSpec(2, 1, 64, 16, dtype=DTYPE, kv_cache_dtype=kind,
                         sliding_window=40, logits_soft_cap=20.0)  # fmt: skip
    case = make_case(spec, [1], [300], 1, device=DEVICE)
    out, quant, step = run_quantized(case, provider="triton")
    assert step.provider_data.num_kv_splits > 1
    _check(case, out, quant, step)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_gpu_batch_states_and_head_sizes(kind: str, head_size: int) -> None:
    for name, (q, ctx, dec, spec_tokens, state) in BATCHES.items():
        spec = AttentionSpec(8, 2, head_size, 16, dtype=torch.bfloat16, kv_cache_dtype=kind,
                             num_speculative_tokens=spec_tokens)  # fmt: skip
        case = make_case(spec, q, [c * 7 for c in ctx], dec, pad_tokens=2, device="cuda")
        out, quant, step = run_quantized(case, provider="triton")
        assert step.state is state, name
        _check(case, out, quant, step)


def _record_pool_fills(monkeypatch: pytest.MonkeyPatch) -> list:
    """Calls of ``PagePool.fill`` from here on (the calls still run)."""
    from npu_attention.providers.triton_kernels.dequant_pages import PagePool

    fills, fill = [], PagePool.fill

    def recording(pool, *args, **kwargs):
        fills.append(pool)
        return fill(pool, *args, **kwargs)

    monkeypatch.setattr(PagePool, "fill", recording)
    return fills


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_page_pool_holds_the_pages_dequantized(kind: str) -> None:
    """Every referenced page of every request, K and V, equals ``kv_quant``'s
    dequantization rounded to the model dtype (exactly) at its place in the pool's
    tables; slots past a request's length (NaN codes and scales here) are zeros."""
    from npu_attention import kv_quant
    from npu_attention.providers.triton_kernels.dequant_pages import PagePool

    spec = AttentionSpec(8, 2, 80, 16, dtype=DTYPE, kv_cache_dtype=kind)
    case = make_case(spec, [3, 5, 1], [40, 17, 0], 0, device=DEVICE)
    quant = quantized_paged(case)
    paged = quant.paged
    tables = paged.block_tables.to(DEVICE)
    lens = case.context_lens  # the new rows are not written
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    pool = PagePool(lens, tables.shape[1], (16, 2, 80), DTYPE)
    assert pool.key is None  # allocated by the first fill
    key, value, pool_tables = pool.fill(
        paged.key_cache, paged.value_cache, quant.k_scale, quant.v_scale, tables, seq_lens
    )
    assert key.shape == value.shape == (3 + 2, 16, 2, 80)
    per_token_head = spec.kv_scales is not ScaleKind.PER_TENSOR
    for r, n in enumerate(lens):
        for j in range(-(-n // 16)):
            block, at = int(tables[r, j]), int(pool_tables[r, j])
            for cache, scale, dequantized in ((paged.key_cache, quant.k_scale, key),
                                              (paged.value_cache, quant.v_scale, value)):  # fmt: skip
                s = scale[block].unsqueeze(-1) if per_token_head else scale
                expected = kv_quant.dequantize(cache[block], s).to(DTYPE)
                rows = min(16, n - 16 * j)
                assert torch.equal(dequantized[at, :rows], expected[:rows]), (kind, r, j)
                assert not dequantized[at, rows:].any(), (kind, r, j)


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_chunks_through_a_page_pool(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill step over cached 8-bit pages whose tiles read each page often enough
    goes through the 16-bit pool (one fill a layer), against the oracle."""
    provider = get_provider("triton", DEVICE)
    monkeypatch.setattr(provider, "dequant_pool_min_reuse", 2)
    fills = _record_pool_fills(monkeypatch)
    spec = AttentionSpec(8, 2, 64, 16, dtype=DTYPE, kv_cache_dtype=kind)
    case = make_case(spec, [70, 9], [33, 16], 0, pad_tokens=2, device=DEVICE)
    out, quant, step = run_quantized(case, provider="triton")
    assert step.state is BatchState.PREFILL_CACHE_HIT
    assert step.provider_data.pool is not None and len(fills) == 1
    _check(case, out, quant, step)


def test_no_pool_where_it_would_not_pay_or_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """No pool where the 8-bit launch's tiles read each page fewer than
    ``dequant_pool_min_reuse`` times (decodes, a short chunk after a long prefix), where
    no cached context is read, or where it would outgrow ``dequant_pool_bytes``."""
    provider = get_provider("triton", DEVICE)
    spec = AttentionSpec(8, 2, 64, 16, dtype=DTYPE, kv_cache_dtype="fp8")

    def pool(q: list[int], ctx: list[int], decodes: int):
        case = make_case(spec, q, ctx, decodes, device=DEVICE)
        quant = quantized_paged(case)
        step = plan(case.cu_seqlens_q, case.seq_lens, quant.paged.block_tables.to(DEVICE),
                    quant.paged.slot_mapping.to(DEVICE), decodes, spec, provider="triton")  # fmt: skip
        return step.provider_data.pool

    assert pool([1, 1], [40, 300], 2) is None
    assert pool([1, 8], [40, 300], 1) is None
    assert pool([300], [0], 0) is None  # no cached context: it attends over its own rows
    long_chunk = ([300], [40], 0)  # 300 x 4 query rows: 19 tiles read each page
    assert pool(*long_chunk) is not None
    monkeypatch.setattr(provider, "dequant_pool_bytes", pool(*long_chunk).nbytes - 1)
    assert pool(*long_chunk) is None


@pytest.mark.cuda
@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
@pytest.mark.parametrize("path", ["pool", "8bit", "16bit"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_chunks_over_8bit_pages(
    kind: str, path: str, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks after cached prefixes: the referenced pages dequantized once into
    a 16-bit pool (taken at these lengths), or converted in the kernel with the 8-bit
    prefill launch and with the 16-bit one; 128-key pages hold a K/V tile, 16-key pages
    several a tile."""
    spec = AttentionSpec(32, 8, 128, block_size, dtype=torch.bfloat16, kv_cache_dtype=kind)
    case = make_case(spec, [200, 77], [390, 129], 0, pad_tokens=2, device="cuda")
    provider = get_provider("triton", "cuda")
    fills = _record_pool_fills(monkeypatch)
    if path != "pool":
        monkeypatch.setattr(provider, "dequant_pool_bytes", 0)
    if path == "16bit":
        monkeypatch.setattr(provider, "prefill_launch_8bit", None)
    out, quant, step = run_quantized(case, provider="triton")
    assert step.state is BatchState.PREFILL_CACHE_HIT
    assert len(fills) == (path == "pool")
    _check(case, out, quant, step)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fp8", "int8_per_token_head"])
def test_gpu_captured_chunk_converts_in_the_kernel(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step planned with a pool but captured in a CUDA graph converts in the kernel
    (the pool's size follows the lengths the graph would outlive); its replay matches
    the oracle."""
    spec = AttentionSpec(32, 8, 128, 16, dtype=torch.bfloat16, kv_cache_dtype=kind)
    case = make_case(spec, [200, 77], [390, 129], 0, device="cuda")
    quant = quantized_paged(case)
    paged = quant.paged
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables.cuda(),
                paged.slot_mapping.cuda(), 0, spec, provider="triton")  # fmt: skip
    assert step.provider_data.pool is not None
    key, value = case.new_kv()
    out = torch.full_like(case.query, -3.0)
    scales = {"k_scale": quant.k_scale, "v_scale": quant.v_scale}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile outside the capture
        run(case.query, key, value, paged.key_cache, paged.value_cache, step, out, **scales)
    torch.cuda.current_stream().wait_stream(side)
    fills = _record_pool_fills(monkeypatch)
    out.fill_(-3.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(case.query, key, value, paged.key_cache, paged.value_cache, step, out, **scales)
    assert not fills
    graph.replay()
    torch.cuda.synchronize()
    _check(case, out, quant, step)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_gpu_graph_replay_of_the_next_batch(kind: str) -> None:
    """A CUDA graph of one decode step (write + attention, scales as static tensors)
    replays the next step after its step tensors are refreshed in place."""
    spec = AttentionSpec(32, 8, 128, 16, dtype=torch.bfloat16, kv_cache_dtype=kind)
    first = make_case(spec, [1] * 4, [1300, 900, 300, 1250], 4, device="cuda")
    second = make_case(spec, [1] * 4, [900, 3, 50, 1200], 4, seed=5, device="cuda")
    quant = quantized_paged(first)
    paged = quant.paged
    step = plan(first.cu_seqlens_q, first.seq_lens, paged.block_tables.cuda(),
                paged.slot_mapping.cuda(), 4, spec, provider="triton")  # fmt: skip
    key, value = first.new_kv()
    out = torch.empty_like(first.query)
    scales = {"k_scale": quant.k_scale, "v_scale": quant.v_scale}
    run(first.query, key, value, paged.key_cache, paged.value_cache, step, out, **scales)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(first.query, key, value, paged.key_cache, paged.value_cache, step, out, **scales)
    per_tensor = spec.kv_scales is ScaleKind.PER_TENSOR  # the layer's scales stay
    nxt = quantized_paged(second, 1, (quant.k_scale, quant.v_scale) if per_tensor else None)
    blocks = nxt.paged.key_cache.shape[0]
    assert blocks <= paged.key_cache.shape[0]
    paged.key_cache[:blocks].copy_(nxt.paged.key_cache)
    paged.value_cache[:blocks].copy_(nxt.paged.value_cache)
    if not per_tensor:
        quant.k_scale[:blocks].copy_(nxt.k_scale)
        quant.v_scale[:blocks].copy_(nxt.v_scale)
    new_key, new_value = second.new_kv()
    first.query.copy_(second.query)
    key.copy_(new_key)
    value.copy_(new_value)
    second_step = plan(second.cu_seqlens_q, second.seq_lens, nxt.paged.block_tables.cuda(),
                       nxt.paged.slot_mapping.cuda(), 4, spec, provider="triton")  # fmt: skip
    step.seq_lens.copy_(second_step.seq_lens)
    step.slot_mapping.copy_(second_step.slot_mapping)
    width = second_step.block_tables.shape[1]
    step.block_tables.zero_()[:, :width].copy_(second_step.block_tables)
    graph.replay()
    torch.cuda.synchronize()
    expected = oracle(second, nxt, BatchState.DECODE_ONLY)
    torch.testing.assert_close(out.cpu().double(), expected.cpu(), **TOLERANCE[spec.dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn])
def test_gpu_register_conversion_of_every_code(codes: torch.dtype, dtype: torch.dtype) -> None:
    """``dequant_tl`` against torch's conversion on all 256 codes, in shuffled order
    (NaN codes, which no write produces, read as +-480)."""
    import triton
    import triton.language as tl

    from npu_attention.providers.triton_kernels.dequant import dequant_tl

    @triton.jit
    def convert(src, dst, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(dst + offs, dequant_tl(tl.load(src + offs), dst.dtype.element_ty))

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    bytes_ = every[torch.randperm(1024, generator=torch.Generator().manual_seed(0)) % 256]
    src = bytes_.view(codes).cuda()
    out = torch.empty(1024, dtype=dtype, device="cuda")
    convert[(1,)](src, out, N=1024)
    expected = src.cpu().float()
    nan = expected.isnan()
    expected[nan] = torch.where(bytes_[nan] >= 128, -480.0, 480.0)
    assert torch.equal(out.cpu().float(), expected.to(dtype).float())


@pytest.mark.cuda
@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.x")
def test_gpu_paired_e4m3_conversion_of_every_code() -> None:
    """The Gluon decode's e4m3 -> float16 conversion (``cvt.rn.f16x2.e4m3x2``) against
    torch's on all 256 codes in shuffled order, NaN codes staying NaN."""
    import triton
    import triton.language as tl

    from npu_attention.providers.triton_kernels.dequant import _E4M3_TO_F16_CVT as PAIRED

    @triton.jit
    def convert(src, dst, N: tl.constexpr):
        offs = tl.arange(0, N)
        codes = tl.load(src + offs)
        tl.store(
            dst + offs, tl.inline_asm_elementwise(PAIRED, "=r,=r,r", [codes], tl.float16, True, 4)
        )

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    bytes_ = every[torch.randperm(1024, generator=torch.Generator().manual_seed(0)) % 256]
    src = bytes_.view(torch.float8_e4m3fn).cuda()
    out = torch.empty(1024, dtype=torch.float16, device="cuda")
    convert[(1,)](src, out, N=1024)
    torch.testing.assert_close(
        out.cpu(), src.cpu().to(torch.float16), rtol=0, atol=0, equal_nan=True
    )


@pytest.mark.cuda
@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.x")
@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
@pytest.mark.parametrize(
    ("head_size", "head_major"), [(64, False), (128, False), (256, False), (128, True)]
)
def test_gpu_hopper_decode_over_8bit_pages(
    kind: str, head_size: int, head_major: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Gluon decode reads the 8-bit pages: decodes ending around page edges, a
    speculative decode, one long request split over programs, more programs than
    multiprocessors (taken for the kinds ``hopper_decode_multi_wave_8bit`` names); bfloat16 and
    float16; 16-token pages (several a key tile) and 128-token pages (a tile inside one);
    pages and scales token-major or ``head_major``."""
    provider = get_provider("triton", torch.device("cuda"))
    monkeypatch.setattr(provider, "hopper_decode_multi_wave_8bit", (kind,))
    kernels = triton_provider._hopper_decode_kernels(torch.device("cuda"))
    assert kernels is not None, "this GPU and Triton should take the Hopper kernel"
    launches = record_launches(
        monkeypatch, kernels, "hopper_decode",
        lambda kw: (kw["num_splits"], kw["k_scale"] is not None),
    )  # fmt: skip
    many = torch.cuda.get_device_properties(0).multi_processor_count // 4 + 3
    batches = {  # (query_lens, context_lens, num_speculative_tokens, dtype, block_size)
        "page_edges": ([1] * 4, [15, 16, 17, 1300], 0, torch.bfloat16, 16),
        "spec_decoding": ([3, 3], [5, 290], 2, torch.bfloat16, 16),
        "split": ([1], [3000], 0, torch.bfloat16, 16),
        "multi_wave": ([1] * many, [100 + 37 * i for i in range(many)], 0, torch.bfloat16, 16),
        "float16": ([1, 1], [63, 700], 0, torch.float16, 16),
        "page_edges_128": ([1] * 4, [63, 128, 129, 1300], 0, torch.bfloat16, 128),
        "split_128": ([1], [3000], 0, torch.bfloat16, 128),
    }
    for name, (q, ctx, spec_tokens, dtype, block_size) in batches.items():
        spec = AttentionSpec(8, 4, head_size, block_size, dtype=dtype, kv_cache_dtype=kind,
                             num_speculative_tokens=spec_tokens)  # fmt: skip
        case = make_case(spec, q, ctx, len(q), pad_tokens=2, seed=head_size, device="cuda")
        launches.clear()
        out, quant, step = run_quantized(case, provider="triton", head_major=head_major)
        assert launches and all(scaled for _, scaled in launches), name
        if name.startswith("split"):
            assert launches[0][0] > 1
        _check(case, out, quant, step)


def test_split_and_register_rules_of_the_8bit_gluon_decode(monkeypatch) -> None:
    """On 132 multiprocessors, 16 requests x 8 KV heads: unsplit over 16-bit pages (one
    program each fills the GPU), three splits over 8-bit pages (three programs a
    multiprocessor); the register cap rises to 128 above head size 128."""
    monkeypatch.setattr(triton_provider, "_multiprocessors", lambda device: 132)
    provider = triton_provider.TritonProvider()
    cpu = torch.device("cpu")
    assert provider._num_kv_splits(16, 8, 16384, cpu, True) == 1
    assert provider._num_kv_splits(16, 8, 16384, cpu, True, eight_bit=True) == 3
    assert provider._num_kv_splits(16, 8, 200, cpu, True, eight_bit=True) == 2  # 128-key shares
    assert triton_provider._maxnreg(80, 128) == 80
    assert triton_provider._maxnreg(80, 256) == 128
    assert triton_provider._maxnreg(None, 256) is None
