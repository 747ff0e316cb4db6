"""The PyTorch versions of V2's decode-step kernels (``host/v2_kernels.py``)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from v2_kernel_cases import CASES, ngram_block_size

from npu_vllm_bridge.host import v2_kernels
from npu_vllm_bridge.host.slot_mapping import compute_slot_mapping
from npu_vllm_bridge.host.v2_kernels import KERNELS, register_pointer_tensors

CASES_SCRIPT = Path(__file__).with_name("v2_kernel_cases.py")


def _parameters(fn) -> list[str]:
    names = getattr(fn, "arg_names", None)  # a Triton kernel, or vLLM's override of one
    if names is not None:
        return list(names)
    parameters = inspect.signature(fn).parameters.values()
    return [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD]


# Arguments vLLM 0.33's kernels added, which 0.32's do not take (they default to off).
NEWER_ARGUMENTS = {
    "vllm.v1.worker.gpu.input_batch._post_update_kernel": (
        "draft_tokens_ptr", "draft_tokens_out_ptr", "num_draft_tokens",
    ),
    "vllm.v1.worker.gpu.block_table._gather_block_tables_kernel": (
        "num_computed_tokens_ptr", "sliding_window_reach_ptr", "block_sizes_ptr",
        "MASK_SLIDING_WINDOW",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_arguments_are_named_as_the_kernels(name: str) -> None:
    """Ours take this vLLM's kernel's arguments in its order (vLLM launches them by
    position), and arguments only the other vLLM's kernel has have defaults."""
    module, attr = name.rsplit(".", 1)
    kernel = getattr(importlib.import_module(module), attr)
    newer = NEWER_ARGUMENTS.get(name, ())
    theirs = _parameters(kernel)
    ours = _parameters(KERNELS[name])
    assert [p for p in ours if p in theirs or p not in newer] == theirs
    defaults = inspect.signature(KERNELS[name]).parameters
    for missing in set(ours) - set(theirs):
        assert defaults[missing].default is not inspect.Parameter.empty, missing


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Each case of ``v2_kernel_cases.py``, run in host mode with V2 (vLLM's kernels
    under Triton's interpreter): ``ok`` or how ours differs."""
    env = dict(
        os.environ,
        NPU_BRIDGE_DEVICE="cpu",
        VLLM_USE_V2_MODEL_RUNNER="1",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    proc = subprocess.run(
        [sys.executable, str(CASES_SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("case", list(CASES))
def test_writes_what_the_interpreted_kernel_writes(interpreted: dict[str, str], case: str) -> None:
    if interpreted[case].startswith("skip: "):
        pytest.skip(interpreted[case][len("skip: ") :])
    assert interpreted[case] == "ok", interpreted[case]


def test_context_parallel_slot_mapping_follows_vllms_rule() -> None:
    """Two ranks, interleave 4: each rank's slots are those of the V1 host kernel
    (``slot_mapping``), which the Triton interpreter cannot run here."""
    torch.manual_seed(0)
    table = torch.randint(0, 40, (4, 16), dtype=torch.int32)
    query_start_loc = torch.tensor([0, 5, 30], dtype=torch.int32)
    positions = torch.cat([torch.arange(40, 45), torch.arange(3, 28)])
    for rank in (0, 1):
        ours = torch.full((1, 40), 7, dtype=torch.int64)
        register_pointer_tensors([table])
        v2_kernels._compute_slot_mappings(
            40, torch.tensor([3, 0], dtype=torch.int32), query_start_loc, positions,
            torch.tensor([table.data_ptr()], dtype=torch.uint64), torch.tensor([16]),
            torch.tensor([16], dtype=torch.int32), torch.tensor([True]), torch.tensor([True]),
            ours, 40, rank, CP_SIZE=2, CP_INTERLEAVE=4, PAD_ID=-1,
        )  # fmt: skip
        v1 = torch.full((40,), 7, dtype=torch.int64)
        compute_slot_mapping(
            30, 40, query_start_loc, positions, table[[3, 0]], 16, v1, 16,
            TOTAL_CP_WORLD_SIZE=2, TOTAL_CP_RANK=rank, CP_KV_CACHE_INTERLEAVE_SIZE=4,
        )  # fmt: skip
        assert torch.equal(ours[0], v1)


def test_gumbel_sample_stores_each_rows_logits_in_its_cache_column() -> None:
    """Drafting with a logits cache (the interpreter cannot run the kernel's store):
    each valid row's logits land in its request's column, before temperature."""
    logits = torch.randn(3, 40)
    cache = torch.zeros(4, 2, 40)
    local_argmax = torch.empty(3, 1, dtype=torch.int64)
    local_max = torch.empty(3, 1)
    v2_kernels._gumbel_sample(
        local_argmax, 1, local_max, 1, cache, 80, 40, torch.tensor([1, 0, 1]), logits, 40,
        logits, 40, torch.tensor([2, 0, -1], dtype=torch.int32), torch.arange(4),
        torch.arange(3), torch.tensor([0.0, 0.0, 0.5, 0.0]), 40,
        BLOCK_SIZE=64, IS_DRAFTING=True, PER_TOKEN_COL=True,
    )  # fmt: skip
    assert torch.equal(cache[2, 1], logits[0]) and torch.equal(cache[0, 0], logits[1])
    assert cache.count_nonzero() == 2 * 40
    assert local_argmax[1, 0] == logits[1].argmax()  # temperature 0: greedy


def test_a_pointer_no_tensor_was_registered_for_is_refused() -> None:
    stray = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="register_pointer_tensors"):
        v2_kernels._gather_block_tables(
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([stray.data_ptr()], dtype=torch.uint64),
            torch.tensor([stray.data_ptr()], dtype=torch.uint64),
            torch.tensor([3]), torch.ones(1, 2, dtype=torch.int32), 2, 1,
        )  # fmt: skip


def test_update_draft_inputs_replays_with_each_replays_draft_step() -> None:
    """Captured once in a host graph (as V2's drafter graphs capture it), the draft-step
    update reads the step from its tensor at every replay: step 0 of 3 then 1 feed
    the next step; the last stores only the token. Expected values written by hand."""
    from npu_graphs import get_backend

    steps, max_model_len = 3, 12
    out = torch.full((3, steps), -1, dtype=torch.int64)
    next_hidden = torch.zeros(4, 2)
    input_ids = torch.zeros(4, dtype=torch.int32)
    positions = torch.tensor([5, 11, 0, 0])
    sample_positions = torch.tensor([6, 12, 0])
    seq_lens = torch.tensor([6, 12, 0], dtype=torch.int32)
    tokens = torch.tensor([40, 41])
    step = torch.tensor(0)
    hidden = torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])

    def update() -> None:
        v2_kernels._update_draft_inputs(
            out, steps, next_hidden, 2, input_ids, positions, sample_positions, seq_lens,
            tokens, step, hidden, 2, 2, max_model_len, steps,
        )  # fmt: skip

    backend = get_backend("host")
    graph = backend.new_graph()
    with backend.capture(graph):
        update()  # step 0, run once by the capture
    for value in (1, 2):
        step.fill_(value)
        tokens.add_(10)
        hidden.mul_(2)
        backend.replay(graph)
    assert out.tolist() == [[40, 50, 60], [41, 51, 61], [-1, -1, -1]]
    assert input_ids.tolist() == [50, 51, 0, 0]  # the last step feeds nothing
    assert next_hidden.tolist() == [[2.0, 4.0], [6.0, 8.0], [0.0, 0.0], [0.0, 0.0]]
    assert positions.tolist() == [7, 11, 0, 0]  # capped at max_model_len - 1
    assert sample_positions.tolist() == [8, 14, 0]
    assert seq_lens.tolist() == [8, 12, 0]  # capped at max_model_len


def test_multi_module_mtp_kernels_replay_with_each_replays_values() -> None:
    """Multi-module MTP's cache of draft inputs and shift of input ids, captured once in
    a host graph, replay on the values of each replay: the same writes as a call."""
    from npu_graphs import get_backend

    def buffers(seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return {
            "input_ids": torch.randint(0, 99, (12,), generator=generator),
            "hidden": torch.randn(12, 8, generator=generator),
            "cached_ids": torch.zeros(5, 2, dtype=torch.int64),
            "cached_hidden": torch.zeros(5, 2, 8),
            "idx_mapping": torch.tensor([3, 1, -1], dtype=torch.int32),
            "query_start_loc": torch.tensor([0, 4, 6, 6], dtype=torch.int32),
            "last": torch.tensor([3, 5, 5]),
            "drafts": torch.randint(100, 199, (3,), generator=generator),
        }

    def run(b: dict[str, torch.Tensor]) -> None:
        v2_kernels._cache_inputs(
            b["input_ids"], None, 0, b["hidden"], 8, b["cached_ids"], 2, None, 0, 0,
            b["cached_hidden"], 16, 8, b["idx_mapping"], b["last"], b["query_start_loc"], 3, 8,
        )  # fmt: skip
        v2_kernels._shift_input_ids(
            b["input_ids"], b["idx_mapping"], b["query_start_loc"], b["last"], b["drafts"]
        )

    captured = buffers(0)
    backend = get_backend("host")
    graph = backend.new_graph()
    with backend.capture(graph):
        run(captured)
    later = buffers(1)  # other values, a rejection (last index 1 of 0..3), other states
    later["last"].copy_(torch.tensor([1, 5, 5]))
    later["idx_mapping"].copy_(torch.tensor([0, 4, -1], dtype=torch.int32))
    for name, tensor in later.items():
        captured[name].copy_(tensor)
    backend.replay(graph)
    run(later)
    for name, tensor in later.items():
        assert torch.equal(captured[name], tensor), name
    assert later["cached_ids"][0, 0] != 0 and later["cached_ids"][3].tolist() == [0, 0]


def test_gumbel_sample_captured_greedy_replays_with_temperatures_and_logits_cache() -> None:
    """V2's probabilistic draft sampling inside a drafter graph: captured with every
    temperature 0 (a capture's dummy batch), replayed with temperatures, other logits
    and a padding row whose request state collides with a real one's; the replay
    writes what a call outside any capture writes (noise only on rows with a
    temperature there, the path the interpreted-kernel cases check)."""
    from npu_graphs import RuntimeMode, get_backend
    from npu_graphs.session import CaptureSession, capture_session

    vocab, block = 300, 128

    def buffers() -> dict[str, torch.Tensor]:
        return {
            "local_argmax": torch.zeros(3, 3, dtype=torch.int64),
            "local_max": torch.zeros(3, 3),
            "cache": torch.zeros(4, 2, vocab),
            "column": torch.tensor(0),
            "logits": torch.zeros(3, vocab),
            "states": torch.tensor([2, 0, -1], dtype=torch.int32),
            "seeds": torch.tensor([5, 6, 7, 8]),
            "pos": torch.tensor([10, 11, 12]),
            "temperature": torch.zeros(4),
        }

    def sample(b: dict[str, torch.Tensor]) -> None:
        v2_kernels._gumbel_sample(
            b["local_argmax"], 3, b["local_max"], 3, b["cache"], 2 * vocab, vocab, b["column"],
            b["logits"], vocab, b["logits"], vocab, b["states"], b["seeds"], b["pos"],
            b["temperature"], vocab, BLOCK_SIZE=block, IS_DRAFTING=True,
        )  # fmt: skip

    captured = buffers()
    backend = get_backend("host")
    graph = backend.new_graph()
    session = CaptureSession(backend, graph, "draft", RuntimeMode.FULL, None)
    with capture_session(session), backend.capture(graph):  # as a GraphWrapper captures
        sample(captured)
    later = buffers()
    later["logits"].copy_(torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)))
    later["temperature"].copy_(torch.tensor([0.7, 0.0, 1.3, 0.0]))
    later["column"].fill_(1)
    for name, tensor in later.items():
        captured[name].copy_(tensor)
    backend.replay(graph)
    sample(later)
    for name in ("local_argmax", "local_max", "cache"):
        assert torch.equal(captured[name], later[name]), name
    assert torch.equal(later["cache"][2, 1], later["logits"][0])  # the padding row stored none
    assert torch.equal(later["cache"][0, 1], later["logits"][1])
    assert later["cache"][:, 0].count_nonzero() == 0


def _ngram_drafts_by_rule(
    history: list[int], num_sampled: int, last: int, min_n: int, max_n: int, k: int
) -> list[int]:
    """vLLM's ngram drafting rule, written from its documentation: the longest suffix
    of ``min_n`` to ``max_n`` tokens that occurred before (ending before the suffix
    itself), its rightmost occurrence; the ``k`` tokens that followed it, the last
    sampled token where the history ends first; without a match, or when the request
    sampled nothing, ``k`` times the last sampled token."""
    if num_sampled > 0:
        for n in range(max_n, min_n - 1, -1):
            for pos in range(len(history) - n - 1, -1, -1):
                if history[pos : pos + n] == history[len(history) - n :]:
                    follows = history[pos + n : pos + n + k]
                    return follows + [last] * (k - len(follows))
    return [last] * k


@pytest.mark.parametrize("seed", range(12))
def test_ngram_drafts_follow_the_rightmost_longest_match(seed: int) -> None:
    """Random token histories (few token ids, so n-grams recur; lengths from 0 to the
    model length), random n ranges and draft counts: the scan and finalize, called as
    vLLM's ``NgramGPUSpeculator.propose`` launches its kernels, draft what the rule
    says; rows past the batch are left alone. (Triton's interpreter cannot run vLLM's
    finalize kernel as it is: ``v2_kernel_cases.py``.)"""
    rng = random.Random(seed)
    max_model_len = rng.choice([5, 40, 64, 150, 300, 1100])
    max_num_reqs, num_reqs = 8, rng.randint(1, 8)
    min_n = rng.randint(1, 3)
    max_n, k = rng.randint(min_n, min_n + 3), rng.randint(1, 5)
    vocabulary = rng.choice([2, 3, 6])
    lengths = [rng.randint(0, max_model_len) for _ in range(max_num_reqs)]
    histories = [[rng.randrange(vocabulary) for _ in range(n)] for n in lengths]
    token_ids = torch.full((max_num_reqs, max_model_len), 99, dtype=torch.int32)
    for state, history in enumerate(histories):
        token_ids[state, : len(history)] = torch.tensor(history, dtype=torch.int32)
    states = rng.sample(range(max_num_reqs), num_reqs)
    num_sampled = [rng.choice([0, 1, 1, 2]) for _ in states]
    last_sampled = torch.arange(1000, 1000 + max_num_reqs).view(max_num_reqs, 1)
    block = ngram_block_size(max_model_len)
    num_blocks = -(-max_model_len // block)
    scratch = torch.zeros(max_num_reqs, num_blocks, dtype=torch.int64)
    drafts = torch.full((max_num_reqs, k), -1, dtype=torch.int64)
    idx_mapping = torch.tensor(states, dtype=torch.int64)
    total_len = torch.tensor(lengths, dtype=torch.int32)
    sampled = torch.tensor(num_sampled, dtype=torch.int32)
    v2_kernels._ngram_scan(
        token_ids, token_ids.stride(0), idx_mapping, total_len, sampled, scratch,
        scratch.stride(0), max_model_len, min_n, max_n, 1 << (max_n - 1).bit_length(), block,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    v2_kernels._ngram_finalize(
        token_ids, token_ids.stride(0), idx_mapping, total_len, sampled, last_sampled.view(-1),
        scratch, scratch.stride(0), drafts, max_model_len, num_blocks, k,
        1 << (k - 1).bit_length(), 1 << (num_blocks - 1).bit_length(), num_warps=2, num_stages=1,
    )  # fmt: skip
    expected = [
        _ngram_drafts_by_rule(histories[state], count, 1000 + state, min_n, max_n, k)
        for state, count in zip(states, num_sampled)
    ]
    assert drafts[:num_reqs].tolist() == expected
    assert (drafts[num_reqs:] == -1).all()
