"""The bridge's V2 micro-batch runner builds what vLLM's ``UBatchRunner.prepare`` reads.

vLLM's constructor builds CUDA streams (which a CPU build of torch refuses) beside the
buffers ``prepare`` slices into; the bridge builds the rest itself
(``vllm_seam.v2_ubatch_runner_buffers``). Against vLLM's constructor source: every
attribute it sets is set, by the bridge or in ``V2_UBATCH_RUNNER_CUDA_ATTRIBUTES``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import SimpleNamespace

import torch
from vllm.config import VllmConfig
from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

from npu_vllm_bridge.vllm_seam import V2_UBATCH_RUNNER_CUDA_ATTRIBUTES, v2_ubatch_runner_buffers


def _attributes_set_by(function) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def test_the_bridges_runner_sets_every_attribute_vllms_constructor_sets():
    config = VllmConfig()
    config.parallel_config.enable_dbo = True
    runner = SimpleNamespace()
    state = object()
    v2_ubatch_runner_buffers(runner, config, torch.device("cpu"), state, [], None, 5)
    expected = _attributes_set_by(UBatchRunner.__init__)
    assert expected, "no attribute found in vLLM's UBatchRunner.__init__"
    ours = set(vars(runner))
    assert ours == expected, (
        f"vLLM's UBatchRunner.__init__ sets {sorted(expected)}; the bridge's runner sets "
        f"{sorted(ours)} (missing {sorted(expected - ours)}, extra {sorted(ours - expected)})"
    )
    assert set(V2_UBATCH_RUNNER_CUDA_ATTRIBUTES) <= expected
    assert runner.num_ubatches == 2 and runner.model_state is state
    # One query_start_loc (max_num_reqs + 1) and seq_lens (max_num_reqs) per micro-batch,
    # apart, as prepare rebases each micro-batch onto its own.
    assert [t.shape[0] for t in runner.ubatch_query_start_loc] == [6, 6]
    assert [t.shape[0] for t in runner.ubatch_seq_lens] == [5, 5]
    first, second = runner.ubatch_seq_lens
    assert first.data_ptr() != second.data_ptr() and first.dtype == torch.int32
