"""K/V tiles through tensor descriptors (``tma`` in a launch of the ``triton`` provider).

The descriptor path serves K/V tiles that lie in one page of the cache. Without a
GPU the kernels run under Triton's interpreter, which implements descriptor loads;
there ``tma_supported`` is forced on so that the path runs at all. On a GPU of
compute capability 9 or later (``cuda`` cases) it runs for real, for every launch
the provider defines. Every case compares with the dense float32 reference of
``test_triton_provider`` at its tolerances (bfloat16 3e-2, float32 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from test_triton_provider import Batch, assert_matches_reference, small_spec
from triton_interpreter import HAS_CUDA

from npu_attention.providers.triton import TritonProvider
from npu_attention.spec import AttentionSpec

pytest.importorskip("triton")


def _kernels():
    import importlib

    return importlib.import_module("npu_attention.providers.triton_kernels.paged_attention")


def _launch_names(provider: TritonProvider) -> list[str]:
    """The provider's launch settings (``prefill_launch``, ``decode_launch``, ...)."""
    return sorted(
        name
        for name, value in vars(provider).items()
        if "_launch" in name and isinstance(value, dict)
    )


def _with_tma(launch: dict, block_n: int | None = None) -> dict:
    launch = {**launch, "tma": 1}
    if block_n is not None:
        launch["block_n"] = block_n
    return launch


# ---------------------------------------------------------------- interpreter (CPU)


@pytest.fixture
def descriptors_made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Force the path on; the returned list grows by one per descriptor made."""
    if HAS_CUDA:
        pytest.skip("the interpreter cases force the path on; the GPU cases run it for real")
    kernels, made = _kernels(), []
    make = kernels._page_tile_descriptor

    def counting(*args: object):
        made.append(1)
        return make(*args)

    monkeypatch.setattr(kernels, "tma_supported", lambda cache: True)
    monkeypatch.setattr(kernels, "_page_tile_descriptor", counting)
    return made


def test_prefill_page_tiles_through_descriptors_match_reference(
    descriptors_made: list[int],
) -> None:
    provider = TritonProvider()
    provider.prefill_launch = _with_tma({**provider.prefill_launch, "block_m": 16}, 16)
    spec = small_spec(block_size=32)
    batch = Batch(spec, [1, 40, 7], [70, 30, 0], num_decodes=1, pad_tokens=1)
    assert_matches_reference(batch, batch.run(provider))
    assert descriptors_made, "the launch did not take the descriptor path"


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_page_tiles_through_descriptors_match_reference(
    num_kv_splits: int, descriptors_made: list[int]
) -> None:
    provider = TritonProvider()
    for name in _launch_names(provider):
        if name.startswith("decode"):
            setattr(provider, name, _with_tma(getattr(provider, name), 16))
    provider._num_kv_splits = lambda *_: num_kv_splits
    spec = small_spec(block_size=32, head_size=80)  # head lanes past 80 read as zeros
    batch = Batch(spec, [1, 1, 1], [90, 5, 33], num_decodes=3, pad_tokens=1)
    batch.plan.provider_data = provider.prepare(batch.plan)
    assert batch.plan.provider_data.num_kv_splits == num_kv_splits
    assert_matches_reference(batch, batch.run(provider))
    assert descriptors_made, "the launch did not take the descriptor path"


def test_descriptor_layout_accepts_16bit_aligned_caches_only() -> None:
    ok = _kernels().descriptor_layout_ok
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    packed = torch.zeros(4, 2, 16, 128, dtype=torch.float16).transpose(1, 2)  # vLLM's K|V
    assert ok(cache)
    assert ok(packed[..., :64]) and ok(packed[..., 64:])
    assert not ok(cache.float())  # 32-bit elements
    assert not ok(torch.zeros(4, 16, 1, 4, dtype=torch.bfloat16))  # 8-byte rows
    assert not ok(cache[..., :32:2])  # strided rows
    misaligned = torch.zeros(cache.numel() + 8, dtype=torch.bfloat16)[1 : 1 + cache.numel()]
    assert not ok(misaligned.view(4, 16, 2, 64))  # base 2 bytes past an aligned address


def test_tma_is_off_for_caches_on_the_host() -> None:
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    assert not _kernels().tma_supported(cache)


# ---------------------------------------------------------------- GPU


def _needs_descriptors() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need compute capability 9 or later")


def _only_launch(provider: TritonProvider, launch_name: str) -> None:
    """Make ``launch_name`` (descriptors on) every launch of its family (prefill or
    decode), whichever the heuristics would pick for a batch."""
    family = launch_name.split("_")[0]
    launch = _with_tma(getattr(provider, launch_name))
    for name in _launch_names(provider):
        if name.startswith(family):
            setattr(provider, name, dict(launch))


@pytest.mark.cuda
@pytest.mark.parametrize("launch_name", _launch_names(TritonProvider()))
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_gpu_every_launch_with_descriptors(launch_name: str, head_size: int) -> None:
    """Each launch the provider defines, descriptors on, on page tiles: a mixed batch
    for prefill launches, a decode batch (split and one-wave sizes) for decode ones."""
    _needs_descriptors()
    provider = TritonProvider()
    _only_launch(provider, launch_name)
    spec = AttentionSpec(32, 8, head_size, block_size=128, dtype=torch.bfloat16)
    if launch_name.startswith("prefill"):
        batches = [Batch(spec, [1, 300, 45], [700, 0, 260], num_decodes=1, pad_tokens=2)]
    else:
        batches = [
            Batch(spec, [1], [3000], num_decodes=1, pad_tokens=2),
            Batch(spec, [1] * 16, [(97 * r) % 700 for r in range(16)], num_decodes=16),
        ]
    for batch in batches:
        assert _kernels().tma_supported(batch.key_cache)
        assert_matches_reference(batch, batch.run(provider))


@pytest.mark.cuda
@pytest.mark.parametrize(
    "features",
    [{"sliding_window": 100}, {"logits_soft_cap": 30.0}, {"causal": False}, {"scale": 0.3}],
)
def test_gpu_descriptor_features(features: dict) -> None:
    """Descriptor loads with each feature; a sliding window keeps the portable loads
    (ptxas crashes on the windowed descriptor kernel), still equal to the reference."""
    _needs_descriptors()
    provider = TritonProvider()
    for name in _launch_names(provider):
        setattr(provider, name, _with_tma(getattr(provider, name)))
    spec = AttentionSpec(16, 4, 128, block_size=128, dtype=torch.bfloat16, **features)
    batch = Batch(spec, [1, 1, 260, 45], [900, 3, 0, 300], num_decodes=2, pad_tokens=2)
    assert_matches_reference(batch, batch.run(provider))
    decode = Batch(spec, [1] * 4, [1500, 99, 100, 101], num_decodes=4, pad_tokens=1, seed=2)
    assert_matches_reference(decode, decode.run(provider))


@pytest.mark.cuda
def test_gpu_descriptors_over_packed_kv_cache_views() -> None:
    """vLLM's packed ``[blocks, kv_heads, block, 2 * head]`` cache read as K and V views."""
    _needs_descriptors()
    provider = TritonProvider()
    for name in _launch_names(provider):
        setattr(provider, name, _with_tma(getattr(provider, name)))
    spec = AttentionSpec(32, 8, 128, block_size=128, dtype=torch.bfloat16)
    batch = Batch(spec, [1, 1, 200], [500, 7, 300], num_decodes=2, packed_kv=True)
    assert not batch.key_cache.is_contiguous()
    assert _kernels().tma_supported(batch.value_cache)
    assert_matches_reference(batch, batch.run(provider))
