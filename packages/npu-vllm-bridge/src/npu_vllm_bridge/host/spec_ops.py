"""PyTorch versions of the compiled CPU kernels of V1 speculative decoding.

vLLM's CPU platform replaces V1's Triton kernels of rejection sampling and EAGLE's
input preparation with wrappers (``vllm.utils.cpu_triton_utils``) that call compiled
ops of ``vllm._C``. A vLLM built empty has none; ``compiled_ops`` defines these
functions under the ops' names and schemas there. Each follows the Triton kernel it
replaces (``vllm/v1/sample/rejection_sampler.py``, ``vllm/v1/spec_decode/utils.py``),
with the compiled op's arguments: outputs are written in place, in their own dtypes.

``cu_num_draft_tokens`` is an inclusive cumulative sum (``[batch]``, request ``r``'s
draft tokens are ``[cu[r - 1], cu[r])``), as vLLM passes it.
"""

from __future__ import annotations

import torch


def _draft_spans(cu_num_draft_tokens: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each request's draft tokens."""
    ends = cu_num_draft_tokens.tolist()
    return list(zip([0, *ends[:-1]], ends))


def _write(out: torch.Tensor, index: list[int], values: list[int] | torch.Tensor) -> None:
    if index:
        out.view(-1)[torch.tensor(index, dtype=torch.int64)] = torch.as_tensor(values).to(out.dtype)


def rejection_greedy_sample(
    output_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor | None,
    max_spec_len: int,
) -> None:
    """Greedy verification: for each greedy request (all when ``is_greedy`` is None) write
    the target's argmax at each draft position up to and including the first mismatch,
    and the bonus token after a fully accepted draft, into ``output_token_ids
    [batch, max_spec_len + 1]``; other entries are left as they are.

    ``draft_token_ids`` / ``target_argmax``: ``[num_tokens]``; ``bonus_token_ids``:
    ``[batch]`` or ``[batch, 1]``; ``is_greedy``: bool ``[batch]``."""
    draft, target = draft_token_ids.tolist(), target_argmax.tolist()
    bonus = bonus_token_ids.reshape(-1).tolist()
    greedy = None if is_greedy is None else is_greedy.tolist()
    index, values = [], []
    for req, (start, end) in enumerate(_draft_spans(cu_num_draft_tokens)):
        if greedy is not None and not greedy[req]:
            continue
        row = req * (max_spec_len + 1)
        accepted = 0
        for pos in range(end - start):
            index.append(row + pos)
            values.append(target[start + pos])
            if draft[start + pos] != target[start + pos]:
                break
            accepted += 1
        if accepted == end - start:
            index.append(row + accepted)
            values.append(bonus[req])
    _write(output_token_ids, index, values)


def rejection_random_sample(
    output_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    recovered_token_ids: torch.Tensor,
    uniform_probs: torch.Tensor,
    is_greedy: torch.Tensor | None,
    max_spec_len: int,
    vocab_size: int,
    no_draft_probs: bool,
) -> None:
    """Random verification of each non-greedy request: draft token ``d`` at token ``t``
    is accepted when ``target_probs[t, d] / q >= uniform_probs[t]`` with ``q =
    draft_probs[t, d]`` (1 when ``no_draft_probs``; ``q == 0`` and ``d < 0`` reject); the
    first rejected position takes ``recovered_token_ids[t]``, a fully accepted draft
    the bonus token. Probabilities float32 ``[num_tokens, vocab_size]``.

    A -1 (padded) draft is rejected, as in vLLM's Triton kernel; vLLM 0.32's compiled
    CPU op reads the probability before the row for it instead."""
    del vocab_size  # the probabilities' width
    draft = draft_token_ids.to(torch.int64)
    if draft.numel() == 0:
        return
    token = torch.arange(draft.numel())
    column = draft.clamp(min=0)
    target = target_probs[token, column].float()
    if no_draft_probs or draft_probs is None:
        proposal = torch.ones_like(target)
    else:
        proposal = draft_probs[token, column].float()
    ratio = target / torch.where(proposal > 0, proposal, torch.ones_like(proposal))
    accept = ((draft >= 0) & (proposal > 0) & (ratio >= uniform_probs.float())).tolist()
    draft_list, recovered = draft.tolist(), recovered_token_ids.tolist()
    bonus = bonus_token_ids.reshape(-1).tolist()
    greedy = None if is_greedy is None else is_greedy.tolist()
    index, values = [], []
    for req, (start, end) in enumerate(_draft_spans(cu_num_draft_tokens)):
        if greedy is not None and greedy[req]:
            continue
        row = req * (max_spec_len + 1)
        accepted = 0
        for pos in range(end - start):
            index.append(row + pos)
            if not accept[start + pos]:
                values.append(recovered[start + pos])
                break
            values.append(draft_list[start + pos])
            accepted += 1
        if accepted == end - start:
            index.append(row + accepted)
            values.append(bonus[req])
    _write(output_token_ids, index, values)


def expand(
    output: torch.Tensor,
    input: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: int,
    replace_to: int,
) -> None:
    """Repeat ``input[r]`` (``replace_to`` where it equals ``replace_from``) over request
    ``r``'s tokens ``[cu_num_tokens[r - 1], cu_num_tokens[r])`` of ``output``."""
    values = torch.where(input == replace_from, replace_to, input)
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
    total = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def sample_recovered_tokens(
    output_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    inv_q: torch.Tensor,
    vocab_size: int,
    no_draft_probs: bool,
) -> None:
    """For each draft token ``t`` of request ``r``: ``argmax_v p[v] * inv_q[r, v]`` with
    ``p = max(target - draft, 0)`` (without draft probabilities: the target's, the
    draft token's own entry zeroed): a draw from ``p`` normalised, given ``inv_q`` the
    reciprocals of exponential samples (float32 ``[batch, vocab_size]``)."""
    spans = _draft_spans(cu_num_draft_tokens)
    total = spans[-1][1] if spans else 0
    if total == 0:
        return
    requests = torch.repeat_interleave(
        torch.arange(len(spans)), torch.tensor([end - start for start, end in spans])
    )
    target = target_probs[:total, :vocab_size].float()
    if no_draft_probs or draft_probs is None:
        draft = draft_token_ids[:total].to(torch.int64)
        own = torch.nn.functional.one_hot(draft.clamp(0, vocab_size - 1), vocab_size).bool()
        probs = target.masked_fill(own & (draft >= 0).unsqueeze(1), 0.0)
    else:
        probs = (target - draft_probs[:total, :vocab_size].float()).clamp(min=0.0)
    score = probs * inv_q[requests, :vocab_size].float()
    output_token_ids[:total] = score.argmax(dim=-1).to(output_token_ids.dtype)


def eagle_prepare_inputs_padded(
    cu_num_draft_tokens: torch.Tensor,
    valid_sampled_tokens_count: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_indices_to_sample: torch.Tensor,
    num_rejected_tokens: torch.Tensor,
    num_reqs: int,
) -> None:
    """Per request (the first ``num_reqs``): rejected tokens ``drafts + 1 - valid``
    (0 without drafts) into ``num_rejected_tokens``, and the index of its last accepted
    token, ``query_start_loc[r + 1] - 1 - rejected``, into ``token_indices_to_sample``."""
    n = int(num_reqs)
    cu = cu_num_draft_tokens[:n].to(torch.int64)
    drafts = torch.diff(cu, prepend=torch.zeros(1, dtype=torch.int64))
    valid = valid_sampled_tokens_count[:n].to(torch.int64)
    rejected = torch.where(drafts > 0, drafts + 1 - valid, torch.zeros_like(drafts))
    last = query_start_loc[1 : n + 1].to(torch.int64) - 1
    token_indices_to_sample[:n] = (last - rejected).to(token_indices_to_sample.dtype)
    num_rejected_tokens[:n] = rejected.to(num_rejected_tokens.dtype)


def eagle_prepare_next_token_padded(
    sampled_token_ids: torch.Tensor,
    discard_request_mask: torch.Tensor,
    backup_next_token_ids: torch.Tensor,
    next_token_ids: torch.Tensor,
    valid_sampled_tokens_count: torch.Tensor,
    vocab_size: int,
    num_sampled_tokens_per_req: int,
    num_reqs: int,
) -> None:
    """Per request: the count of valid sampled tokens (``!= -1`` and ``< vocab_size``) of
    ``sampled_token_ids [num_reqs, >= num_sampled_tokens_per_req]`` and the last valid
    one as its next token; a discarded request, or one without a valid token, takes its
    backup token (a discarded one with count 0)."""
    n = int(num_reqs)
    sampled = sampled_token_ids[:n, :num_sampled_tokens_per_req].to(torch.int64)
    valid = (sampled != -1) & (sampled < vocab_size)
    count = valid.sum(dim=1)
    columns = torch.arange(sampled.shape[1]).expand_as(sampled)
    last = torch.where(valid, columns, -1).amax(dim=1).clamp(min=0)
    last_token = sampled.gather(1, last.unsqueeze(1)).squeeze(1)
    discarded = discard_request_mask[:n].bool()
    backup = backup_next_token_ids[:n].to(torch.int64)
    take_backup = discarded | (count == 0)
    next_token_ids[:n] = torch.where(take_backup, backup, last_token).to(next_token_ids.dtype)
    count = torch.where(discarded, torch.zeros_like(count), count)
    valid_sampled_tokens_count[:n] = count.to(valid_sampled_tokens_count.dtype)


def eagle_step_slot_mapping_metadata(
    positions: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out_clamped_positions: torch.Tensor,
    out_slot_mapping: torch.Tensor,
    block_size: int,
    max_model_len: int,
    pad_id: int,
) -> None:
    """One EAGLE draft step for ``positions [batch]``: each position advances by one
    (to 0 at ``max_model_len``, whose slot is ``pad_id`` and sequence length 1), its slot
    from ``block_table [>= batch, blocks]``, ``seq_lens`` incremented (capped at
    ``max_model_len``); ``out_slot_mapping`` entries past the batch (graph padding) get
    ``pad_id``."""
    batch = positions.shape[0]
    advanced = positions.to(torch.int64) + 1
    beyond = advanced >= max_model_len
    clamped = torch.where(beyond, torch.zeros_like(advanced), advanced)
    block = (clamped // block_size).clamp(max=block_table.shape[1] - 1)
    block_ids = block_table[torch.arange(batch), block].to(torch.int64)
    slots = torch.where(beyond, pad_id, block_ids * block_size + clamped % block_size)
    lengths = torch.where(beyond, torch.ones_like(advanced), seq_lens[:batch].to(torch.int64) + 1)
    seq_lens[:batch] = lengths.clamp(max=max_model_len).to(seq_lens.dtype)
    out_clamped_positions[:batch] = clamped.to(out_clamped_positions.dtype)
    out_slot_mapping[:batch] = slots.to(out_slot_mapping.dtype)
    out_slot_mapping[batch:] = pad_id


def copy_and_expand_eagle_inputs(
    target_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    next_token_ids: torch.Tensor,
    out_input_ids: torch.Tensor,
    out_positions: torch.Tensor,
    out_is_rejected_token_mask: torch.Tensor,
    out_is_masked_token_mask: torch.Tensor,
    out_new_token_indices: torch.Tensor,
    out_hidden_state_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_end_loc: torch.Tensor,
    padding_token_id: int,
    parallel_drafting_token_id: int,
    total_input_tokens: int,
    num_padding_slots_per_request: int,
    shift_input_ids: bool,
) -> None:
    """The drafter's inputs from the target's: per request, its valid tokens (shifted by
    one with ``shift_input_ids``), the bonus token ``next_token_ids[r]``, parallel-drafting
    slots, then its rejected tokens as padding; positions count on from the request's
    first target position (0 for rejected slots); masks of rejected and parallel-drafting
    slots, the output index of each new token, and with ``shift_input_ids`` the output
    index of each input token's hidden state. Requests: ``query_end_loc [num_reqs]``."""
    slots = int(num_padding_slots_per_request)
    starts, ends = query_start_loc.tolist(), query_end_loc.tolist()
    for req, query_end in enumerate(ends):
        query_start, next_start = starts[req], starts[req + 1]
        if shift_input_ids:
            valid, offset, out_start = query_end - query_start, 1, query_start + req * (slots - 1)
        else:
            valid, offset, out_start = query_end - query_start + 1, 0, query_start + req * slots
        rejected = next_start - query_end - 1
        j = torch.arange(valid + slots + rejected)
        source = (query_start + offset + j).clamp(max=total_input_tokens - 1)
        ids = target_token_ids[source].to(torch.int64)
        ids = torch.where(j == valid, int(next_token_ids[req]), ids)
        parallel = (j > valid) & (j < valid + slots)
        ids = torch.where(parallel, parallel_drafting_token_id, ids)
        is_rejected = j >= valid + slots
        ids = torch.where(is_rejected, padding_token_id, ids)
        positions = int(target_positions[query_start]) + j
        positions = torch.where(is_rejected, torch.zeros_like(positions), positions)
        out = slice(out_start, out_start + j.numel())
        out_input_ids[out] = ids.to(out_input_ids.dtype)
        out_positions[out] = positions.to(out_positions.dtype)
        out_is_rejected_token_mask[out] = is_rejected.to(out_is_rejected_token_mask.dtype)
        out_is_masked_token_mask[out] = parallel.to(out_is_masked_token_mask.dtype)
        first_new = req * slots
        out_new_token_indices[first_new : first_new + slots] = torch.arange(
            out_start + valid, out_start + valid + slots, dtype=out_new_token_indices.dtype
        )
        if shift_input_ids:
            inputs = next_start - query_start
            out_hidden_state_mapping[query_start:next_start] = torch.arange(
                out_start, out_start + inputs, dtype=out_hidden_state_mapping.dtype
            )
