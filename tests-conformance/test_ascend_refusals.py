"""What the ascend provider refuses, and how it is found and chosen."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from ascend_cases import CASES, HostAscendProvider, build_batch, run_provider

from npu_attention import get_provider, plan, register_provider, run
from npu_attention.providers.ascend import AscendProvider

ASCEND_TARGET = "npu_attention.providers.ascend:AscendProvider"


@pytest.fixture
def host_ascend():
    register_provider("ascend", "ascend_cases:HostAscendProvider")
    yield "ascend"
    register_provider("ascend", ASCEND_TARGET)


def _plan(case, provider: str, **batch_changes):
    batch = dataclasses.replace(build_batch(case), **batch_changes)
    step = plan(
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.block_tables,
        batch.slot_mapping,
        case.num_decodes,
        case.spec,
        provider=provider,
    )
    return batch, step


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"logits_soft_cap": 30.0}, ValueError, "does not support logits_soft_cap"),
        ({"block_size": 64}, ValueError, "needs block_size=128 .*got block_size=64"),
        ({"dtype": torch.float32}, TypeError, "needs dtype in"),
        ({"causal": False, "sliding_window": 8}, ValueError, "sliding_window only with causal"),
        ({"num_heads": 520, "num_kv_heads": 260}, ValueError, "needs num_heads <= 256"),
        ({"num_heads": 130, "num_kv_heads": 2}, ValueError, "num_kv_heads <= 64"),
    ],
)
def test_unsupported_spec_is_refused_in_plan(stand_in, host_ascend, change, error, message):
    case = CASES[0]
    spec = dataclasses.replace(case.spec, **change)
    batch = build_batch(dataclasses.replace(case, dtype=torch.float16))
    tables = batch.block_tables
    if spec.block_size != case.spec.block_size:  # same tokens, smaller pages
        tables = torch.arange(tables.numel() * 2, dtype=torch.int32).view(tables.shape[0], -1)
    with pytest.raises(error, match=message):
        plan(
            batch.cu_seqlens_q,
            batch.seq_lens,
            tables,
            batch.slot_mapping,
            0,
            spec,
            provider=host_ascend,
        )


def test_padding_slot_among_real_tokens_is_skipped(stand_in, host_ascend) -> None:
    case = CASES[0]
    batch = build_batch(case)
    slots = batch.slot_mapping.clone()
    slots[[2, 7]] = -1
    batch = dataclasses.replace(batch, slot_mapping=slots)
    ascend, reference = run_provider(batch, host_ascend), run_provider(batch, "reference")
    assert torch.equal(ascend.key_cache, reference.key_cache)
    assert torch.equal(ascend.value_cache, reference.value_cache)
    (write,) = stand_in.log.of("npu_scatter_pa_kv_cache")
    assert write.arguments["slot_mapping"].tolist() == [s for s in slots.tolist() if s >= 0]


def test_non_contiguous_cache_is_refused(stand_in, host_ascend) -> None:
    batch, step = _plan(CASES[0], host_ascend)
    packed = torch.cat([batch.key_cache, batch.value_cache], dim=-1)  # K and V in one tensor
    key_cache, value_cache = packed.split(batch.key_cache.shape[-1], dim=-1)
    out = torch.zeros_like(batch.query)
    with pytest.raises(ValueError, match="needs a contiguous key_cache"):
        run(batch.query, batch.key, batch.value, key_cache, value_cache, step, out)
    with pytest.raises(ValueError, match="needs a contiguous key_cache"):
        step.provider.attend(batch.query, key_cache, value_cache, step, out)


def test_attend_without_cache_needs_key_and_value(stand_in, host_ascend) -> None:
    batch, step = _plan(CASES[0], host_ascend)
    with pytest.raises(ValueError, match="attend without caches needs key and value"):
        step.provider.attend(batch.query, None, None, step, torch.zeros_like(batch.query))


def test_plan_of_another_provider_is_refused(stand_in) -> None:
    batch, step = _plan(CASES[0], "reference")
    with pytest.raises(ValueError, match="was not prepared by the ascend provider"):
        AscendProvider().attend(
            batch.query, batch.key_cache, batch.value_cache, step, torch.zeros_like(batch.query)
        )


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="a real torch_npu is installed"
)
def test_unavailable_without_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "torch_npu" not in p])
    assert AscendProvider.is_available() is False
    assert "torch_npu" not in sys.modules


def test_available_with_torch_npu_but_only_for_npu_tensors(stand_in) -> None:
    assert AscendProvider.is_available() is True
    assert HostAscendProvider.is_available() is True
    provider = get_provider("ascend")  # torch.device("npu") needs the real torch_npu
    assert type(provider) is AscendProvider
    with pytest.raises(ValueError, match="runs on \\('npu',\\), got tensors on 'cpu'"):
        get_provider("ascend", device="cpu")


def test_importing_the_provider_does_not_import_torch_npu() -> None:
    code = (
        "import sys, npu_attention.providers.ascend as a; "
        "assert 'torch_npu' not in sys.modules, 'imported at module load'; "
        "print(a.AscendProvider.name)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ascend"
