"""The ``triton`` provider against naive dense attention in float32.

Unmarked cases are small and run on the CPU through Triton's interpreter when no
GPU is present (``TRITON_INTERPRET=1`` is set before the kernels are imported);
cases marked ``cuda`` cover the full feature matrix on a GPU.

Tolerances (absolute and relative, outputs are O(1)): float32 1e-4, float16 4e-3,
bfloat16 3e-2 (inputs are rounded to the dtype before the reference sees them, so
the tolerance covers only the kernel's own rounding of P and of the output).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import pytest
import torch
from triton_interpreter import DEVICE, HAS_CUDA

from npu_attention.plan import AttentionPlan
from npu_attention.providers.triton import TritonProvider, TritonStepData
from npu_attention.spec import AttentionSpec, BatchState

pytest.importorskip("triton")

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


# ---------------------------------------------------------------- batch building


class Batch:
    """A random batch: caches holding each request's context, new tokens' q/k/v,
    block tables over permuted pages (block 0 reserved, never used), and the plan."""

    def __init__(
        self,
        spec: AttentionSpec,
        query_lens: list[int],
        context_lens: list[int],
        *,
        num_decodes: int = 0,
        pad_tokens: int = 0,
        packed_kv: bool = False,
        extra_blocks: int = 3,
        device: torch.device = DEVICE,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.spec, self.device = spec, device
        self.query_lens, self.context_lens = query_lens, context_lens
        self.seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        bs, kvh, d = spec.block_size, spec.num_kv_heads, spec.head_size
        blocks_per_req = [math.ceil(s / bs) for s in self.seq_lens]
        num_blocks = 1 + sum(blocks_per_req) + extra_blocks
        pages = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        max_blocks = max(blocks_per_req) + 1
        self.block_tables = torch.zeros(len(query_lens), max_blocks, dtype=torch.int32)
        for r, n in enumerate(blocks_per_req):
            self.block_tables[r, :n] = torch.tensor([pages.pop() for _ in range(n)])

        # Full dense K/V of every request (context then new tokens), in the dtype.
        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(spec.dtype)

        self.keys = [rand(s, kvh, d) for s in self.seq_lens]
        self.values = [rand(s, kvh, d) for s in self.seq_lens]
        num_tokens = sum(query_lens) + pad_tokens
        self.query = rand(num_tokens, spec.num_heads, d).to(device)
        self.key = torch.cat(
            [k[c:] for k, c in zip(self.keys, context_lens)] + [rand(pad_tokens, kvh, d)]
        )
        self.value = torch.cat(
            [v[c:] for v, c in zip(self.values, context_lens)] + [rand(pad_tokens, kvh, d)]
        )
        self.key, self.value = self.key.to(device), self.value.to(device)

        shape = (num_blocks, bs, kvh, d)
        if packed_kv:  # vLLM packs K and V in one tensor: [blocks, kv_heads, block, 2 * d]
            kv = torch.full((num_blocks, kvh, bs, 2 * d), float("nan"), dtype=spec.dtype)
            kv = kv.to(device).transpose(1, 2)
            self.key_cache, self.value_cache = kv[..., :d], kv[..., d:]
        else:
            self.key_cache = torch.full(shape, float("nan"), dtype=spec.dtype, device=device)
            self.value_cache = torch.full(shape, float("nan"), dtype=spec.dtype, device=device)

        slots = []
        for r, (c, s) in enumerate(zip(context_lens, self.seq_lens)):
            for pos in range(s):
                slot = int(self.block_tables[r, pos // bs]) * bs + pos % bs
                if pos < c:  # context is already cached
                    self._put(slot, self.keys[r][pos], self.values[r][pos])
                else:
                    slots.append(slot)
        self.slot_mapping = torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64)
        self.plan = self._plan(num_decodes)

    def _put(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        bs = self.spec.block_size
        self.key_cache[slot // bs, slot % bs] = k.to(self.device)
        self.value_cache[slot // bs, slot % bs] = v.to(self.device)

    def _plan(self, num_decodes: int) -> AttentionPlan:
        q, c = self.query_lens, self.context_lens
        decode_len = 1 + self.spec.num_speculative_tokens
        if num_decodes == len(q):
            state = BatchState.DECODE_ONLY if decode_len == 1 else BatchState.SPEC_DECODING
        elif num_decodes:
            state = BatchState.CHUNKED_PREFILL
        else:
            state = BatchState.PREFILL_CACHE_HIT if any(c) else BatchState.PREFILL_NO_CACHE
        cu = [0]
        for n in q:
            cu.append(cu[-1] + n)

        def dev(values: list[int] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(values, dtype=dtype).to(self.device)

        provider = TritonProvider()
        plan = AttentionPlan(
            spec=self.spec,
            state=state,
            provider=provider,
            device=self.device,
            num_reqs=len(q),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes * decode_len,
            num_actual_tokens=cu[-1],
            max_query_len=max(q),
            max_seq_len=max(self.seq_lens),
            cu_seqlens_q_host=cu,
            query_lens_host=list(q),
            seq_lens_host=list(self.seq_lens),
            cu_seqlens_q=dev(cu, torch.int32),
            seq_lens=dev(self.seq_lens, torch.int32),
            device_context_lens=dev(c, torch.int32),
            block_tables=self.block_tables.to(self.device),
            slot_mapping=self.slot_mapping.to(self.device),
        )
        plan.provider_data = provider.prepare(plan)
        return plan

    def reference(self) -> torch.Tensor:
        """Dense float32 attention of the real (unpadded) query rows."""
        spec, outs, start = self.spec, [], 0
        group = spec.num_queries_per_kv
        for r, (n, c, s) in enumerate(zip(self.query_lens, self.context_lens, self.seq_lens)):
            q = self.query[start : start + n].float().cpu()
            k = self.keys[r].float().repeat_interleave(group, dim=1)
            v = self.values[r].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * spec.softmax_scale
            if spec.logits_soft_cap is not None:
                scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
            pos = torch.arange(c, c + n)[:, None]
            key_pos = torch.arange(s)[None, :]
            visible = torch.ones(n, s, dtype=torch.bool)
            if spec.causal:
                visible &= key_pos <= pos
            if spec.sliding_window is not None:
                visible &= key_pos > pos - spec.sliding_window
                if not spec.causal:
                    visible &= key_pos < pos + spec.sliding_window
            scores = scores.masked_fill(~visible, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
            start += n
        return torch.cat(outs)

    def run(self, provider: TritonProvider | None = None) -> torch.Tensor:
        provider = provider or self.plan.provider
        provider.write_kv(self.key, self.value, self.key_cache, self.value_cache, self.plan)
        out = torch.full_like(self.query, float("nan"))
        provider.attend(self.query, self.key_cache, self.value_cache, self.plan, out)
        return out


def record_launches(
    monkeypatch: pytest.MonkeyPatch,
    kernels: object,
    name: str,
    record: Callable[[dict], object] = lambda kwargs: 1,
) -> list:
    """Calls of ``kernels.<name>`` from here on, each as ``record(kwargs)`` (the calls
    still run)."""
    launches, launch = [], getattr(kernels, name)

    def recording(*args: object, **kwargs: object) -> None:
        launches.append(record(kwargs))
        launch(*args, **kwargs)

    monkeypatch.setattr(kernels, name, recording)
    return launches


def assert_matches_reference(batch: Batch, out: torch.Tensor) -> None:
    tol = TOLERANCE[batch.spec.dtype]
    real = batch.plan.num_actual_tokens
    torch.testing.assert_close(out[:real].float().cpu(), batch.reference(), atol=tol, rtol=tol)
    assert out[real:].isnan().all(), "rows past the real tokens must be left untouched"


def small_spec(**overrides: object) -> AttentionSpec:
    fields = {"num_heads": 4, "num_kv_heads": 2, "head_size": 64, "block_size": 16}
    fields.update(overrides)
    fields.setdefault("dtype", torch.float32 if not HAS_CUDA else torch.float16)
    return AttentionSpec(**fields)


# ---------------------------------------------------------------- small cases (CPU interpreter)

SMALL_CASES = {
    "prefill_no_cache": ({}, [5, 17, 1], [0, 0, 0], 0),
    "prefill_cache_hit": ({}, [3, 20], [29, 16], 0),
    "decode_only": ({}, [1, 1, 1], [40, 3, 17], 3),
    "spec_decoding": ({"num_speculative_tokens": 2}, [3, 3], [21, 6], 2),
    "chunked_prefill": ({}, [1, 1, 9, 4], [33, 5, 0, 12], 2),
    "sliding_window": ({"sliding_window": 7}, [1, 12], [30, 9], 1),
    "soft_cap": ({"logits_soft_cap": 1.5}, [6, 1], [10, 0], 0),
    "non_causal": ({"causal": False}, [7, 4], [0, 5], 0),
    "non_causal_window": ({"causal": False, "sliding_window": 3}, [9, 4], [0, 20], 0),
    "one_page_tiles": ({"block_size": 128}, [1, 20, 1], [200, 150, 0], 1),
    "one_page_tiles_decode": ({"block_size": 64}, [1, 1], [100, 3], 2),
    "head_80_mqa": ({"head_size": 80, "num_heads": 3, "num_kv_heads": 1}, [4, 1], [14, 20], 0),
    "head_32": ({"head_size": 32}, [1, 9, 4], [21, 0, 12], 1),
    "head_112_decode": ({"head_size": 112}, [1, 1], [37, 5], 2),
    "head_160_prefill": ({"head_size": 160, "num_heads": 2, "num_kv_heads": 1}, [6, 3], [9, 0], 0),
}


@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_small_case_matches_dense_reference(case: str) -> None:
    overrides, query_lens, context_lens, num_decodes = SMALL_CASES[case]
    spec = small_spec(**overrides)
    batch = Batch(spec, query_lens, context_lens, num_decodes=num_decodes, pad_tokens=2)
    assert_matches_reference(batch, batch.run())


def test_decode_with_kv_splits_matches_dense_reference() -> None:
    provider = TritonProvider()
    provider.min_tokens_per_split = 16
    provider.target_waves = 64
    provider.min_unsplit_fill = float("inf")
    batch = Batch(small_spec(), [1, 1], [70, 9], num_decodes=2, pad_tokens=1)
    batch.plan.provider_data = provider.prepare(batch.plan)
    assert batch.plan.provider_data.num_kv_splits > 1
    assert_matches_reference(batch, batch.run(provider))


def pdl_provider() -> TritonProvider:
    """A provider whose every launch asks for programmatic dependent launch."""
    provider = TritonProvider()
    for name in ("decode_launch", "decode_launch_one_wave", "prefill_launch",
                 "prefill_launch_small_pages"):  # fmt: skip
        setattr(provider, name, {**getattr(provider, name), "pdl": 1})
    return provider


def test_programmatic_dependent_launch_is_left_out_where_unsupported() -> None:
    """``pdl`` asks for a Hopper feature: the interpreter (and GPUs before compute
    capability 9) run the same kernels without it."""
    from npu_attention.providers.triton_kernels.paged_attention import pdl_supported

    assert not pdl_supported(torch.device("cpu"))
    provider = pdl_provider()
    provider.min_tokens_per_split = 16
    provider.target_waves = 64
    provider.min_unsplit_fill = float("inf")
    batch = Batch(small_spec(), [1, 1], [70, 9], num_decodes=2, pad_tokens=1)
    batch.plan.provider_data = provider.prepare(batch.plan)
    assert batch.plan.provider_data.num_kv_splits > 1
    assert_matches_reference(batch, batch.run(provider))


def test_packed_kv_cache_views_match_dense_reference() -> None:
    batch = Batch(small_spec(), [1, 6], [19, 11], num_decodes=1, packed_kv=True)
    assert not batch.key_cache.is_contiguous()
    assert_matches_reference(batch, batch.run())


def test_write_kv_scatters_by_slot_and_skips_padding() -> None:
    batch = Batch(small_spec(), [3, 2], [4, 0], pad_tokens=2)
    before_k, before_v = batch.key_cache.clone(), batch.value_cache.clone()
    batch.plan.provider.write_kv(
        batch.key, batch.value, batch.key_cache, batch.value_cache, batch.plan
    )
    expected_k, expected_v = before_k.clone(), before_v.clone()
    bs = batch.spec.block_size
    for token, slot in enumerate(batch.slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot // bs, slot % bs] = batch.key[token]
            expected_v[slot // bs, slot % bs] = batch.value[token]
    torch.testing.assert_close(batch.key_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.value_cache, expected_v, atol=0, rtol=0, equal_nan=True)
    assert batch.key_cache[0].isnan().all(), "reserved block 0 must stay untouched"


def test_encoder_attention_without_cache_reads_key_value() -> None:
    spec = small_spec(causal=False)
    batch = Batch(spec, [5, 9], [0, 0])
    out = torch.full_like(batch.query, float("nan"))
    batch.plan.provider.attend(batch.query, None, None, batch.plan, out, batch.key, batch.value)
    assert_matches_reference(batch, out)


def attend_with_own_rows(batch: Batch) -> torch.Tensor:
    """``attend`` as ``run`` calls it: the caches and the step's own key/value rows. The
    caches are not written here, so pages of the new tokens still hold NaN."""
    out = torch.full_like(batch.query, float("nan"))
    batch.plan.provider.attend(
        batch.query, batch.key_cache, batch.value_cache, batch.plan, out, batch.key, batch.value
    )
    return out


@pytest.mark.parametrize("block_size", [16, 128])
def test_prefill_without_context_reads_its_own_key_value_rows(block_size: int) -> None:
    batch = Batch(small_spec(block_size=block_size), [5, 17, 1], [0, 0, 0], pad_tokens=2)
    assert batch.plan.state is BatchState.PREFILL_NO_CACHE
    assert_matches_reference(batch, attend_with_own_rows(batch))


def test_prefill_after_cached_context_reads_the_pages() -> None:
    batch = Batch(small_spec(), [5, 17], [9, 0], pad_tokens=2)
    assert batch.plan.state is BatchState.PREFILL_CACHE_HIT
    assert attend_with_own_rows(batch)[: batch.plan.num_actual_tokens].isnan().any(), (
        "unwritten pages of the new tokens must reach the output when context is cached"
    )
    assert_matches_reference(batch, batch.run())


def test_prepare_chooses_decode_tiles_only_for_decode_states() -> None:
    decode = Batch(small_spec(), [1, 1], [5, 5], num_decodes=2)
    mixed = Batch(small_spec(), [1, 4], [5, 5], num_decodes=1)
    assert decode.plan.provider_data.decode_tiles
    assert decode.plan.provider_data.num_kv_splits == 1
    assert mixed.plan.provider_data == TritonStepData(decode_tiles=False, num_kv_splits=1)


@pytest.mark.parametrize(("block_size", "stages"), [(16, 3), (32, 3), (64, 2), (128, 2)])
def test_decode_tiles_over_pages_smaller_than_a_tile_keep_a_deeper_pipeline(
    block_size: int, stages: int
) -> None:
    """A decode of more than one wave: ``decode_launch`` where each tile lies in one
    page, ``decode_launch_small_pages`` (one stage more) where it spans pages."""
    provider = TritonProvider()
    spec = AttentionSpec(32, 8, 128, block_size=block_size, dtype=torch.bfloat16)
    config = provider._launch_config(spec, True, 1, False, True)
    assert (config.block_n, config.num_warps, config.num_stages) == (64, 2, stages)


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_padded_requests_of_a_larger_captured_batch_are_skipped(num_kv_splits: int) -> None:
    """A graph captured for 4 decodes replays a 2-request step: the fixed buffers hold
    neutral padding past the real requests (query length 0, sequence length 0)."""
    captured = Batch(small_spec(), [1] * 4, [30, 5, 17, 40], num_decodes=4)
    real = Batch(small_spec(), [1] * 2, [12, 33], num_decodes=2, seed=3)
    step = captured.plan  # host fields (num_reqs=4, splits) as captured
    step.provider_data = TritonStepData(decode_tiles=True, num_kv_splits=num_kv_splits)
    step.cu_seqlens_q.copy_(torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32))
    step.seq_lens.copy_(torch.tensor([13, 34, 0, 0], dtype=torch.int32))
    step.block_tables.zero_()[:2, : real.block_tables.shape[1]] = real.plan.block_tables
    step.slot_mapping.fill_(-1)[:2] = real.plan.slot_mapping
    query = torch.cat([real.query, torch.full_like(real.query, float("nan"))])
    out = torch.full_like(query, float("nan"))
    provider = step.provider
    for label, cache in (("key", real.key_cache), ("value", real.value_cache)):
        assert cache.shape[0] <= getattr(captured, f"{label}_cache").shape[0]
    provider.write_kv(real.key, real.value, real.key_cache, real.value_cache, step)
    provider.attend(query, real.key_cache, real.value_cache, step, out)
    assert_matches_reference(real, out[:2])
    assert out[2:].isnan().all(), "rows of padded requests must be left untouched"


def test_is_available_false_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TritonProvider.is_available()
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise
    assert not TritonProvider.is_available()


def test_supports_cpu_only_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    provider = TritonProvider()
    assert provider.supports_device(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert provider.supports_device(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not provider.supports_device(torch.device("cpu"))


# ---------------------------------------------------------------- bad input


def test_attend_rejects_wrong_query_shape() -> None:
    batch = Batch(small_spec(), [2], [0])
    bad = batch.query[:, :1]
    with pytest.raises(ValueError, match=r"query must be \[tokens, 4, 64\]"):
        batch.plan.provider.attend(bad, batch.key_cache, batch.value_cache, batch.plan, bad)


def test_attend_rejects_wrong_dtype() -> None:
    batch = Batch(small_spec(), [2], [0])
    bad = batch.query.to(torch.float64)
    with pytest.raises(TypeError, match="query must be"):
        batch.plan.provider.attend(bad, batch.key_cache, batch.value_cache, batch.plan, bad)


def test_attend_rejects_mismatched_out() -> None:
    batch = Batch(small_spec(), [2], [0])
    out = torch.empty_like(batch.query)[:1]
    with pytest.raises(ValueError, match="out must match query"):
        batch.plan.provider.attend(batch.query, batch.key_cache, batch.value_cache, batch.plan, out)


def test_attend_rejects_cache_of_wrong_block_size() -> None:
    batch = Batch(small_spec(), [2], [0])
    bad = batch.key_cache.new_zeros(4, 32, 2, 64)
    with pytest.raises(ValueError, match="key_cache must be"):
        batch.plan.provider.attend(batch.query, bad, bad, batch.plan, batch.query.clone())


def test_attend_rejects_missing_key_value_without_cache() -> None:
    batch = Batch(small_spec(), [2], [0])
    with pytest.raises(ValueError, match="needs key_cache/value_cache or key/value"):
        batch.plan.provider.attend(batch.query, None, None, batch.plan, batch.query.clone())


def test_attend_rejects_non_positive_scale() -> None:
    batch = Batch(small_spec(scale=-0.5), [2], [3])
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match=r"scale must be positive, got -0\.5"):
        batch.plan.provider.attend(batch.query, batch.key_cache, batch.value_cache, batch.plan, out)


def test_write_kv_rejects_mismatched_tokens() -> None:
    batch = Batch(small_spec(), [3], [0])
    with pytest.raises(ValueError, match="same number of tokens"):
        batch.plan.provider.write_kv(
            batch.key, batch.value[:2], batch.key_cache, batch.value_cache, batch.plan
        )


def test_write_kv_rejects_cache_of_wrong_dtype() -> None:
    batch = Batch(small_spec(), [3], [0])
    bad = batch.value_cache.to(torch.float64)
    with pytest.raises(TypeError, match="value_cache must be"):
        batch.plan.provider.write_kv(batch.key, batch.value, batch.key_cache, bad, batch.plan)


# ---------------------------------------------------------------- GPU matrix

GPU_STATES = {
    "prefill_no_cache": ([300, 17, 1, 128], [0, 0, 0, 0], 0),
    "prefill_cache_hit": ([64, 200, 3], [513, 128, 1000], 0),
    "decode_only": ([1] * 9, [1, 15, 16, 17, 127, 128, 129, 2000, 4097], 9),
    "spec_decoding": ([4] * 3, [60, 1, 700], 3),
    "chunked_prefill": ([1, 1, 1, 250, 33], [900, 5, 64, 0, 300], 3),
}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("state", list(GPU_STATES))
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_states_match_dense_reference(state: str, dtype: torch.dtype, block_size: int) -> None:
    query_lens, context_lens, num_decodes = GPU_STATES[state]
    spec = AttentionSpec(
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        block_size=block_size,
        dtype=dtype,
        num_speculative_tokens=3 if state == "spec_decoding" else 0,
    )
    batch = Batch(spec, query_lens, context_lens, num_decodes=num_decodes, pad_tokens=3)
    assert_matches_reference(batch, batch.run())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "features",
    [{}, {"sliding_window": 100}, {"logits_soft_cap": 30.0}, {"causal": False}],
    ids=["causal", "window", "soft_cap", "non_causal"],
)
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_gpu_prefill_reads_own_key_value_rows(
    dtype: torch.dtype, features: dict, head_size: int
) -> None:
    """A prefill without cached context reads its keys from the step's rows, with the
    launch of contiguous keys at any block size (pages never written: NaN)."""
    spec = AttentionSpec(32, 8, head_size, block_size=16, dtype=dtype, **features)
    query_lens, context_lens, _ = GPU_STATES["prefill_no_cache"]
    batch = Batch(spec, query_lens, context_lens, pad_tokens=3)
    assert_matches_reference(batch, attend_with_own_rows(batch))


@pytest.mark.cuda
@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 112, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (16, 1)])
def test_gpu_head_sizes_and_groups(head_size: int, heads: tuple[int, int]) -> None:
    spec = AttentionSpec(heads[0], heads[1], head_size, block_size=32, dtype=torch.bfloat16)
    batch = Batch(spec, [1, 1, 70, 5], [300, 31, 40, 0], num_decodes=2, pad_tokens=2)
    assert_matches_reference(batch, batch.run())
    decode = Batch(spec, [1, 1, 1], [1000, 31, 2], num_decodes=3, pad_tokens=1, seed=1)
    assert_matches_reference(decode, decode.run())


@pytest.mark.cuda
@pytest.mark.parametrize("head_size", [192, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_large_heads_fit_shared_memory(head_size: int, dtype: torch.dtype) -> None:
    spec = AttentionSpec(8, 2, head_size, block_size=128, dtype=dtype)
    batch = Batch(spec, [1, 1, 200, 7], [300, 0, 100, 500], num_decodes=2, pad_tokens=2)
    assert_matches_reference(batch, batch.run())


@pytest.mark.cuda
@pytest.mark.parametrize(
    "features",
    [
        {"sliding_window": 100},
        {"logits_soft_cap": 30.0},
        {"sliding_window": 64, "logits_soft_cap": 5.0},
        {"causal": False},
        {"causal": False, "sliding_window": 50},
        {"scale": 0.3},
    ],
)
@pytest.mark.parametrize("decode", [False, True])
def test_gpu_features(features: dict, decode: bool) -> None:
    spec = AttentionSpec(16, 4, 128, block_size=64, dtype=torch.bfloat16, **features)
    if decode:
        batch = Batch(spec, [1] * 4, [1500, 99, 100, 101], num_decodes=4, pad_tokens=2)
    else:
        batch = Batch(spec, [1, 300, 45], [700, 0, 260], num_decodes=1, pad_tokens=2)
    assert_matches_reference(batch, batch.run())


@pytest.mark.cuda
@pytest.mark.parametrize("num_kv_splits", [2, 7, 64])
def test_gpu_forced_kv_splits(num_kv_splits: int) -> None:
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    batch = Batch(spec, [1] * 5, [0, 1, 31, 600, 3000], num_decodes=5, pad_tokens=3)
    batch.plan.provider_data = TritonStepData(decode_tiles=True, num_kv_splits=num_kv_splits)
    assert_matches_reference(batch, batch.run())


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("num_reqs", "query_len", "longest", "expected"),
    [  # on an H100 (132 multiprocessors), 8 KV heads: (splits > 1, one_wave)
        (1, 1, 3000, (True, False)),  # 24 splits x 8 programs: default tiles
        (1, 1, 400, (True, True)),  # 4 splits x 8 programs: one wave of wide tiles
        (16, 1, 3000, (False, True)),  # 128 programs: one wave of wide tiles
        (16, 4, 3000, (False, True)),  # spec decode, one wave
        (24, 1, 3000, (False, False)),  # 192 programs: unsplit, default tiles
    ],
)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_decode_launch_choices(
    num_reqs: int,
    query_len: int,
    longest: int,
    expected: tuple,
    head_size: int,
    block_size: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every decode launch the heuristics pick on this GPU for the portable kernel (the
    Hopper decode's choices: ``test_triton_hopper_decode``), against the reference."""
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the expected choices are an H100's")
    monkeypatch.setattr(TritonProvider, "_hopper_decode_takes", lambda *_: False)
    spec = AttentionSpec(
        32, 8, head_size, block_size=block_size, dtype=torch.bfloat16,
        num_speculative_tokens=query_len - 1,
    )  # fmt: skip
    context = [longest] + [(97 * r) % 700 for r in range(1, num_reqs)]
    batch = Batch(spec, [query_len] * num_reqs, context, num_decodes=num_reqs, pad_tokens=2)
    step = batch.plan.provider_data
    assert (step.num_kv_splits > 1, step.one_wave) == expected
    assert_matches_reference(batch, batch.run())


@pytest.mark.cuda
@pytest.mark.parametrize("prefetch_tiles", [0, 1, 4])
@pytest.mark.parametrize(
    ("num_reqs", "num_kv_splits", "one_wave"), [(3, 1, True), (3, 4, False), (20, 1, False)]
)
def test_gpu_decode_prefetch_of_first_keys(
    prefetch_tiles: int, num_reqs: int, num_kv_splits: int, one_wave: bool
) -> None:
    """Decode programs prefetch their first keys' K/V before they know their lengths:
    with block tables narrower than a key tile and stale entries past each sequence
    (negative, past the cache), the output still matches the reference."""
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    context = [(5 * r) % 15 for r in range(num_reqs)]  # one page each: tables 2 wide
    batch = Batch(spec, [1] * num_reqs, context, num_decodes=num_reqs, pad_tokens=2)
    assert batch.block_tables.shape[1] * spec.block_size < 128  # narrower than a tile
    batch.block_tables[::2, 1] = -1
    batch.block_tables[1::2, 1] = batch.key_cache.shape[0] + 1000
    batch.plan.block_tables = batch.block_tables.to(batch.device)
    provider = TritonProvider()
    for name in ("decode_launch", "decode_launch_one_wave"):
        setattr(provider, name, {**getattr(provider, name), "prefetch_tiles": prefetch_tiles})
    batch.plan.provider_data = TritonStepData(True, num_kv_splits, one_wave)
    assert_matches_reference(batch, batch.run(provider))


@pytest.mark.cuda
@pytest.mark.parametrize("num_kv_splits", [1, 2, 33])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_programmatic_dependent_launch(num_kv_splits: int, block_size: int) -> None:
    """``pdl`` (the attention kernel waits for the kernel before it, the merge of a
    split decode for the attention kernel): decode with and without splits, and a
    mixed batch, right after the KV write that produced their keys."""
    spec = AttentionSpec(32, 8, 128, block_size=block_size, dtype=torch.bfloat16)
    provider = pdl_provider()
    decode = Batch(spec, [1] * 5, [0, 1, 31, 600, 3000], num_decodes=5, pad_tokens=3)
    decode.plan.provider_data = TritonStepData(decode_tiles=True, num_kv_splits=num_kv_splits)
    assert_matches_reference(decode, decode.run(provider))
    mixed = Batch(spec, [1, 1, 250, 33], [900, 5, 0, 300], num_decodes=2, pad_tokens=2, seed=3)
    assert_matches_reference(mixed, mixed.run(provider))


@pytest.mark.cuda
def test_gpu_programmatic_dependent_launch_in_a_graph() -> None:
    """A captured split decode with ``pdl``, replayed twice over new keys and queries."""
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    batch = Batch(spec, [1] * 3, [4000, 70, 1500], num_decodes=3, pad_tokens=1)
    batch.plan.provider_data = TritonStepData(decode_tiles=True, num_kv_splits=16)
    provider = pdl_provider()
    out = torch.full_like(batch.query, float("nan"))
    batch.run(provider)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        provider.write_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.plan)
        provider.attend(batch.query, batch.key_cache, batch.value_cache, batch.plan, out)
    for seed in (1, 2):  # new queries and new keys/values of the decoded tokens
        generator = torch.Generator().manual_seed(seed)
        for tensor, dense in (
            (batch.query, None),
            (batch.key, batch.keys),
            (batch.value, batch.values),
        ):
            fresh = torch.randn(tensor.shape, generator=generator).to(spec.dtype)
            tensor.copy_(fresh)
            for r, context in enumerate(batch.context_lens if dense else ()):
                dense[r][context] = fresh[r]  # decode r's token sits at row r
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(batch, out)


@pytest.mark.cuda
def test_gpu_packed_kv_cache() -> None:
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    batch = Batch(spec, [1, 1, 200], [500, 7, 300], num_decodes=2, packed_kv=True, pad_tokens=1)
    assert_matches_reference(batch, batch.run())


@pytest.mark.cuda
def test_gpu_graph_replay_reads_refreshed_step_tensors() -> None:
    """A captured decode reads the step tensors at replay: refresh them in place,
    replay, and compare with the dense reference of the new batch."""
    spec = AttentionSpec(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    first = Batch(spec, [1] * 4, [100, 200, 300, 1300], num_decodes=4, extra_blocks=100)
    second = Batch(spec, [1] * 4, [900, 3, 50, 1200], num_decodes=4, seed=5)
    plan, provider = first.plan, first.plan.provider
    out = torch.empty_like(first.query)
    first.run()  # warm up (compiles the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        provider.write_kv(first.key, first.value, first.key_cache, first.value_cache, plan)
        provider.attend(first.query, first.key_cache, first.value_cache, plan, out)
    # Move the second batch into the first's buffers (its caches are large enough).
    assert second.key_cache.shape[0] <= first.key_cache.shape[0]
    first.key_cache[: second.key_cache.shape[0]].copy_(second.key_cache)
    first.value_cache[: second.value_cache.shape[0]].copy_(second.value_cache)
    first.query.copy_(second.query)
    first.key.copy_(second.key)
    first.value.copy_(second.value)
    plan.seq_lens.copy_(second.plan.seq_lens)
    plan.slot_mapping.copy_(second.plan.slot_mapping)
    width = second.plan.block_tables.shape[1]
    plan.block_tables.zero_()[:, :width].copy_(second.plan.block_tables)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(second, out)
