"""A toy model with an attention-like updatable task, and its eager oracle.

``segment_mix`` stands for an attention op that takes per-step host state
(``seq_lens``, one length per request, as NPU fused attention takes
``actual_seq_lengths``): each token becomes the mean of the hidden states of the
tokens of its own request up to itself. Padded tokens (past ``sum(seq_lens)``) and
padded requests (length 0) contribute nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

import npu_graphs


def segment_mix(hidden: torch.Tensor, *, seq_lens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """hidden [tokens, dim] float -> [tokens, dim]; seq_lens: host list or int tensor [requests]."""
    lens = torch.as_tensor(seq_lens, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    token = torch.arange(hidden.shape[0], device=hidden.device)
    member = (token[:, None] >= starts[None, :]) & (token[:, None] < ends[None, :])
    same_request = (member.to(hidden.dtype) @ member.to(hidden.dtype).T) > 0
    causal = token[None, :] <= token[:, None]
    weights = (same_request & causal).to(hidden.dtype)
    return (weights @ hidden) / weights.sum(1, keepdim=True).clamp(min=1)


class ToyModel:
    """``num_layers`` of ``x = x + segment_mix(tanh(x @ W_i))``, segment_mix as updatable task."""

    def __init__(
        self,
        hidden: int,
        num_layers: int,
        device: torch.device,
        dtype: torch.dtype,
        registry: npu_graphs.TaskRegistry | None = None,
        seed: int = 0,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.weights = [
            (torch.randn(hidden, hidden, generator=generator, dtype=dtype) / hidden**0.5).to(device)
            for _ in range(num_layers)
        ]
        self.registry = registry

    def __call__(self, x: torch.Tensor, step: dict) -> torch.Tensor:
        for weight in self.weights:
            h = torch.tanh(x @ weight)
            if self.registry is None:
                mixed = segment_mix(h, **step)
            else:
                mixed = self.registry.call(segment_mix, h, step=step)
            x = x + mixed
        return x


def make_step(
    backend: npu_graphs.GraphBackend, seq_lens: Sequence[int], num_reqs: int, device: torch.device
) -> dict:
    """The step object: seq_lens padded with zeros to ``num_reqs`` requests.

    Backends with task update get a host list (re-issued); others a device tensor
    (copied into a fixed buffer).
    """
    padded = list(seq_lens) + [0] * (num_reqs - len(seq_lens))
    if backend.supports_task_update:
        return {"seq_lens": padded}
    return {"seq_lens": torch.tensor(padded, dtype=torch.int64, device=device)}


def split_tokens(num_tokens: int, cuts: Sequence[int]) -> list[int]:
    """Request lengths from sorted cut points inside ``(0, num_tokens)``."""
    points = [0, *sorted(set(c for c in cuts if 0 < c < num_tokens)), num_tokens]
    return [b - a for a, b in itertools.pairwise(points)]
