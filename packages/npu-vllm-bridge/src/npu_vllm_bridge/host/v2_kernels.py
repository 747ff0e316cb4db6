"""PyTorch versions of the Triton kernels on a V2 decode step's path, for host mode.

Host mode runs vLLM's V2 model runner under Triton's interpreter (``triton_interpreter.py``),
which takes tens of milliseconds per launch (``_gumbel_sample_kernel`` about a second
on SmolLM2's vocabulary). :func:`register` hands vLLM's kernel dispatcher
(``vllm.triton_utils.dispatcher.register_kernels``) these versions of the kernels a
decode step launches: inputs, block tables and slot mappings, sampling, the update
after sampling, and the staged writes of new block ids. And those that the EAGLE / MTP
drafters' FULL graphs capture (an interpreted kernel cannot be recorded in a host
graph, ``triton_interpreter.py``): the update of a draft step's inputs, and multi-module MTP's
cache of its draft inputs and shift of input ids (not the shift of input embeddings,
which only multimodal drafters run). These read no value of a tensor on the host, so
that a host graph replays them with each replay's values. And the ngram drafter's scan
and finalize, which run outside graphs: interpreted, the scan is slow, and Triton 3.9's
interpreter refuses one of the finalize kernel's masked loads (an int64-typed mask).

Each takes its kernel's arguments under the kernel's names (a test checks they still
match), tensors where the kernel takes pointers, and works out the launch grid from
its arguments, since the dispatcher drops it. Two kernels take tables of data
pointers (one per KV-cache group): the tensors behind them are registered with
:func:`register_pointer_tensors` by the model runner.

Every function writes what its kernel writes, with one exception:
``_gather_block_tables`` zeroes every row of the output block table after the step's
requests, where the kernel zeroes those up to its grid (the padded batch); the runner
reads no row beyond the padded batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from npu_vllm_bridge.vllm_seam import v2_kernel_path

_MASK32 = 0xFFFFFFFF
_DRAFT_NOISE_SALT = 1 << 30  # vLLM's offset of drafting noise (sample/gumbel.py)
_MURMUR3_HI_DOMAIN = 0x9E3779B9

_POINTER_TENSORS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def register_pointer_tensors(tensors: Iterable[torch.Tensor]) -> None:
    """Make ``tensors`` findable by their ``data_ptr()`` (the block tables whose
    addresses vLLM's block-table kernels take)."""
    for tensor in tensors:
        _POINTER_TENSORS[tensor.data_ptr()] = tensor


def _tensor_at(pointers: torch.Tensor, index: int) -> torch.Tensor:
    address = int(pointers[index])
    tensor = _POINTER_TENSORS.get(address)
    if tensor is None:
        raise ValueError(
            f"a kernel got the data pointer {address:#x}, which no registered tensor has; "
            "register the tensors of every pointer table with register_pointer_tensors"
        )
    return tensor


def _runs(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For consecutive runs of ``lengths[i]`` elements: each element's run and its
    offset in the run, as two int64 ``[sum(lengths)]`` tensors."""
    lengths = lengths.long()
    total = int(lengths.sum())
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=total)
    firsts = torch.cumsum(lengths, 0) - lengths
    return owner, torch.arange(total) - firsts[owner]


def _prepare_pos_seq_lens(
    pos_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    num_computed_tokens_ptr: torch.Tensor,
    max_num_reqs: int,
    BLOCK_SIZE: int = 1024,
) -> None:
    """Each request's sequence length (0 past the batch) and its tokens' positions.

    ``pos_ptr``: int64 ``[num_tokens]``; ``seq_lens_ptr``: int32 ``[max_num_reqs]``;
    ``idx_mapping_ptr``: int32 ``[num_reqs]`` (batch row -> request state);
    ``query_start_loc_ptr``: int32 ``[num_reqs + 1]``; ``num_computed_tokens_ptr``:
    int32 ``[max_num_reqs]`` by request state.
    """
    num_reqs = idx_mapping_ptr.shape[0]
    starts = query_start_loc_ptr[: num_reqs + 1].long()
    computed = num_computed_tokens_ptr[idx_mapping_ptr.long()].long()
    query_lens = starts[1:] - starts[:-1]
    seq_lens_ptr[:num_reqs] = (computed + query_lens).to(seq_lens_ptr.dtype)
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
    owner, offset = _runs(query_lens)
    pos_ptr[int(starts[0]) : int(starts[-1])] = (computed[owner] + offset).to(pos_ptr.dtype)


def _combine_sampled_and_draft_tokens(
    input_ids_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    last_sampled_tokens_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    prefill_len_ptr: torch.Tensor,
    draft_tokens_ptr: torch.Tensor,
    draft_tokens_stride: int,
    cu_num_logits_ptr: torch.Tensor,
    logits_indices_ptr: torch.Tensor,
    BLOCK_SIZE: int = 1,
    NUM_NEW_SAMPLED_TOKENS: int = 1,
) -> None:
    """The indices of the tokens whose logits are sampled, and the input ids of
    decoding requests: their last sampled token, then their draft tokens.

    ``draft_tokens_ptr``: ``[max_num_reqs, num_speculative_steps]``; ``cu_num_logits_ptr``:
    int32 ``[num_reqs + 1]``; ``logits_indices_ptr``: int64 ``[num_logits]``, written.
    """
    num_reqs = idx_mapping_ptr.shape[0]
    reqs = idx_mapping_ptr.long()
    cu_logits = cu_num_logits_ptr[: num_reqs + 1].long()
    num_logits = cu_logits[1:] - cu_logits[:-1]
    query_ends = query_start_loc_ptr[1 : num_reqs + 1].long()
    logits_starts = query_ends - num_logits
    owner, offset = _runs(num_logits)
    logits_indices_ptr[: len(owner)] = logits_starts[owner] + offset

    seq_lens = seq_lens_ptr[:num_reqs].long()
    prefill_lens = prefill_len_ptr[reqs].long()
    decoding = seq_lens > prefill_lens
    if NUM_NEW_SAMPLED_TOKENS > 0:
        rows = decoding & (seq_lens - num_logits >= prefill_lens)
        last = last_sampled_tokens_ptr.view(-1)[reqs[rows]]  # [max_num_reqs, 1] in vLLM
        input_ids_ptr[logits_starts[rows]] = last.to(input_ids_ptr.dtype)
    num_drafts = num_logits - NUM_NEW_SAMPLED_TOKENS
    width = draft_tokens_ptr.shape[-1]
    column = torch.arange(width)
    drafted = decoding[:, None] & (column < num_drafts[:, None])
    targets = (query_ends - num_drafts)[:, None] + column
    input_ids_ptr[targets[drafted]] = draft_tokens_ptr[reqs][drafted].to(input_ids_ptr.dtype)


def _gather_block_tables(
    batch_idx_to_req_idx: torch.Tensor,
    src_block_table_ptrs: torch.Tensor,
    dst_block_table_ptrs: torch.Tensor,
    block_table_strides: torch.Tensor,
    num_blocks_ptr: torch.Tensor,
    num_blocks_stride: int,
    num_reqs: int,
    num_computed_tokens_ptr: torch.Tensor | None = None,
    sliding_window_reach_ptr: torch.Tensor | None = None,
    block_sizes_ptr: torch.Tensor | None = None,
    MASK_SLIDING_WINDOW: bool = False,
    BLOCK_SIZE: int = 1024,
) -> None:
    """Each KV-cache group's block-table rows of the batch's requests (their first
    ``num_blocks`` entries), gathered into the group's input block table; the rows
    after the batch are zeroed.

    ``src/dst_block_table_ptrs``: uint64 ``[num_groups]`` data pointers of int32
    ``[max_num_reqs, max_num_blocks]`` tables; ``num_blocks_ptr``: int32
    ``[num_groups, max_num_reqs]``.

    vLLM 0.33 passes the arguments after ``num_reqs`` (0.32 has none of them): with
    ``MASK_SLIDING_WINDOW``, a group of ``sliding_window_reach_ptr[g] > 0`` tokens gets
    0 (the null block) for each entry wholly below a request's window, i.e. the first
    ``max(num_computed_tokens_ptr[req] - reach, 0) // block_sizes_ptr[g]`` entries.
    """
    reqs = batch_idx_to_req_idx[:num_reqs].long()
    for group in range(src_block_table_ptrs.shape[0]):
        src = _tensor_at(src_block_table_ptrs, group)
        dst = _tensor_at(dst_block_table_ptrs, group)
        column = torch.arange(src.shape[1])
        filled = column < num_blocks_ptr[group, reqs].long()[:, None]
        rows = src[reqs]
        if MASK_SLIDING_WINDOW:
            reach, block_size = int(sliding_window_reach_ptr[group]), int(block_sizes_ptr[group])
            below = _blocks_below_window(num_computed_tokens_ptr[reqs].long(), reach, block_size)
            rows = rows.masked_fill(column < below[:, None], 0)
        dst[:num_reqs] = torch.where(filled, rows, dst[:num_reqs])
        dst[num_reqs:] = 0


def _blocks_below_window(
    first_positions: torch.Tensor, reach: int, block_size: int
) -> torch.Tensor:
    """Per request, the leading blocks no query token of the step can attend (0 for a
    group without a window, ``reach == 0``)."""
    if reach <= 0:
        return torch.zeros_like(first_positions)
    return (first_positions - reach).clamp(min=0) // block_size


def _compute_slot_mappings(
    max_num_tokens: int,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    pos: torch.Tensor,
    block_table_ptrs: torch.Tensor,
    block_table_strides: torch.Tensor,
    block_sizes: torch.Tensor,
    slot_mapping_enabled: torch.Tensor,
    dcp_sharded: torch.Tensor,
    slot_mappings_ptr: torch.Tensor,
    slot_mappings_stride: int,
    cp_rank: int,
    CP_SIZE: int = 1,
    CP_INTERLEAVE: int = 1,
    PAD_ID: int = -1,
    TRITON_BLOCK_SIZE: int = 1024,
) -> None:
    """Each KV-cache group's slot of every scheduled token, ``PAD_ID`` for padding
    requests (negative request state), tokens another context-parallel rank keeps
    and the rest of the row.

    ``slot_mappings_ptr``: int64 ``[num_groups, max_num_tokens]``; ``pos``: int64
    positions of the scheduled tokens; ``block_table_ptrs``: as in
    :func:`_gather_block_tables`.
    """
    num_reqs = idx_mapping.shape[0]
    starts = query_start_loc[: num_reqs + 1].long()
    owner, _ = _runs(starts[1:] - starts[:-1])
    first, total = int(starts[0]), int(starts[-1])
    reqs = idx_mapping.long()[owner]
    positions = pos[first:total].long()
    for group in range(block_table_ptrs.shape[0]):
        table = _tensor_at(block_table_ptrs, group)
        block_size = int(block_sizes[group])
        local, is_local = positions, torch.ones_like(positions, dtype=torch.bool)
        if CP_SIZE != 1 and bool(dcp_sharded[group]):
            local, is_local = _cp_local_positions(
                positions, block_size, CP_SIZE, CP_INTERLEAVE, cp_rank
            )
        enabled = bool(slot_mapping_enabled[group])
        valid = is_local & (reqs >= 0) & enabled
        blocks = (local // block_size) if enabled else torch.zeros_like(local)
        numbers = table[reqs.clamp(min=0), blocks.where(valid, 0)].long()
        slots = torch.where(valid, numbers * block_size + local % block_size, PAD_ID)
        slot_mappings_ptr[group, first:total] = slots
        slot_mappings_ptr[group, total:max_num_tokens] = PAD_ID


def _cp_local_positions(
    positions: torch.Tensor, block_size: int, cp_size: int, interleave: int, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in this rank's share of a context-parallel KV cache, and which
    positions this rank keeps (vLLM's rule: ``interleave`` tokens per rank in turn)."""
    virtual_block = block_size * cp_size
    offsets = positions % virtual_block
    is_local = offsets // interleave % cp_size == cp_rank
    local_offsets = offsets // (interleave * cp_size) * interleave + offsets % interleave
    return positions // virtual_block * block_size + local_offsets, is_local


def _gumbel_sample(
    local_argmax_ptr: torch.Tensor,
    local_argmax_stride: int,
    local_max_ptr: torch.Tensor,
    local_max_stride: int,
    logits_cache_ptr: torch.Tensor | None,
    logits_cache_stride_0: int,
    logits_cache_stride_1: int,
    logits_cache_col_ptr: torch.Tensor | None,
    logits_cache_source_ptr: torch.Tensor | None,
    logits_cache_source_stride: int,
    logits_ptr: torch.Tensor,
    logits_stride: int,
    expanded_idx_mapping_ptr: torch.Tensor,
    seeds_ptr: torch.Tensor,
    pos_ptr: torch.Tensor,
    temp_ptr: torch.Tensor,
    vocab_size: int,
    BLOCK_SIZE: int = 1024,
    IS_DRAFTING: bool = False,
    APPLY_TEMPERATURE: bool = True,
    USE_FP64: bool = False,
    PER_TOKEN_COL: bool = False,
) -> None:
    """Per vocabulary block of ``BLOCK_SIZE`` tokens, each token row's argmax of its
    logits plus Gumbel noise (none at temperature 0), and that maximum.

    ``local_argmax_ptr`` int64 / ``local_max_ptr`` float ``[num_tokens, num_blocks]``,
    written; ``logits_ptr``: ``[num_tokens, >= vocab_size]``; noise from vLLM's
    murmur3 stream of (seed, position, token id); rows whose request state is
    negative are greedy. With a logits cache, each row's logits (from
    ``logits_cache_source_ptr``) are stored in its request's cache column first.

    Inside a graph capture (V2's drafter graphs sample drafts with it) no value of a
    tensor is read on the host: noise is computed for every row and kept where the
    temperature is not 0, where outside captures only rows with a temperature get
    noise (a greedy batch none).
    """
    reqs = expanded_idx_mapping_ptr.long()
    valid = reqs >= 0
    reqs = reqs.clamp(min=0)
    if logits_cache_ptr is not None:
        columns = logits_cache_col_ptr if PER_TOKEN_COL else logits_cache_col_ptr.expand(len(reqs))
        _store_valid_rows(
            logits_cache_ptr[..., :vocab_size],
            (reqs, columns.long()),
            logits_cache_source_ptr[:, :vocab_size],
            valid,
        )
    temperature = torch.where(valid, temp_ptr[reqs].float(), 0.0)[:, None]
    logits = logits_ptr[:, :vocab_size].float()
    if APPLY_TEMPERATURE:
        logits = torch.where(temperature != 0, logits / temperature, logits)
    if USE_FP64:
        logits = logits.double()
    noisy = (temperature != 0).squeeze(1)
    salt = _DRAFT_NOISE_SALT if IS_DRAFTING else 0
    keys = torch.arange(vocab_size)
    if _capturing():
        seeds = torch.where(valid, seeds_ptr[reqs].long(), 0)[:, None]
        noise = _gumbel_noise(seeds, pos_ptr.long()[:, None] + salt, keys, USE_FP64)
        logits = torch.where(noisy[:, None], logits + noise, logits)
    elif bool(noisy.any()):
        seeds = torch.where(valid, seeds_ptr[reqs].long(), 0)[noisy, None]
        positions = pos_ptr.long()[noisy, None] + salt
        logits[noisy] += _gumbel_noise(seeds, positions, keys, USE_FP64)
    num_blocks = local_argmax_ptr.shape[1]
    padded = torch.full(
        (logits.shape[0], num_blocks * BLOCK_SIZE), float("-inf"), dtype=logits.dtype
    )
    padded[:, :vocab_size] = logits
    values, indices = padded.view(logits.shape[0], num_blocks, BLOCK_SIZE).max(dim=-1)
    local_argmax_ptr.copy_(indices + torch.arange(num_blocks) * BLOCK_SIZE)
    local_max_ptr.copy_(values)


def _store_valid_rows(
    target: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    rows: torch.Tensor,
    valid: torch.Tensor,
) -> None:
    """``target[index[0][i], index[1][i], ...] = rows[i]`` for each valid ``i``, with
    shapes independent of the values (a host graph replays it): an invalid ``i``
    repeats the first valid one's store (a batch without one stores the first
    indexed row's own values), so every store to a place writes the same value.
    Valid ``i`` index distinct places."""
    first = torch.argmax(valid.to(torch.int32))  # 0 when no row is valid
    source = torch.where(valid, torch.arange(len(valid)), first)
    where = tuple(i[source] for i in index)
    values = torch.where(valid.any(), rows[source].to(target.dtype), target[where])
    target.index_put_(where, values)


def _capturing() -> bool:
    """Whether an npu-graphs graph is being captured (its capture session)."""
    from npu_graphs.session import active_session

    return active_session() is not None


def _gumbel_noise(
    seeds: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, fp64: bool
) -> torch.Tensor:
    """vLLM's Gumbel noise of token ids ``keys`` (``gumbel_noised_argmax``), computed
    in the kernel's precision: float32, or float64 with ``fp64``."""
    if fp64:
        low = _murmur3(seeds, positions, keys)
        high = _murmur3(seeds, positions, keys, domain=_MURMUR3_HI_DOMAIN)
        random53 = (high << 21) | (low >> 11)
        uniform = (random53.double() + 0.5) * 2.0**-53
        uniform = torch.where(uniform == 1.0, uniform - 2.0**-53, uniform)
        return -torch.log(-torch.log(uniform))
    random32 = _murmur3(seeds, positions, keys)
    high16, low16 = (random32 >> 16).float(), (random32 & 0xFFFF).float()
    uniform = high16 * 2.0**-16 + (low16 + 0.5) * 2.0**-32
    return -torch.log(-_log1p_of_negative(uniform))


def _log1p_of_negative(value: torch.Tensor) -> torch.Tensor:
    """``log(1 - value)`` as vLLM's ``_log1p_neg_stable`` computes it (float32)."""
    polynomial = torch.full_like(value, 1.0 / 8.0)
    for degree in (7, 6, 5, 4, 3, 2, 1):
        polynomial = 1.0 / degree + value * polynomial
    series = -value * polynomial
    direct = torch.log(torch.clamp(1.0 - value, min=5.960464477539063e-08))
    return torch.where(value < 0.25, series, direct)


def _murmur3(
    seeds: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, domain: int = 0
) -> torch.Tensor:
    """vLLM's ``murmur3_hash32(seed, pos, key, domain)``, broadcast over its int64
    arguments; values in ``[0, 2**32)`` as int64."""
    h = _mix(torch.full_like(seeds, domain), seeds & _MASK32)
    h = _mix(h, (seeds >> 32) & _MASK32)
    h = _mix(h, positions & _MASK32)
    h = _mix(h, keys & _MASK32)
    h = h ^ 16
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(_rotl32(_mul32(key, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _mul32(a: torch.Tensor, constant: int) -> torch.Tensor:
    """``a * constant`` modulo 2**32 in int64 without overflow (``a < 2**32``)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (a * low + ((a * high) & 0xFFFF) * 0x10000) & _MASK32


def _rotl32(value: torch.Tensor, shift: int) -> torch.Tensor:
    return ((value << shift) | (value >> (32 - shift))) & _MASK32


def _get_num_sampled_and_rejected(
    num_sampled_ptr: torch.Tensor,
    num_rejected_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    cu_num_logits_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    prefill_len_ptr: torch.Tensor,
) -> None:
    """Tokens sampled and rejected per request: none while it is still prefilling
    in chunks; ``num_sampled_ptr`` is updated in place, ``num_rejected_ptr`` written."""
    num_reqs = idx_mapping_ptr.shape[0]
    chunked = seq_lens_ptr[:num_reqs] < prefill_len_ptr[idx_mapping_ptr.long()]
    sampled = torch.where(chunked, 0, num_sampled_ptr[:num_reqs])
    num_sampled_ptr[:num_reqs] = sampled
    cu_logits = cu_num_logits_ptr[: num_reqs + 1]
    rejected = torch.where(chunked, 0, cu_logits[1:] - cu_logits[:-1] - sampled)
    num_rejected_ptr[:num_reqs] = rejected.to(num_rejected_ptr.dtype)


def _post_update(
    idx_mapping_ptr: torch.Tensor,
    num_computed_tokens_ptr: torch.Tensor,
    last_sampled_tokens_ptr: torch.Tensor,
    output_bin_counts_ptr: torch.Tensor | None,
    output_bin_counts_stride: int,
    sampled_tokens_ptr: torch.Tensor,
    sampled_tokens_stride: int,
    num_sampled_ptr: torch.Tensor,
    num_rejected_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor | None,
    all_token_ids_ptr: torch.Tensor,
    all_token_ids_stride: int,
    total_len_ptr: torch.Tensor,
    draft_tokens_ptr: torch.Tensor | None = None,
    draft_tokens_out_ptr: torch.Tensor | None = None,
    num_draft_tokens: int = 0,
    **launch_options: Any,
) -> None:
    """After sampling, per request of the batch (negative request states skipped):
    its sampled tokens appended to its token ids (and output bin counts), its last
    sampled token and total length, its computed tokens advanced by the accepted
    query tokens; with ``draft_tokens_ptr`` (vLLM 0.33; 0.32 passes none), its
    ``num_draft_tokens`` drafts copied to its request state's row of
    ``draft_tokens_out_ptr``.

    ``sampled_tokens_ptr``: ``[num_reqs, num_speculative_steps + 1]``;
    ``all_token_ids_ptr``: ``[max_num_reqs, max_model_len]`` by request state;
    ``draft_tokens_ptr``: contiguous ``[num_reqs, num_draft_tokens]``;
    ``draft_tokens_out_ptr``: contiguous ``[max_num_reqs, num_draft_tokens]``.
    """
    rows = (idx_mapping_ptr >= 0).nonzero().squeeze(1)
    reqs = idx_mapping_ptr[rows].long()
    if draft_tokens_ptr is not None and num_draft_tokens > 0:
        drafts = draft_tokens_ptr.reshape(-1, num_draft_tokens)
        out = draft_tokens_out_ptr.view(-1, num_draft_tokens)
        out[reqs] = drafts[rows].to(out.dtype)
    counts = num_sampled_ptr[rows].long()
    lengths = total_len_ptr[reqs].long()
    sampled = sampled_tokens_ptr[rows]
    column = torch.arange(sampled.shape[1])
    taken = column < counts[:, None]
    token_reqs = reqs[:, None].expand_as(sampled)[taken]
    tokens = sampled[taken]
    all_token_ids_ptr[token_reqs, (lengths[:, None] + column)[taken]] = tokens.to(
        all_token_ids_ptr.dtype
    )
    if output_bin_counts_ptr is not None:
        ones = torch.ones_like(tokens, dtype=output_bin_counts_ptr.dtype)
        output_bin_counts_ptr.index_put_((token_reqs, tokens.long()), ones, accumulate=True)
    some = counts > 0
    last = sampled[some, counts[some] - 1]
    last_sampled = last_sampled_tokens_ptr.view(-1)  # [max_num_reqs, 1] in vLLM
    last_sampled[reqs[some]] = last.to(last_sampled.dtype)
    total_len_ptr[reqs[some]] = (lengths + counts)[some].to(total_len_ptr.dtype)
    query_lens = torch.zeros_like(counts)
    if query_start_loc_ptr is not None:
        query_lens = (query_start_loc_ptr[rows + 1] - query_start_loc_ptr[rows]).long()
    delta = query_lens - num_rejected_ptr[rows].long()
    computed = num_computed_tokens_ptr[reqs].long() + delta
    num_computed_tokens_ptr[reqs] = computed.to(num_computed_tokens_ptr.dtype)


def _apply_write(
    output_ptr: torch.Tensor,
    output_stride: torch.Tensor | int,
    write_indices_ptr: torch.Tensor,
    write_starts_ptr: torch.Tensor,
    write_contents_ptr: torch.Tensor,
    write_cu_lens_ptr: torch.Tensor,
    write_group_ids_ptr: torch.Tensor | None,
    BLOCK_SIZE: int = 1024,
    MULTI_GROUP: bool = False,
) -> None:
    """Staged writes: write ``i`` puts its contents (``write_contents_ptr`` between
    ``write_cu_lens_ptr[i - 1]`` and ``[i]``) into row ``write_indices_ptr[i]`` of the
    output from column ``write_starts_ptr[i]`` on. The output is a tensor, or with
    ``MULTI_GROUP`` a table of data pointers and strides indexed by
    ``write_group_ids_ptr``."""
    num_writes = write_indices_ptr.shape[0]
    ends = write_cu_lens_ptr[:num_writes].long()
    lengths = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    owner, offset = _runs(lengths)
    rows = write_indices_ptr[:num_writes].long()[owner]
    columns = write_starts_ptr[:num_writes].long()[owner] + offset
    contents = write_contents_ptr[: len(owner)]
    if not MULTI_GROUP:
        _write_flat(output_ptr, rows * int(output_stride) + columns, contents)
        return
    groups = write_group_ids_ptr[:num_writes].long()[owner]
    for group in groups.unique().tolist():
        target = _tensor_at(output_ptr, group)
        chosen = groups == group
        stride = int(output_stride[group])
        _write_flat(target, (rows * stride + columns)[chosen], contents[chosen])


def _write_flat(target: torch.Tensor, flat_index: torch.Tensor, values: torch.Tensor) -> None:
    """``target``'s elements at row-major offsets ``flat_index`` set to ``values``."""
    target.view(-1)[flat_index] = values.to(target.dtype)


def _update_draft_inputs(
    output_draft_tokens_ptr: torch.Tensor,
    output_draft_tokens_stride: int,
    next_input_hidden_states_ptr: torch.Tensor,
    next_input_hidden_states_stride: int,
    input_ids_ptr: torch.Tensor,
    positions_ptr: torch.Tensor,
    sample_src_positions_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    draft_tokens_ptr: torch.Tensor,
    current_draft_step_ptr: torch.Tensor,
    hidden_states_ptr: torch.Tensor,
    hidden_states_stride: int,
    hidden_size: int,
    max_model_len: int,
    num_speculative_steps: int,
    BLOCK_SIZE: int = 1024,
    ADVANCE_DRAFT_POSITIONS: bool = True,
) -> None:
    """After an EAGLE / MTP draft step: each request's draft token stored in its
    column ``current_draft_step`` of the output; unless that was the last step, the
    token and its hidden state become the next step's input, and its sampling
    position (with ``ADVANCE_DRAFT_POSITIONS``, its position and sequence length,
    capped by the model length) advance by one.

    ``draft_tokens_ptr``: ``[num_reqs]``; ``output_draft_tokens_ptr``: ``[max_num_reqs,
    num_speculative_steps]``; ``hidden_states_ptr`` / ``next_input_hidden_states_ptr``:
    ``[>= num_reqs, hidden_size]``; ``current_draft_step_ptr``: an int64 scalar tensor.
    The step is read on the device, never on the host, so that a host graph replays
    the kernel with the step of each replay.
    """
    num_reqs = draft_tokens_ptr.shape[0]
    step = current_draft_step_ptr.reshape(1).long()
    tokens = draft_tokens_ptr.reshape(num_reqs, 1)
    output = output_draft_tokens_ptr[:num_reqs]
    output.scatter_(1, step.expand(num_reqs, 1), tokens.to(output.dtype))
    more = step < num_speculative_steps - 1  # [1]: not the last step
    sample_positions = sample_src_positions_ptr[:num_reqs]
    sample_positions.add_(more.to(sample_positions.dtype))
    input_ids = input_ids_ptr[:num_reqs]
    input_ids.copy_(torch.where(more, draft_tokens_ptr.to(input_ids.dtype), input_ids))
    next_hidden = next_input_hidden_states_ptr[:num_reqs, :hidden_size]
    hidden = hidden_states_ptr[:num_reqs, :hidden_size].to(next_hidden.dtype)
    next_hidden.copy_(torch.where(more[:, None], hidden, next_hidden))
    if ADVANCE_DRAFT_POSITIONS:
        positions = positions_ptr[:num_reqs]
        advanced = torch.clamp(positions + 1, max=max_model_len - 1)
        positions.copy_(torch.where(more, advanced, positions))
        seq_lens = seq_lens_ptr[:num_reqs]
        longer = torch.clamp(seq_lens + 1, max=max_model_len).to(seq_lens.dtype)
        seq_lens.copy_(torch.where(more, longer, seq_lens))


def _cache_inputs(
    draft_input_ids_ptr: torch.Tensor,
    draft_input_embeds_ptr: torch.Tensor | None,
    draft_input_embeds_stride0: int,
    draft_input_hidden_states_ptr: torch.Tensor,
    draft_input_hidden_states_stride0: int,
    cached_draft_input_ids_ptr: torch.Tensor,
    cached_draft_input_ids_stride0: int,
    cached_draft_input_embeds_ptr: torch.Tensor | None,
    cached_draft_input_embeds_stride0: int,
    cached_draft_input_embeds_stride1: int,
    cached_target_hidden_states_ptr: torch.Tensor,
    cached_target_hidden_states_stride0: int,
    cached_target_hidden_states_stride1: int,
    idx_mapping_ptr: torch.Tensor,
    last_token_indices_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    num_speculative_steps: int,
    hidden_size: int,
    BLOCK_SIZE: int = 1024,
    USE_INPUT_EMBEDS: bool = False,
) -> None:
    """Multi-module MTP: each request's last ``num_speculative_steps - 1`` draft input
    tokens up to its last token index (those of its query), their hidden states (and
    embeddings), kept by request state for a re-prefill at its next step; slot ``j``
    holds the token ``window - 1 - j`` before the last. Padding rows (negative request
    state) keep nothing.

    ``cached_draft_input_ids_ptr``: ``[max_num_reqs, window]``; the caches of hidden
    states and embeddings: ``[max_num_reqs, window, hidden_size]``. Every request
    state's rows are rewritten (unchanged where no row of the batch writes), with no
    host value read from a tensor, so that a host graph replays the kernel as it is.
    """
    window = num_speculative_steps - 1
    if window <= 0:
        return
    num_reqs = idx_mapping_ptr.shape[0]
    states = idx_mapping_ptr.long()
    valid = states >= 0
    last = last_token_indices_ptr[:num_reqs].long()
    tokens = last[:, None] - window + 1 + torch.arange(window)  # [num_reqs, window]
    kept = valid[:, None] & (tokens >= query_start_loc_ptr[:num_reqs].long()[:, None])
    # The batch row of each request state (-1: none); a state is in the batch once.
    rows = torch.where(valid, torch.arange(num_reqs), -1)
    owner = torch.full((cached_draft_input_ids_ptr.shape[0],), -1, dtype=torch.long)
    owner.scatter_reduce_(0, states.clamp(min=0), rows, "amax")
    row = owner.clamp(min=0)
    written = kept[row] & (owner >= 0)[:, None]  # [max_num_reqs, window]
    source = tokens[row].clamp(min=0)

    def cache(target: torch.Tensor, values: torch.Tensor) -> None:
        mask = written if target.dim() == 2 else written[..., None]
        target.copy_(torch.where(mask, values.to(target.dtype), target))

    cache(cached_draft_input_ids_ptr[:, :window], draft_input_ids_ptr[source])
    hidden = draft_input_hidden_states_ptr[:, :hidden_size]
    cache(cached_target_hidden_states_ptr[:, :window, :hidden_size], hidden[source])
    if USE_INPUT_EMBEDS:
        embeds = draft_input_embeds_ptr[:, :hidden_size]
        cache(cached_draft_input_embeds_ptr[:, :window, :hidden_size], embeds[source])


def _shift_input_ids(
    input_ids_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    last_token_indices_ptr: torch.Tensor,
    draft_tokens_ptr: torch.Tensor,
    BLOCK_SIZE: int = 1024,
) -> None:
    """Multi-module MTP, between its modules: each request's input ids from its query
    start to its last token index shifted left by one, the draft token at the last
    index. Padding rows (negative request state) are left alone.

    Computed over the whole ``input_ids_ptr`` buffer (unchanged outside the requests'
    ranges), with no host value read from a tensor, so that a host graph replays it.
    """
    num_reqs = idx_mapping_ptr.shape[0]
    starts = query_start_loc_ptr[:num_reqs].long()
    last = last_token_indices_ptr[:num_reqs].long()
    valid = idx_mapping_ptr.long() >= 0
    positions = torch.arange(input_ids_ptr.shape[0])
    row = (torch.searchsorted(starts, positions, right=True) - 1).clamp(min=0)
    inside = valid[row] & (positions >= starts[row])
    shifted = inside & (positions < last[row])
    at_last = inside & (positions == last[row])
    following = torch.cat([input_ids_ptr[1:], input_ids_ptr[-1:]])
    drafts = draft_tokens_ptr[:num_reqs].to(input_ids_ptr.dtype)[row]
    updated = torch.where(shifted, following, torch.where(at_last, drafts, input_ids_ptr))
    input_ids_ptr.copy_(updated)


def _ngram_scan(
    token_ids_ptr: torch.Tensor,
    token_ids_stride: int,
    idx_mapping_ptr: torch.Tensor,
    total_len_ptr: torch.Tensor,
    num_sampled_ptr: torch.Tensor,
    scratch_ptr: torch.Tensor,
    scratch_stride: int,
    L: int,
    MIN_N: int,
    MAX_N: int,
    MAX_N_PO2: int,
    BLOCK_L: int,
    **launch_options: Any,
) -> None:
    """V2's ngram drafter, first pass: per batch row and block of ``BLOCK_L``
    positions, the best match of the row's last ``n`` tokens (``MIN_N <= n <= MAX_N``)
    starting in the block, packed as ``n * (L + 1) + pos + 1`` (so the largest is the
    longest, then the rightmost), 0 for none. A match at ``pos`` ends before the
    suffix itself (``pos + n < seq_len``). Rows that sampled nothing, or hold fewer
    than ``MIN_N`` tokens, score 0.

    ``token_ids_ptr``: int32 ``[max_num_reqs, token_ids_stride]`` by request state;
    ``idx_mapping_ptr``: ``[num_reqs]`` batch row -> request state; ``total_len_ptr``:
    ``[max_num_reqs]``; ``num_sampled_ptr``: ``[num_reqs]``; ``scratch_ptr``: int64
    ``[>= num_reqs, scratch_stride]``, its first ``cdiv(L, BLOCK_L)`` columns written
    (the kernel's launch grid).
    """
    num_reqs = idx_mapping_ptr.shape[0]
    num_blocks = -(-int(L) // BLOCK_L)
    tokens = token_ids_ptr.reshape(-1)
    rows = idx_mapping_ptr.long()[:, None] * token_ids_stride  # [num_reqs, 1]
    seq_lens = total_len_ptr[idx_mapping_ptr.long()].long()[:, None]
    positions = torch.arange(num_blocks * BLOCK_L)
    last = tokens.numel() - 1
    best = torch.zeros(num_reqs, num_blocks * BLOCK_L, dtype=torch.int64)
    for n in range(MIN_N, MAX_N + 1):  # a longer match overwrites: its score is larger
        match = positions <= seq_lens - n - 1
        for j in range(n):
            window = tokens[(rows + positions + j).clamp(max=last)]
            suffix = tokens[(rows + seq_lens - n + j).clamp(min=0, max=last)]
            match &= window == suffix
        best = torch.where(match, n * (int(L) + 1) + positions + 1, best)
    block_best = best.view(num_reqs, num_blocks, BLOCK_L).amax(dim=-1)
    eligible = (num_sampled_ptr[:num_reqs, None] > 0) & (seq_lens >= MIN_N)
    block_best = torch.where(eligible, block_best, 0)
    offsets = torch.arange(num_reqs)[:, None] * scratch_stride + torch.arange(num_blocks)
    _write_flat(scratch_ptr, offsets.reshape(-1), block_best.reshape(-1))


def _ngram_finalize(
    token_ids_ptr: torch.Tensor,
    token_ids_stride: int,
    idx_mapping_ptr: torch.Tensor,
    total_len_ptr: torch.Tensor,
    num_sampled_ptr: torch.Tensor,
    last_sampled_ptr: torch.Tensor,
    scratch_ptr: torch.Tensor,
    scratch_stride: int,
    drafts_ptr: torch.Tensor,
    L: int,
    N_BLOCKS: int,
    K: int,
    K_PO2: int,
    N_BLOCKS_PO2: int,
    **launch_options: Any,
) -> None:
    """V2's ngram drafter, second pass: each batch row's ``K`` draft tokens, those
    that followed its best match (the largest score of :func:`_ngram_scan` over its
    ``N_BLOCKS`` blocks); slots past the row's tokens, and every slot of a row without
    a match or that sampled nothing, hold the row's last sampled token.

    ``last_sampled_ptr``: int64 ``[max_num_reqs]`` by request state; ``drafts_ptr``:
    int64, row ``b``'s drafts at ``b * K`` onwards (``[max_num_reqs, K]``).
    """
    num_reqs = idx_mapping_ptr.shape[0]
    reqs = idx_mapping_ptr.long()
    batch = torch.arange(num_reqs)
    blocks = batch[:, None] * scratch_stride + torch.arange(N_BLOCKS)
    score = scratch_ptr.reshape(-1)[blocks].amax(dim=1)
    if N_BLOCKS_PO2 > N_BLOCKS:  # the kernel's padding blocks count as 0
        score = score.clamp(min=0)
    seq_lens = total_len_ptr[reqs].long()
    last_tokens = last_sampled_ptr.reshape(-1)[reqs]
    has_match = score > 0
    length = torch.where(has_match, (score - 1) // (int(L) + 1), 0)
    start = torch.where(has_match, score - 1 - length * (int(L) + 1) + length, 0)
    available = (seq_lens - start).clamp(min=0)
    write_ok = (num_sampled_ptr[:num_reqs] > 0) & has_match
    column = torch.arange(K)
    valid = (column < available[:, None]) & write_ok[:, None]
    index = (start[:, None] + column).clamp(max=int(L) - 1)
    tokens = token_ids_ptr.reshape(-1)[
        torch.where(valid, reqs[:, None] * token_ids_stride + index, 0)
    ]
    drafts = torch.where(valid, tokens.long(), last_tokens[:, None])
    _write_flat(drafts_ptr, (batch[:, None] * K + column).reshape(-1), drafts.reshape(-1))


# vLLM's kernel (its dispatcher key) -> its PyTorch version here.
KERNELS = {
    v2_kernel_path("_prepare_pos_seq_lens_kernel"): _prepare_pos_seq_lens,
    v2_kernel_path("_combine_sampled_and_draft_tokens_kernel"): _combine_sampled_and_draft_tokens,
    v2_kernel_path("_get_num_sampled_and_rejected_kernel"): _get_num_sampled_and_rejected,
    v2_kernel_path("_post_update_kernel"): _post_update,
    v2_kernel_path("_gather_block_tables_kernel"): _gather_block_tables,
    v2_kernel_path("_compute_slot_mappings_kernel"): _compute_slot_mappings,
    v2_kernel_path("_apply_write_kernel"): _apply_write,
    v2_kernel_path("_gumbel_sample_kernel"): _gumbel_sample,
    v2_kernel_path("_update_draft_inputs_kernel"): _update_draft_inputs,
    v2_kernel_path("_cache_inputs_kernel"): _cache_inputs,
    v2_kernel_path("_shift_input_ids_kernel"): _shift_input_ids,
    v2_kernel_path("_ngram_scan_kernel"): _ngram_scan,
    v2_kernel_path("_ngram_finalize_kernel"): _ngram_finalize,
}


def register() -> None:
    """Register :data:`KERNELS` with vLLM's kernel dispatcher."""
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(KERNELS)
