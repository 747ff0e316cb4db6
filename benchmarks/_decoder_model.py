"""A Llama-shaped decoder built from torch ops, ``npu_attention`` and ``npu_graphs``.

Each layer: RMSNorm, fused QKV projection, rotary embedding (Meta's Llama form:
interleaved pairs as complex numbers, applied to Q and K in one pass), paged
attention (``npu_attention.run`` as an updatable task of ``npu_graphs``), output
projection, RMSNorm, SiLU-gated MLP; residual adds fused into the projections
(``addmm``). No embedding or LM head: the step maps hidden states to hidden states. The attention task's step arguments are
the plan's device tensors, so a captured graph reads them from the task registry's
fixed buffers, which ``TaskRegistry.update`` refreshes before each replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from npu_attention import AttentionPlan, AttentionSpec, run
from npu_graphs import call_task

_STEP_TENSORS = ("cu_seqlens_q", "seq_lens", "context_lens", "block_tables", "slot_mapping")


@dataclass(frozen=True)
class DecoderConfig:
    num_layers: int = 16
    hidden_size: int = 2048
    num_heads: int = 16
    num_kv_heads: int = 4
    intermediate_size: int = 8192
    block_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    rope_theta: float = 500000.0
    max_position: int = 8192

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(
            self.num_heads, self.num_kv_heads, self.head_size, self.block_size, dtype=self.dtype
        )


def plan_tensors(step: AttentionPlan) -> Mapping[str, torch.Tensor]:
    """The attention task's step arguments: the plan's device tensors."""
    return {name: getattr(step, name) for name in _STEP_TENSORS}


def attention_task(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    template: AttentionPlan,
    **step_tensors: torch.Tensor,
) -> torch.Tensor:
    """``npu_attention.run`` on ``template``'s host fields and the given device tensors
    (inside a capture: the task registry's fixed buffers)."""
    if any(step_tensors[n] is not getattr(template, n) for n in _STEP_TENSORS):
        template = dataclasses.replace(template, **step_tensors)
    return run(query, key, value, key_cache, value_cache, template, out)


class LlamaDecoder:
    """Random-weight decoder layers with one paged KV cache per layer."""

    def __init__(
        self, config: DecoderConfig, num_blocks: int, device: torch.device, seed: int = 0
    ) -> None:
        self.config, self.device = config, device
        self.spec = config.attention_spec()
        gen = torch.Generator(device=device).manual_seed(seed)
        c, d = config, config.head_size

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
            return (w / cols**0.5).to(c.dtype)

        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * d
        self.layers = [
            {
                "input_norm": torch.ones(c.hidden_size, dtype=c.dtype, device=device),
                "qkv": weight(qkv_rows, c.hidden_size),
                "o": weight(c.hidden_size, c.num_heads * d),
                "post_norm": torch.ones(c.hidden_size, dtype=c.dtype, device=device),
                "gate_up": weight(2 * c.intermediate_size, c.hidden_size),
                "down": weight(c.hidden_size, c.intermediate_size),
            }
            for _ in range(c.num_layers)
        ]
        self.final_norm = torch.ones(c.hidden_size, dtype=c.dtype, device=device)
        cache_shape = (num_blocks, c.block_size, c.num_kv_heads, d)
        self.key_caches = [
            torch.randn(cache_shape, generator=gen, device=device, dtype=c.dtype)
            for _ in range(c.num_layers)
        ]
        self.value_caches = [
            torch.randn(cache_shape, generator=gen, device=device, dtype=c.dtype)
            for _ in range(c.num_layers)
        ]
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d)
        angles = torch.arange(c.max_position, device=device).float()[:, None] * inv_freq
        self.rotary = torch.polar(torch.ones_like(angles), angles)  # complex64 [positions, d/2]

    def weight_bytes(self) -> int:
        tensors = [t for layer in self.layers for t in layer.values()] + [self.final_norm]
        return sum(t.numel() * t.element_size() for t in tensors)

    def kv_bytes_read(self, seq_lens: list[int]) -> int:
        """Bytes of K and V one step reads over all layers."""
        c = self.config
        per_token = 2 * c.num_kv_heads * c.head_size * torch.finfo(c.dtype).bits // 8
        return c.num_layers * per_token * sum(seq_lens)

    def __call__(
        self, hidden: torch.Tensor, positions: torch.Tensor, step: AttentionPlan
    ) -> torch.Tensor:
        """``hidden`` ``[tokens, hidden_size]``, ``positions`` int64 ``[tokens]`` -> hidden."""
        c, d = self.config, self.config.head_size
        rotary = self.rotary[positions][:, None, :]  # [tokens, 1, d/2]
        tokens = hidden.shape[0]
        q_heads, kv_heads = c.num_heads, c.num_kv_heads
        for index, layer in enumerate(self.layers):
            x = F.rms_norm(hidden, (c.hidden_size,), layer["input_norm"], eps=1e-5)
            qkv = F.linear(x, layer["qkv"])
            qk = _rotate(qkv[:, : (q_heads + kv_heads) * d].view(tokens, -1, d), rotary)
            q, k = qk[:, :q_heads], qk[:, q_heads:]
            v = qkv[:, (q_heads + kv_heads) * d :].view(tokens, kv_heads, d)
            attn = torch.empty(tokens, q_heads, d, dtype=c.dtype, device=hidden.device)
            call_task(
                attention_task, q, k, v, self.key_caches[index], self.value_caches[index], attn,
                step=step, derive=plan_tensors, template=step,
            )  # fmt: skip
            hidden = torch.addmm(hidden, attn.view(tokens, -1), layer["o"].t())
            x = F.rms_norm(hidden, (c.hidden_size,), layer["post_norm"], eps=1e-5)
            gate, up = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
            hidden = torch.addmm(hidden, F.silu(gate) * up, layer["down"].t())
        return F.rms_norm(hidden, (c.hidden_size,), self.final_norm, eps=1e-5)


def _rotate(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[tokens, heads, d]`` (pairs ``(2i, 2i+1)`` rotated by
    ``rotary`` ``[tokens, 1, d/2]``, complex); returns a new contiguous tensor."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotary).flatten(-2).to(x.dtype)
