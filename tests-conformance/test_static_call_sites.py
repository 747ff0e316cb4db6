"""Every torch_npu / torch.npu call site in the packages fits torch_npu's API, read statically.

The runtime checks cover the code the stand-ins can drive; this covers every
call site in ``packages/*/src`` (the vLLM bridge's NPU paths included): the name
exists in torch_npu 2.14.0, and the keywords and positional arity fit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from call_sites import check_source, find_call_sites

PACKAGES = Path(__file__).resolve().parent.parent / "packages"
SOURCES = sorted(PACKAGES.glob("*/src/**/*.py"))


def test_sources_are_found() -> None:
    assert any(path.name == "ascend.py" for path in SOURCES)
    sites = [site for path in SOURCES for site in find_call_sites(path.read_text())]
    assert {"npu_fused_infer_attention_score.out", "graph_task_update_begin"} <= {
        site.name for site in sites
    }


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(PACKAGES)))
def test_call_sites_fit_torch_npu(torch_npu_api, path: Path) -> None:
    assert check_source(path.read_text(), torch_npu_api, torch_npu_api.atb_ops) == []


WRONG_CALLS = """
import torch
import torch_npu
from npu_attention.providers.ascend import torch_npu_module

def wrong(q, k, v, stream, handle):
    torch_npu.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_q=[1])
    torch_npu.npu_fused_attention_v9(q)
    torch_npu.npu_scatter_pa_kv_cache(q, k, v)
    npu = torch_npu_module()
    npu.npu_fused_infer_attention_score(q, k, v, 8)
    torch.npu.graph_task_update_begin(stream)
    torch.npu.graph_task_update_start(stream, handle)
    torch.npu.NPUGraph().capture_begin()
    torch.npu.graph(None, pool=None, stream_priority=1)
    torch_npu.npu.ExternalEvent(1)
    torch_npu._npu_paged_attention(q, k, v)  # an ATB op: bound to its header declaration
    torch_npu.npu.utils.get_cann_version()
    torch.npu.utils.get_cann_versions()
    npu.atb.npu_multi_head_latent_attention(q, q, k, v, q, [1], 32, 0.1, 1, head_num=32)
    npu.atb.npu_multi_head_latent_attention(q, q, k, v, q, [1], 32, 0.1, 1, True, out=q)
    npu.atb.npu_multi_head_latent_attention(
        q, q, k, v, q, [1], 32, 0.1, 1, return_lse=True, calc_type="calc_type_ring",
        workspace=q, output=q, lse=k,
    )
"""


def test_wrong_call_sites_are_reported(torch_npu_api) -> None:
    problems = check_source(WRONG_CALLS, torch_npu_api, torch_npu_api.atb_ops)
    expected = [
        "unexpected keyword argument 'actual_seq_lengths_q'",
        "no operator 'npu_fused_attention_v9'",
        "missing a required argument: 'value_cache'",
        "too many positional arguments",
        "missing a required argument: 'handle'",
        "torch.npu has no 'graph_task_update_start'",
        "unexpected keyword argument 'stream_priority'",
        "too many positional arguments",
        "missing a required argument: 'num_kv_heads'",
        "torch.npu.utils.get_cann_versions is not in torch_npu",
        "no overload takes this call",
        "no overload takes this call",
    ]
    assert len(problems) == len(expected), problems
    for problem, message in zip(problems, expected):
        assert message in problem, (problem, message)
