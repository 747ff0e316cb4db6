"""Each PyTorch kernel of ``v2_kernels`` against vLLM's Triton kernel, interpreted.

Run as a script (``python v2_kernel_cases.py``) in a process of its own: it turns host
mode's V2 set-up on (``NPU_BRIDGE_DEVICE=cpu``, ``VLLM_USE_V2_MODEL_RUNNER=1``) before
vLLM is imported, so vLLM's kernels are Triton's interpreted functions. Every case
builds the same small inputs twice (same seed), launches the interpreted kernel on
one copy and the PyTorch version on the other, and compares what they wrote. Prints
one line: ``RESULT {case: "ok" | error message}``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable

import torch

PAD = -1


class NotInThisVllm(Exception):
    """The case exercises arguments this vLLM's kernel does not have."""


def _kernel_takes(kernel_name: str, argument: str) -> bool:
    import importlib

    module_name, attr = kernel_name.rsplit(".", 1)
    return argument in getattr(importlib.import_module(module_name), attr).arg_names


def _launch_both(case: Callable[[], tuple], kernel_name: str) -> list[tuple[torch.Tensor, ...]]:
    """Build ``case``'s inputs twice; run the interpreted kernel and our version;
    return what each run wrote (the tensors the case names)."""
    import importlib

    from npu_vllm_bridge.host.v2_kernels import KERNELS

    module_name, attr = kernel_name.rsplit(".", 1)
    kernel = getattr(importlib.import_module(module_name), attr)
    written = []
    for run in (lambda grid: kernel[grid], lambda grid: KERNELS[kernel_name]):
        torch.manual_seed(0)
        grid, args, kwargs, outputs = case()
        with _boolean_masks(kernel_name):
            run(grid)(*args, **kwargs)
        written.append(tuple(t.clone() for t in outputs))
    return written


def _pointer_table(tensors: list[torch.Tensor]) -> torch.Tensor:
    from npu_vllm_bridge.host.v2_kernels import register_pointer_tensors

    register_pointer_tensors(tensors)
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def pos_seq_lens():
    idx_mapping = torch.tensor([4, 0, 2], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    num_computed = torch.tensor([5, 0, 9, 0, 1, 0], dtype=torch.int32)
    pos = torch.full((10,), -7, dtype=torch.int64)
    seq_lens = torch.full((6,), 99, dtype=torch.int32)
    args = (pos, seq_lens, idx_mapping, query_start_loc, num_computed, 6)
    return (4,), args, {"BLOCK_SIZE": 1024}, (pos, seq_lens)


def combine_sampled_and_draft_tokens():
    # Rows: a prefill chunk, a decode, a decode with two draft tokens.
    idx_mapping = torch.tensor([1, 3, 0], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    seq_lens = torch.tensor([4, 11, 20], dtype=torch.int32)
    prefill_len = torch.tensor([6, 9, 0, 5], dtype=torch.int32)
    last_sampled = torch.tensor([[70], [71], [72], [73]])  # vLLM's [max_num_reqs, 1]
    draft_tokens = torch.arange(100, 108, dtype=torch.int32).view(4, 2)
    cu_num_logits = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
    input_ids = torch.arange(8, dtype=torch.int32)
    logits_indices = torch.full((5,), -1, dtype=torch.int64)
    args = (
        input_ids, idx_mapping, last_sampled, query_start_loc, seq_lens, prefill_len,
        draft_tokens, draft_tokens.stride(0), cu_num_logits, logits_indices,
    )  # fmt: skip
    kwargs = {"BLOCK_SIZE": 4, "NUM_NEW_SAMPLED_TOKENS": 1}
    return (3,), args, kwargs, (input_ids, logits_indices)


def num_sampled_and_rejected():
    idx_mapping = torch.tensor([2, 0, 1], dtype=torch.int32)
    seq_lens = torch.tensor([3, 12, 9], dtype=torch.int32)
    prefill_len = torch.tensor([4, 5, 8], dtype=torch.int32)
    cu_num_logits = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    num_sampled = torch.tensor([1, 2, 2], dtype=torch.int32)
    num_rejected = torch.full((3,), -5, dtype=torch.int32)
    args = (num_sampled, num_rejected, seq_lens, cu_num_logits, idx_mapping, prefill_len)
    return (3,), args, {}, (num_sampled, num_rejected)


def post_update(*, drafts: bool = False):
    """vLLM 0.33's kernel takes draft tokens to copy to each request's row: none here
    unless ``drafts`` (0.32's takes none)."""
    takes_drafts = _kernel_takes(_INPUT_BATCH + "_post_update_kernel", "draft_tokens_ptr")
    if drafts and not takes_drafts:
        raise NotInThisVllm("this vLLM's _post_update_kernel copies no draft tokens")
    idx_mapping = torch.tensor([2, -1, 0, 3], dtype=torch.int32)
    num_computed = torch.tensor([10, 4, 7, 0], dtype=torch.int32)
    last_sampled = torch.zeros(4, 1, dtype=torch.int64)
    bin_counts = torch.zeros(4, 16, dtype=torch.int32)
    sampled = torch.tensor([[5, 6, 7], [1, 1, 1], [9, 9, 2], [4, 0, 0]], dtype=torch.int64)
    num_sampled = torch.tensor([3, 1, 2, 0], dtype=torch.int32)
    num_rejected = torch.tensor([0, 0, 1, 0], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3, 4, 7, 8], dtype=torch.int32)
    all_token_ids = torch.zeros(4, 32, dtype=torch.int32)
    total_len = torch.tensor([11, 4, 8, 1], dtype=torch.int32)
    args = (
        idx_mapping, num_computed, last_sampled, bin_counts, bin_counts.stride(0), sampled,
        sampled.stride(0), num_sampled, num_rejected, query_start_loc, all_token_ids,
        all_token_ids.stride(0), total_len,
    )  # fmt: skip
    outputs = (num_computed, last_sampled, bin_counts, all_token_ids, total_len)
    if drafts:
        draft_tokens = torch.arange(200, 208, dtype=torch.int64).view(4, 2)
        draft_tokens_out = torch.full((5, 2), 77, dtype=torch.int64)  # [max_num_reqs, k]
        args = (*args, draft_tokens, draft_tokens_out, 2)
        outputs = (*outputs, draft_tokens_out)
    elif takes_drafts:
        args = (*args, None, None, 0)
    return (4,), args, {"num_warps": 1}, outputs


def gather_block_tables(*, sliding_window: bool = False):
    """vLLM 0.33's kernel can null the entries below a sliding window (0.32's cannot):
    here group 0 has a window of 40 tokens over blocks of 4, group 1 none."""
    kernel_name = _BLOCK_TABLE + "_gather_block_tables_kernel"
    takes_window = _kernel_takes(kernel_name, "MASK_SLIDING_WINDOW")
    if sliding_window and not takes_window:
        raise NotInThisVllm("this vLLM's _gather_block_tables_kernel masks no window")
    sources = [torch.randint(1, 50, (6, 8), dtype=torch.int32) for _ in range(2)]
    inputs = [torch.full((6, 8), 77, dtype=torch.int32) for _ in range(2)]
    num_blocks = torch.tensor([[3, 8, 0, 1, 5, 2], [1, 2, 3, 4, 5, 6]], dtype=torch.int32)
    idx_mapping = torch.tensor([4, 1, 0], dtype=torch.int32)
    args = (
        idx_mapping, _pointer_table(sources), _pointer_table(inputs),
        torch.tensor([8, 8]), num_blocks, num_blocks.stride(0), 3,
    )  # fmt: skip
    kwargs = {"BLOCK_SIZE": 1024}
    if takes_window:
        # First scheduled positions by request state: below, inside and far past the window.
        num_computed = torch.tensor([45, 30, 0, 0, 70, 0], dtype=torch.int32)
        reach = torch.tensor([40, 0], dtype=torch.int32)
        block_sizes = torch.tensor([4, 4], dtype=torch.int32)
        args = (*args, num_computed, reach, block_sizes)
        kwargs["MASK_SLIDING_WINDOW"] = sliding_window
    # Grid: 4 padded rows (3 requests); rows past the padded batch are not compared.
    # The tables behind the pointers are returned too: they must outlive the launch.
    return (2, 4), args, kwargs, (*(t[:4] for t in inputs), *sources)


def slot_mappings():
    tables = [torch.randint(0, 40, (5, 16), dtype=torch.int32) for _ in range(3)]
    idx_mapping = torch.tensor([3, -1, 0], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 5, 6, 30], dtype=torch.int32)
    pos = torch.cat([torch.arange(40, 45), torch.tensor([0]), torch.arange(3, 27)])
    slot_mappings = torch.full((3, 40), 1234, dtype=torch.int64)
    args = (
        40, idx_mapping, query_start_loc, pos, _pointer_table(tables), torch.tensor([16, 16, 16]),
        torch.tensor([16, 32, 16], dtype=torch.int32), torch.tensor([True, True, False]),
        torch.tensor([True, True, True]), slot_mappings, slot_mappings.stride(0), 0,
    )  # fmt: skip
    kwargs = {"CP_SIZE": 1, "CP_INTERLEAVE": 1, "PAD_ID": PAD, "TRITON_BLOCK_SIZE": 1024}
    return (3, 4), args, kwargs, (slot_mappings, *tables)


def apply_write():
    output = torch.zeros(5, 12, dtype=torch.int32)
    indices = torch.tensor([3, 0, 4], dtype=torch.int32)
    starts = torch.tensor([2, 0, 9], dtype=torch.int32)
    contents = torch.arange(1, 10, dtype=torch.int32)
    cu_lens = torch.tensor([4, 6, 9], dtype=torch.int32)
    args = (output, output.stride(0), indices, starts, contents, cu_lens, None)
    return (3,), args, {"BLOCK_SIZE": 1024, "MULTI_GROUP": False}, (output,)


def apply_write_multi_group():
    outputs = [torch.zeros(4, 6, dtype=torch.int32), torch.zeros(4, 10, dtype=torch.int32)]
    indices = torch.tensor([1, 1, 3], dtype=torch.int32)
    starts = torch.tensor([0, 4, 2], dtype=torch.int32)
    contents = torch.arange(11, 19, dtype=torch.int32)
    cu_lens = torch.tensor([3, 6, 8], dtype=torch.int32)
    group_ids = torch.tensor([0, 1, 1], dtype=torch.int32)
    args = (
        _pointer_table(outputs), torch.tensor([6, 10]), indices, starts, contents, cu_lens,
        group_ids,
    )  # fmt: skip
    return (3,), args, {"BLOCK_SIZE": 1024, "MULTI_GROUP": True}, tuple(outputs)


def _gumbel_case(temperatures: list[float], *, fp64: bool = False, drafting: bool = False):
    num_tokens, vocab_size, block = len(temperatures), 2500, 1024
    num_blocks = -(-vocab_size // block)
    logits = torch.randn(num_tokens, vocab_size + 3) * 3
    # Request states of the rows; the last row is padding (-1: greedy).
    states = [(2 * i + 1) % 5 for i in range(num_tokens - 1)] + [-1]
    idx_mapping = torch.tensor(states, dtype=torch.int32)
    temperature = torch.zeros(5)
    for state, value in zip(states[:-1], temperatures):
        temperature[state] = value
    seeds = torch.tensor([2**40 + 7, -3, 12345, 99, 2**33], dtype=torch.int64)
    pos = torch.tensor([17 + 5 * i for i in range(num_tokens)], dtype=torch.int64)
    local_argmax = torch.full((num_tokens, num_blocks), -1, dtype=torch.int64)
    local_max = torch.zeros(num_tokens, num_blocks, dtype=torch.float64 if fp64 else torch.float32)
    args = (
        local_argmax, local_argmax.stride(0), local_max, local_max.stride(0), None, 0, 0, None,
        None, 0, logits, logits.stride(0), idx_mapping, seeds, pos, temperature, vocab_size,
    )  # fmt: skip
    kwargs = {
        "BLOCK_SIZE": block, "IS_DRAFTING": drafting, "APPLY_TEMPERATURE": True,
        "USE_FP64": fp64, "PER_TOKEN_COL": False,
    }  # fmt: skip
    return (num_tokens, num_blocks), args, kwargs, (local_argmax, local_max)


def gumbel_greedy():
    return _gumbel_case([0.0, 0.0, 0.0])


def gumbel_temperature():
    return _gumbel_case([0.7, 0.0, 1.3, 1.0])


def gumbel_fp64():
    return _gumbel_case([0.9, 2.0, 0.0], fp64=True)


def gumbel_drafting():
    return _gumbel_case([0.8, 1.1, 0.5], drafting=True)


def _update_draft_inputs_case(step: int, *, advance: bool = True):
    """Three requests of an EAGLE / MTP draft step ``step`` of three (the last is 2);
    buffers larger than the batch, the model length capping one request."""
    num_reqs, hidden, steps, max_model_len = 3, 40, 3, 64
    output_draft_tokens = torch.full((5, steps), -1, dtype=torch.int64)
    next_hidden = torch.zeros(8, hidden)
    input_ids = torch.full((8,), 7, dtype=torch.int32)
    positions = torch.tensor([10, 63, 5, 9, 9, 9, 9, 9], dtype=torch.int64)
    sample_src_positions = torch.tensor([11, 64, 6, 0, 0], dtype=torch.int64)
    seq_lens = torch.tensor([11, 64, 6, 3, 3], dtype=torch.int32)
    draft_tokens = torch.tensor([301, 302, 303], dtype=torch.int64)
    current_step = torch.tensor(step, dtype=torch.int64)
    hidden_states = torch.randn(6, hidden)
    args = (
        output_draft_tokens, output_draft_tokens.stride(0), next_hidden, next_hidden.stride(0),
        input_ids, positions, sample_src_positions, seq_lens, draft_tokens, current_step,
        hidden_states, hidden_states.stride(0), hidden, max_model_len, steps,
    )  # fmt: skip
    kwargs = {"BLOCK_SIZE": 16, "ADVANCE_DRAFT_POSITIONS": advance}
    outputs = (
        output_draft_tokens,
        next_hidden,
        input_ids,
        positions,
        sample_src_positions,
        seq_lens,
    )
    return (num_reqs,), args, kwargs, outputs


def update_draft_inputs():
    return _update_draft_inputs_case(1)


def update_draft_inputs_last_step():
    return _update_draft_inputs_case(2)


def update_draft_inputs_fixed_positions():
    return _update_draft_inputs_case(0, advance=False)


def _cache_inputs_case(*, embeds: bool):
    """Multi-module MTP with 3 speculative tokens (a window of 2): rows of 3, 1 and 4
    query tokens (the first after a rejection: its last token index before its end),
    then a padding row; 6 request states, hidden size 1100 (two blocks)."""
    hidden, window = 1100, 2
    input_ids = torch.arange(100, 112, dtype=torch.int32)
    hidden_states = torch.randn(12, hidden)
    input_embeds = torch.randn(12, hidden) if embeds else None
    cached_ids = torch.full((6, window), -1, dtype=torch.int32)
    cached_hidden = torch.zeros(6, window, hidden)
    cached_embeds = torch.zeros(6, window, hidden) if embeds else None
    idx_mapping = torch.tensor([4, 0, 2, -1], dtype=torch.int32)
    last_token_indices = torch.tensor([1, 3, 7, 7], dtype=torch.int64)
    query_start_loc = torch.tensor([0, 3, 4, 8, 8], dtype=torch.int32)
    args = (
        input_ids, input_embeds, input_embeds.stride(0) if embeds else 0, hidden_states,
        hidden_states.stride(0), cached_ids, cached_ids.stride(0), cached_embeds,
        cached_embeds.stride(0) if embeds else 0, cached_embeds.stride(1) if embeds else 0,
        cached_hidden, cached_hidden.stride(0), cached_hidden.stride(1), idx_mapping,
        last_token_indices, query_start_loc, window + 1, hidden,
    )  # fmt: skip
    kwargs = {"BLOCK_SIZE": 1024, "USE_INPUT_EMBEDS": embeds}
    outputs = (cached_ids, cached_hidden) + ((cached_embeds,) if embeds else ())
    return (4, 2), args, kwargs, outputs


def cache_inputs():
    return _cache_inputs_case(embeds=False)


def cache_inputs_with_embeddings():
    return _cache_inputs_case(embeds=True)


def shift_input_ids():
    """Rows of 3 tokens (last index 2), 1, 4 (last index 5: two trailing slots) and a
    padding row; the buffer is longer than the batch."""
    input_ids = torch.arange(50, 66, dtype=torch.int32)
    idx_mapping = torch.tensor([1, 3, 0, -1], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3, 4, 8, 8], dtype=torch.int32)
    last_token_indices = torch.tensor([2, 3, 5, 7], dtype=torch.int64)
    draft_tokens = torch.tensor([901, 902, 903, 904], dtype=torch.int64)
    args = (input_ids, idx_mapping, query_start_loc, last_token_indices, draft_tokens)
    return (4,), args, {"BLOCK_SIZE": 2}, (input_ids,)


def ngram_histories(seed: int, max_model_len: int, max_n: int) -> dict[str, torch.Tensor]:
    """Token histories for V2's ngram drafter, by request state: random over four
    token ids (so n-grams recur), one without any repeated token (no match), one
    full (``max_model_len`` tokens), one shorter than most n-grams, six times the
    same token (its best match ends one token before the history: one draft token
    from it, the rest the last sampled token); token ids past each history are 9
    (never in one), so a read past it changes the result. Batch rows map to states
    out of order, one state is not in the batch, and one row sampled nothing."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [max_model_len, 37, max_n - 1, 60, 1 + max_model_len // 2, 6, 23]
    token_ids = torch.randint(0, 4, (7, max_model_len), generator=generator, dtype=torch.int32)
    token_ids[3] = torch.arange(100, 100 + max_model_len)  # no repeated token
    token_ids[5] = 8
    for state, length in enumerate(lengths):
        token_ids[state, min(length, max_model_len) :] = 9
    return {
        "token_ids": token_ids,
        "idx_mapping": torch.tensor([4, 0, 3, 2, 1, 5], dtype=torch.int64),
        "total_len": torch.tensor([min(n, max_model_len) for n in lengths], dtype=torch.int32),
        "num_sampled": torch.tensor([1, 2, 1, 1, 0, 1], dtype=torch.int32),
        "last_sampled": torch.arange(70, 77).view(7, 1),  # vLLM's [max_num_reqs, 1]
    }


def ngram_block_size(max_model_len: int) -> int:
    """The scan's block of positions, as vLLM's ``NgramGPUSpeculator`` picks it."""
    for at_least, block in ((1024, 256), (256, 128), (64, 64)):
        if max_model_len >= at_least:
            return block
    return max(16, 1 << (max_model_len - 1).bit_length())


def _ngram_scan_case(seed: int, max_model_len: int, min_n: int, max_n: int):
    h = ngram_histories(seed, max_model_len, max_n)
    block = ngram_block_size(max_model_len)
    num_blocks = -(-max_model_len // block)
    scratch = torch.full((7, num_blocks), -5, dtype=torch.int64)  # rows past the batch: kept
    args = (
        h["token_ids"], h["token_ids"].stride(0), h["idx_mapping"], h["total_len"],
        h["num_sampled"], scratch, scratch.stride(0), max_model_len, min_n, max_n,
        max(1, 1 << (max_n - 1).bit_length()), block,
    )  # fmt: skip
    return (6, num_blocks), args, {"num_warps": 4, "num_stages": 2}, (scratch,)


def _ngram_finalize_case(seed: int, max_model_len: int, min_n: int, max_n: int, k: int):
    """The scan's scores from our version (checked against the kernel by the scan's
    cases), then the drafts."""
    from npu_vllm_bridge.host.v2_kernels import _ngram_scan

    _, scan_args, _, (scratch,) = _ngram_scan_case(seed, max_model_len, min_n, max_n)
    _ngram_scan(*scan_args)
    h = ngram_histories(seed, max_model_len, max_n)
    drafts = torch.full((7, k), -7, dtype=torch.int64)
    num_blocks = scratch.shape[1]
    args = (
        h["token_ids"], h["token_ids"].stride(0), h["idx_mapping"], h["total_len"],
        h["num_sampled"], h["last_sampled"].view(-1), scratch, scratch.stride(0), drafts,
        max_model_len, num_blocks, k, max(1, 1 << (k - 1).bit_length()),
        max(1, 1 << (num_blocks - 1).bit_length()),
    )  # fmt: skip
    return (6,), args, {"num_warps": 2, "num_stages": 1}, (drafts,)


# (seed, max_model_len, prompt_lookup_min, prompt_lookup_max[, k]): three blocks of 64
# positions (the last partly past the model length) with n of 1 to 3; one block of
# 64 for a model length of 40 with n = 2 only; three blocks of 128 with n of 3 to 5.
NGRAM_SCANS = {"ngram_scan": (0, 150, 1, 3), "ngram_scan_one_block": (1, 40, 2, 2)}
NGRAM_SCANS["ngram_scan_long_ngrams"] = (2, 300, 3, 5)
NGRAM_FINALIZES = {
    "ngram_finalize": (0, 150, 1, 3, 3),
    "ngram_finalize_one_block": (1, 40, 2, 2, 5),
}
NGRAM_FINALIZES["ngram_finalize_long_ngrams"] = (2, 300, 3, 5, 2)


@contextlib.contextmanager
def _boolean_masks(kernel_name: str):
    """Triton 3.9's interpreter refuses the masked load of ``_ngram_finalize_kernel``'s
    draft tokens: it types the mask ``(k_iota < tokens_avail) & write_ok & k_in_range``
    int64 and holds it as int32 0 and 1 (``ValueError('mask has unsupported dtype')``),
    where the kernel means the comparisons' truth. For that kernel, the interpreter's
    masked loads get their mask as booleans, once checked to hold only 0 and 1."""
    if kernel_name != _NGRAM + "_ngram_finalize_kernel":
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    load = InterpreterBuilder.create_masked_load

    def load_with_boolean_mask(self, ptrs, mask, other, cache_policy, is_volatile):
        if mask.data.dtype != np.bool_:
            if not np.isin(mask.data, (0, 1)).all():
                raise ValueError(f"a mask of other values than 0 and 1: {mask.data}")
            mask = TensorHandle(mask.data.astype(np.bool_), tl.int1)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    InterpreterBuilder.create_masked_load = load_with_boolean_mask
    try:
        yield
    finally:
        InterpreterBuilder.create_masked_load = load


_INPUT_BATCH = "vllm.v1.worker.gpu.input_batch."
_BLOCK_TABLE = "vllm.v1.worker.gpu.block_table."
_GUMBEL = "vllm.v1.worker.gpu.sample.gumbel._gumbel_sample_kernel"
_APPLY_WRITE = "vllm.v1.worker.gpu.buffer_utils._apply_write_kernel"
_UPDATE_DRAFT_INPUTS = (
    "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator._update_draft_inputs_kernel"
)
_MULTI_MODULE_MTP = "vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator."
_NGRAM = "vllm.v1.worker.gpu.spec_decode.ngram.speculator."
CASES = {
    "pos_seq_lens": (pos_seq_lens, _INPUT_BATCH + "_prepare_pos_seq_lens_kernel"),
    "combine_sampled_and_draft_tokens": (
        combine_sampled_and_draft_tokens,
        _INPUT_BATCH + "_combine_sampled_and_draft_tokens_kernel",
    ),
    "num_sampled_and_rejected": (
        num_sampled_and_rejected,
        _INPUT_BATCH + "_get_num_sampled_and_rejected_kernel",
    ),
    "post_update": (post_update, _INPUT_BATCH + "_post_update_kernel"),
    "post_update_with_drafts": (
        functools.partial(post_update, drafts=True),
        _INPUT_BATCH + "_post_update_kernel",
    ),
    "gather_block_tables": (gather_block_tables, _BLOCK_TABLE + "_gather_block_tables_kernel"),
    "gather_block_tables_sliding_window": (
        functools.partial(gather_block_tables, sliding_window=True),
        _BLOCK_TABLE + "_gather_block_tables_kernel",
    ),
    "slot_mappings": (slot_mappings, _BLOCK_TABLE + "_compute_slot_mappings_kernel"),
    "apply_write": (apply_write, _APPLY_WRITE),
    "apply_write_multi_group": (apply_write_multi_group, _APPLY_WRITE),
    "gumbel_greedy": (gumbel_greedy, _GUMBEL),
    "gumbel_temperature": (gumbel_temperature, _GUMBEL),
    "gumbel_fp64": (gumbel_fp64, _GUMBEL),
    "gumbel_drafting": (gumbel_drafting, _GUMBEL),
    "update_draft_inputs": (update_draft_inputs, _UPDATE_DRAFT_INPUTS),
    "update_draft_inputs_last_step": (update_draft_inputs_last_step, _UPDATE_DRAFT_INPUTS),
    "update_draft_inputs_fixed_positions": (
        update_draft_inputs_fixed_positions,
        _UPDATE_DRAFT_INPUTS,
    ),
    "cache_inputs": (cache_inputs, _MULTI_MODULE_MTP + "_cache_inputs_kernel"),
    "cache_inputs_with_embeddings": (
        cache_inputs_with_embeddings,
        _MULTI_MODULE_MTP + "_cache_inputs_kernel",
    ),
    "shift_input_ids": (shift_input_ids, _MULTI_MODULE_MTP + "_shift_input_ids_kernel"),
}
for _name, _options in NGRAM_SCANS.items():
    CASES[_name] = (functools.partial(_ngram_scan_case, *_options), _NGRAM + "_ngram_scan_kernel")
for _name, _options in NGRAM_FINALIZES.items():
    CASES[_name] = (
        functools.partial(_ngram_finalize_case, *_options),
        _NGRAM + "_ngram_finalize_kernel",
    )


def compare(case: str) -> str:
    """``ok``, or how our version's writes differ from the interpreted kernel's."""
    build, kernel_name = CASES[case]
    theirs, ours = _launch_both(build, kernel_name)
    for index, (a, b) in enumerate(zip(theirs, ours)):
        same = torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, rtol=1e-6)
        if not same:
            return f"output {index} differs:\nkernel {a.tolist()}\nours   {b.tolist()}"
    return "ok"


def main() -> None:
    os.environ["NPU_BRIDGE_DEVICE"] = "cpu"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from vllm.platforms import current_platform

    from npu_vllm_bridge.host import triton_interpreter

    if type(current_platform).__name__ != "HostPlatform" or not triton_interpreter.interpreting():
        raise SystemExit("host mode did not set up Triton's interpreter")
    results = {}
    for case in sys.argv[1:] or CASES:
        try:
            results[case] = compare(case)
        except NotInThisVllm as exc:
            results[case] = f"skip: {exc}"
        except Exception as exc:
            results[case] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
