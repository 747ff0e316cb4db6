"""``run`` issues no op that needs a device-to-host sync (checked by op recording on CPU).

On CUDA these ops (reading a scalar, ``nonzero``, boolean-mask indexing) would
stall the host; the recorded aten ops of ``run`` must contain none of them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from npu_attention_cases import make_case
from torch.utils._python_dispatch import TorchDispatchMode

from npu_attention import AttentionSpec, plan, run

SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "item", "unique", "_unique2"}


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncing: list[str] = []
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        name = func.overloadpacket.__name__
        bool_index = name.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for arg in args
            if isinstance(arg, (list, tuple))
            for i in arg
        )
        if name in SYNCING_OPS or bool_index:
            self.syncing.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "num_decodes", "spec_tokens"),
    [([1, 1, 1, 1], [30, 2, 0, 17], 4, 0), ([3, 3], [9, 40], 2, 2), ([1, 7, 20], [4, 3, 0], 1, 0)],
    ids=["decode", "spec_decode", "mixed"],
)
def test_run_has_no_syncing_ops(query_lens, context_lens, num_decodes, spec_tokens) -> None:
    spec = AttentionSpec(4, 2, 64, 16, dtype=torch.float16, num_speculative_tokens=spec_tokens)
    case = make_case(spec, query_lens, context_lens, num_decodes, pad_tokens=3)
    paged = case.paged(np.random.default_rng(0))
    step = plan(case.cu_seqlens_q, case.seq_lens, paged.block_tables, paged.slot_mapping,
                num_decodes, spec)  # fmt: skip
    key, value = case.new_kv()
    out = torch.empty_like(case.query)
    recorder = _OpRecorder()
    with recorder:
        run(case.query, key, value, paged.key_cache, paged.value_cache, step, out)
    assert recorder.count > 0, "the recorder saw no op"
    assert recorder.syncing == []


def test_recorder_detects_syncing_ops() -> None:
    recorder = _OpRecorder()
    x = torch.arange(4)
    with recorder:
        x[x > 1].sum().item()
    assert "_local_scalar_dense" in recorder.syncing
    assert any(name.startswith("index") or name == "nonzero" for name in recorder.syncing)
