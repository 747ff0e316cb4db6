"""Every torch_npu call site of the ascend provider is exercised by the conformance runs."""

from __future__ import annotations

from pathlib import Path

from ascend_cases import CASES, build_batch, run_provider
from call_sites import calls_through

import npu_attention.providers.ascend as ascend_module
from npu_attention import register_provider


def test_static_call_sites_of_the_ascend_provider() -> None:
    sites = calls_through(Path(ascend_module.__file__), set(), {"torch_npu_module"})
    assert sites == {
        "npu_scatter_pa_kv_cache",
        "_npu_fused_infer_attention_score_get_max_workspace",
        "npu_fused_infer_attention_score.out",
        "npu_fusion_attention",
    }


def test_every_call_site_runs_under_the_schema_checks(stand_in) -> None:
    register_provider("ascend-coverage", "ascend_cases:HostAscendProvider")
    for case in CASES:
        run_provider(build_batch(case), "ascend-coverage")
    sites = calls_through(Path(ascend_module.__file__), set(), {"torch_npu_module"})
    assert sites <= stand_in.log.names()
