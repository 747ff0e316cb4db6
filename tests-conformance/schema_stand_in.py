"""A stand-in ``torch_npu`` module built from torch_npu's own schemas.

Every attribute of the stand-in is an operator of the torch_npu wheel's codegen
yaml; an attribute torch_npu does not have raises ``SchemaViolation``. A call is
first bound to the operator's schema (keywords, required arguments, arity,
argument types), then checked against the values and shapes the op-plugin
documentation allows, recorded, and finally answered on CPU tensors by a
reference implementation of what the documentation says the op computes:

- ``npu_fused_infer_attention_score`` (+ ``.out``, ``_get_max_workspace``) in
  ``TND`` layout: ``actual_seq_lengths`` are *cumulative* query ends,
  ``actual_seq_lengths_kv`` *per-request* KV lengths when a ``block_table`` pages
  the KV; ``sparse_mode`` 0 (no mask), 2 (top-left causal), 3 (bottom-right
  causal), 4 (band: ``pre_tokens`` before and ``next_tokens`` after the
  bottom-right diagonal); modes 2 to 4 take the 2048x2048 mask, ``True`` above the
  diagonal; ``softmax_lse`` is ``[T, N, 1]`` float32 when asked for, else ``[1]``.
- the same op in ``BNSD`` with one query token per request (the IncreFlashAttention
  branch) over paged caches, float16/bfloat16 or int8 keys and values; int8 pages need
  ``key_antiquant_scale`` and ``value_antiquant_scale`` (both or neither), with
  ``key_antiquant_mode`` / ``value_antiquant_mode`` equal (or 0 and 1) in 0..5 and each
  mode's documented scale shape and dtype: 0 per tensor ``(1,)`` or per channel
  ``(1, N, 1, D)`` / ``(1, N, D)`` / ``(1, H)`` in the query dtype, 2 per head ``(N,)`` in
  the query dtype, 4 ``(blocknum, blocksize)`` and 5 ``(blocknum, N, blocksize)`` float32
  (scales managed by page attention); modes 1 and 3 are checked, not computed. Keys are
  dequantized (``code * scale``) before the attention. Antiquant scales with float keys,
  and int8 paged keys on the prompt branch (more than one query token: its page
  attention takes no antiquant), are refused.
- ``npu_fused_infer_attention_score_v2`` (+ ``.out``, ``_get_max_workspace``) in its
  two documented MLA uses (``query_rope`` / ``key_rope`` given, ``TND``): the paged
  absorbed call (query D 512, rope D 64, query N 32/64/128, key N 1, block size 16
  or 128, 1 to 16 query tokens per request, ``sparse_mode`` 0 without a mask for
  single-token requests and 3 with the 2048 mask otherwise, no LSE), scores
  ``q . k + q_rope . k_rope`` and values ``value``; and the non-paged call (Q, K, V D
  128, rope D 64, bfloat16 only, cumulative ``actual_seq_qlen`` / ``actual_seq_kvlen``,
  ``sparse_mode`` 0 or 3).
- ``npu_scatter_pa_kv_cache`` with ``cache_mode="Norm"`` (ND caches
  ``[num_blocks, block_size, N, D]``); slots must lie in ``[0, num_blocks * block_size)``.
- ``npu_fusion_attention`` in ``TND`` with cumulative ``actual_seq_qlen/kvlen``.
- ``torch_npu.atb.npu_multi_head_latent_attention`` (ATB's MultiLatentAttention; each
  call bound to the overload it selects, checked against both the header declaration
  and the registered schema) and ``_npu_multi_head_latent_attention_get_workspace`` in
  the paged decode use with ``return_lse=True, calc_type="calc_type_ring"``
  (``cache_mode`` ``krope_ctkv``, no mask): query N 8/16/32/64/128, KV N 1, D 512 +
  rope 64, ``0 < qk_scale <= 1``, block size <= 128, batch <= 8192, one query token per
  request, ``output`` like ``q_nope``, ``lse`` ``[T, N, 1]`` in the query dtype (the
  dtype op-plugin allocates it in; the ATB documentation lists float16/bf16). The
  LSE is natural-log, rounded to that dtype. A request of context length 0 gets NaN
  rows in ``output`` and ``lse``: the documentation does not say what it writes.

Any other operator, or a documented mode the reference does not model, raises
``NotModeled`` after the schema check. Nothing in the packages imports this module.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import math
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch_npu_schemas import OpSchema, SchemaViolation, TorchNpuApi

FIA_LAYOUTS = (
    "BSH",
    "BSND",
    "BNSD",
    "BNSD_BSND",
    "BSH_NBSD",
    "BSND_NBSD",
    "BNSD_NBSD",
    "TND",
    "TND_NTD",
    "NTD_TND",
)  # documented input_layout values
FIA_SPARSE_MODES = (0, 1, 2, 3, 4)  # documented for the prompt branch
FUSION_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
SCATTER_CACHE_MODES = ("PA_NZ", "Norm")
MASK_SIZE = 2048
FIA_DTYPES = (torch.float16, torch.bfloat16)
PAGED_BLOCK_SIZES = range(128, 513, 128)  # paged prompt attention: multiples of 128 up to 512
MAX_TOKENS = 2147483647  # pre_tokens / next_tokens default


class NotModeled(Exception):
    """A call torch_npu accepts but the stand-in's reference does not implement."""


class NotModeledAttribute(NotModeled, AttributeError):
    """A name torch_npu has that the stand-in does not model (``hasattr`` is False)."""


class UnknownAttribute(SchemaViolation, AttributeError):
    """A name torch_npu does not have (``hasattr`` is False)."""


@dataclass
class Call:
    """One recorded call: which API, with every argument by name."""

    name: str
    arguments: dict[str, Any]


@dataclass
class CallLog:
    """Every call, by name and arguments (``keep=False``: counted by name only, so that
    a long engine run holds no tensors through its log)."""

    calls: list[Call] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    keep: bool = True
    # calls on 8-bit KV pages, by name and the dtype / antiquant mode of the pages
    quantized: Counter = field(default_factory=Counter)

    def record(self, call: Call) -> None:
        self.counts[call.name] += 1
        kind = _quantized_kind(call.arguments)
        if kind is not None:
            self.quantized[f"{call.name} ({kind})"] += 1
        if self.keep:
            self.calls.append(call)

    def names(self) -> set[str]:
        """Names of the calls; an ATB overload ``atb.f.lse_out`` also counts as ``atb.f``."""
        names = {call.name for call in self.calls}
        return names | {name.rsplit(".", 1)[0] for name in names if name.count(".") > 1}

    def of(self, name: str) -> list[Call]:
        return [call for call in self.calls if call.name == name]


def _quantized_kind(arguments: dict[str, Any]) -> str | None:
    """``int8`` (a KV write) or ``int8, key_antiquant_mode=M`` (an attention) for calls
    on 8-bit pages, else None."""
    pages = arguments.get("key_cache", arguments.get("key"))
    if not isinstance(pages, torch.Tensor) or pages.element_size() != 1:
        return None
    mode = arguments.get("key_antiquant_mode")
    return str(pages.dtype).removeprefix("torch.") + (
        "" if mode is None else f", key_antiquant_mode={mode}"
    )


class Launcher:
    """Runs an op now; a device-graph stand-in replaces it to capture or update ops."""

    def launch(self, name: str, implementation: Callable[[dict], Any], arguments: dict) -> Any:
        return implementation(arguments)


class CheckedOp:
    """A torch_npu operator: schema check, documented-value check, record, compute."""

    def __init__(
        self,
        schema: OpSchema,
        module: StandInTorchNpu,
        implementation: Callable[[dict[str, Any]], Any] | None,
        out: CheckedOp | None = None,
    ) -> None:
        self.schema = schema
        self._module = module
        self._implementation = implementation
        if out is not None:
            self.out = out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self.schema.bind(args, kwargs)
        self._module.log.record(Call(self.schema.name, arguments))
        if self._implementation is None:
            raise NotModeled(f"the stand-in does not compute torch_npu.{self.schema.name}")
        return self._module.launcher.launch(self.schema.name, self._implementation, arguments)


class StandInTorchNpu(types.ModuleType):
    """``torch_npu`` as far as its schemas and documentation describe it."""

    def __init__(self, api: TorchNpuApi, log: CallLog) -> None:
        super().__init__("torch_npu")
        # A module spec, as an imported module has (importlib.util.find_spec reads it).
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.__version__ = api.version
        self.log = log
        self.launcher = Launcher()
        for name, schema in api.operators.items():
            if "." in name:
                continue
            out_schema = api.operators.get(f"{name}.out")
            out = None
            if out_schema is not None:
                out = CheckedOp(out_schema, self, IMPLEMENTATIONS.get(out_schema.name))
            setattr(self, name, CheckedOp(schema, self, IMPLEMENTATIONS.get(name), out))

        self.atb = StandInAtb(api, self)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnknownAttribute(f"torch_npu {self.__version__} has no operator {name!r}")


class AtbOp:
    """An ATB operator (``torch.ops.atb`` packet): the call goes to the first overload
    it binds to (declaration and registered schema), as torch's overload resolution."""

    def __init__(self, public: str, overloads: tuple, module: StandInTorchNpu) -> None:
        self.public, self.overloads, self._module = public, overloads, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        errors = []
        for overload in self.overloads:
            try:
                arguments = overload.bind(args, kwargs)
            except SchemaViolation as error:
                errors.append(str(error))
                continue
            self._module.log.record(Call(overload.name, arguments))
            implementation = IMPLEMENTATIONS.get(overload.name)
            if implementation is None:
                raise NotModeled(f"the stand-in does not compute torch_npu.{overload.name}")
            return self._module.launcher.launch(overload.name, implementation, arguments)
        raise SchemaViolation(
            f"torch_npu.{self.public}: no overload takes this call: " + "; ".join(errors)
        )


class StandInAtb(types.ModuleType):
    """``torch_npu.atb``: the ATB operators the wheel's ``_atb_ops.py`` lists there."""

    def __init__(self, api: TorchNpuApi, module: StandInTorchNpu) -> None:
        super().__init__("torch_npu.atb")
        self._version = api.version
        for public, overloads in api.atb_overloads.items():
            if public.startswith("atb."):
                setattr(self, public[len("atb.") :], AtbOp(public, overloads, module))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnknownAttribute(f"torch_npu {self._version} has no ATB operator atb.{name}")


# ---------------------------------------------------------------- fused infer attention


def _fia_check(a: dict[str, Any]) -> None:
    """The documented constraints of the TND + paged KV use of the fused op (and of the
    single-token BNSD use: ``_fia_bnsd_check``)."""
    _expect(
        a["input_layout"] in FIA_LAYOUTS,
        f"input_layout {a['input_layout']!r} is not one of the documented layouts {FIA_LAYOUTS}",
    )
    _expect(
        a["sparse_mode"] in FIA_SPARSE_MODES,
        f"sparse_mode={a['sparse_mode']} is not documented (supported: {FIA_SPARSE_MODES})",
    )
    if a["input_layout"] == "BNSD":
        _fia_bnsd_check(a)
        return
    if a["input_layout"] != "TND":
        raise NotModeled(f"input_layout {a['input_layout']!r}")
    query, key, value = a["query"], a["key"], a["value"]
    _expect(
        query.dtype in FIA_DTYPES, f"query dtype must be one of {FIA_DTYPES}, got {query.dtype}"
    )
    if key.dtype in ANTIQUANT_KV_DTYPES and a["block_table"] is not None:
        lengths = [
            e - s for s, e in zip([0, *a["actual_seq_lengths"][:-1]], a["actual_seq_lengths"])
        ]
        _expect(
            max(lengths, default=0) <= 1,
            "page attention with int8 keys and values (pseudo-quantization) is documented for "
            f"one query token per request only, got query lengths {lengths}",
        )
        raise NotModeled("TND paged attention over int8 keys")
    _check_no_antiquant(a)
    _expect(key.dtype == value.dtype == query.dtype, "query, key and value dtypes differ")
    _expect(
        key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    )
    for name in ("query", "key", "value"):
        _expect(a[name].is_contiguous(), f"{name} must be contiguous")
    _expect(query.dim() == 3, f"TND query must be [T, N, D], got {tuple(query.shape)}")
    num_heads, num_kv_heads = a["num_heads"], a["num_key_value_heads"] or a["num_heads"]
    _expect(query.shape[1] == num_heads, f"num_heads={num_heads} but query has {query.shape[1]}")
    _expect(
        num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64,
        f"num_heads={num_heads} is not a multiple (<= 64x) of num_key_value_heads={num_kv_heads}",
    )
    ends = a["actual_seq_lengths"]
    _expect(ends is not None and len(ends) > 0, "TND needs actual_seq_lengths")
    _expect(
        all(e >= 0 for e in ends) and all(x <= y for x, y in itertools.pairwise(ends)),
        f"TND actual_seq_lengths are cumulative (non-decreasing), got {list(ends)}",
    )
    _expect(
        ends[-1] == query.shape[0],
        f"TND actual_seq_lengths[-1] must equal T={query.shape[0]}, got {ends[-1]}",
    )
    if a["sparse_mode"] in (1, 2, 3, 4):
        _check_compressed_mask(a["atten_mask"], a["sparse_mode"])
    elif a["atten_mask"] is not None:
        raise NotModeled("sparse_mode=0 with a full atten_mask")
    if a["block_table"] is None:
        raise NotModeled("the fused op without block_table")
    _check_paged(a, num_kv_heads, query.shape[2], len(ends))


def _check_compressed_mask(mask: torch.Tensor | None, sparse_mode: int) -> None:
    if sparse_mode == 1:
        raise NotModeled("sparse_mode=1 (allMask)")
    _expect(mask is not None, f"sparse_mode={sparse_mode} needs the 2048x2048 atten_mask")
    _expect(
        mask.dtype in (torch.bool, torch.int8, torch.uint8),
        f"atten_mask dtype must be bool/int8/uint8, got {mask.dtype}",
    )
    _expect(
        mask.shape[-2:] == (MASK_SIZE, MASK_SIZE) and mask.numel() == MASK_SIZE**2,
        f"sparse_mode={sparse_mode} needs a (2048, 2048) atten_mask, got {tuple(mask.shape)}",
    )
    expected = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1)
    _expect(
        torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).bool().cpu(), expected),
        "the 2048x2048 atten_mask must be True strictly above the diagonal",
    )


def _check_paged(a: dict[str, Any], num_kv_heads: int, head_size: int, batch: int) -> None:
    key, table, block_size = a["key"], a["block_table"], a["block_size"]
    _expect(
        table.dtype == torch.int32 and table.dim() == 2,
        f"block_table must be int32 [B, max_blocks], got {table.dtype} {tuple(table.shape)}",
    )
    _expect(table.shape[0] == batch, f"block_table has {table.shape[0]} rows for batch {batch}")
    _expect(
        block_size in PAGED_BLOCK_SIZES,
        f"paged block_size must be a multiple of 128 in [128, 512], got {block_size}",
    )
    if key.dim() == 3:
        _expect(
            key.shape[1] == block_size and key.shape[2] == num_kv_heads * head_size,
            f"paged key (blocknum, blocksize, H) must be (*, {block_size}, "
            f"{num_kv_heads * head_size}), got {tuple(key.shape)}",
        )
    else:
        _expect(
            key.dim() == 4 and key.shape[1:] == (num_kv_heads, block_size, head_size),
            f"paged key must be (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D), "
            f"got {tuple(key.shape)}",
        )
    kv_lens = a["actual_seq_lengths_kv"]
    _expect(
        kv_lens is not None and len(kv_lens) == batch,
        f"paged attention needs actual_seq_lengths_kv with one length per request ({batch})",
    )
    capacity = table.shape[1] * block_size
    _expect(
        all(0 <= n <= capacity for n in kv_lens),
        f"actual_seq_lengths_kv are per-request lengths <= {capacity}, got {list(kv_lens)}",
    )


def _fia_compute(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    _fia_check(a)
    if a["input_layout"] == "BNSD":
        return _fia_bnsd_compute(a)
    query = a["query"]
    num_heads, num_kv_heads = a["num_heads"], a["num_key_value_heads"] or a["num_heads"]
    key = _paged_tokens(a["key"], num_kv_heads)
    value = _paged_tokens(a["value"], num_kv_heads)
    out = torch.zeros(query.shape, dtype=torch.float32)
    lse = torch.full((query.shape[0], num_heads, 1), float("inf"), dtype=torch.float32)
    ends = list(a["actual_seq_lengths"])
    block_size = a["block_size"]
    for b, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        kv_len = a["actual_seq_lengths_kv"][b]
        blocks = a["block_table"][b, : math.ceil(kv_len / block_size)].long()
        _expect(
            bool((blocks >= 0).all()) and bool((blocks < key.shape[0]).all()),
            f"block_table row {b} holds block ids outside [0, {key.shape[0]})",
        )
        k = key[blocks].reshape(-1, num_kv_heads, key.shape[-1])[:kv_len]
        v = value[blocks].reshape(-1, num_kv_heads, value.shape[-1])[:kv_len]
        visible = visible_keys(
            end - start, kv_len, a["sparse_mode"], a["pre_tokens"], a["next_tokens"]
        )
        rows, row_lse = _softmax_attention(query[start:end], k, v, visible, a["scale"])
        out[start:end], lse[start:end] = rows, row_lse
    return out.to(query.dtype), lse


def _paged_tokens(cache: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[blocks, block_size, kv_heads, D]`` view of a (blocknum, blocksize, H) or BNSD cache."""
    if cache.dim() == 3:
        return cache.reshape(cache.shape[0], cache.shape[1], num_kv_heads, -1)
    return cache.transpose(1, 2)


def visible_keys(q_len: int, kv_len: int, sparse_mode: int, pre: int, nxt: int) -> torch.Tensor:
    """``[q_len, kv_len]`` bool: which keys each query sees, by the documented modes."""
    i = torch.arange(q_len).unsqueeze(1)
    j = torch.arange(kv_len).unsqueeze(0)
    if sparse_mode == 0:
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    if sparse_mode == 2:
        return j <= i
    diagonal = i + (kv_len - q_len)  # bottom-right aligned
    if sparse_mode == 3:
        return j <= diagonal
    return (j >= diagonal - pre) & (j <= diagonal + nxt)


def _softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[S, N, D]``, k/v ``[L, KV_N, D]`` -> out ``[S, N, D]``, lse ``[S, N, 1]`` (float32)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("snd,lnd->nsl", q.float(), k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [N, S]
    probs = torch.nan_to_num(torch.exp(scores - lse.unsqueeze(-1)))
    out = torch.einsum("nsl,lnd->snd", probs, v)
    return out, lse.transpose(0, 1).unsqueeze(-1)


# ---------------------------------------------------------------- single-token BNSD, int8 pages

ANTIQUANT_KV_DTYPES = (torch.int8,)  # documented int8 / int4 (int32); int8 modeled
ANTIQUANT_ARGUMENTS = (
    "antiquant_scale",
    "antiquant_offset",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
)
ANTIQUANT_MODES = range(6)  # key/value_antiquant_mode with one query token


def _check_no_antiquant(a: dict[str, Any]) -> None:
    given = [name for name in ANTIQUANT_ARGUMENTS if a[name] is not None]
    _expect(
        not given,
        f"antiquant scales dequantize int8 keys and values; got {a['key'].dtype} keys with {given}",
    )


def _fia_bnsd_check(a: dict[str, Any]) -> None:
    """Single-token BNSD over paged caches, float or int8 (see the module doc)."""
    query, key, value = a["query"], a["key"], a["value"]
    _expect(
        query.dtype in FIA_DTYPES, f"query dtype must be one of {FIA_DTYPES}, got {query.dtype}"
    )
    _expect(query.dim() == 4, f"BNSD query must be [B, N, S, D], got {tuple(query.shape)}")
    if query.shape[2] != 1:
        raise NotModeled("BNSD with more than one query token")
    for name in ("query", "key", "value"):
        _expect(a[name].is_contiguous(), f"{name} must be contiguous")
    _expect(key.dtype == value.dtype, f"key {key.dtype} and value {value.dtype} dtypes differ")
    _expect(
        key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    )
    batch, num_heads, _, head_size = query.shape
    num_kv_heads = a["num_key_value_heads"] or a["num_heads"]
    _expect(a["num_heads"] == num_heads, f"num_heads={a['num_heads']} but query has {num_heads}")
    _expect(
        num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64,
        f"num_heads={num_heads} is not a multiple (<= 64x) of num_key_value_heads={num_kv_heads}",
    )
    if a["atten_mask"] is not None or a["block_table"] is None:
        raise NotModeled("single-token BNSD with a mask or without block_table")
    table, block_size = a["block_table"], a["block_size"]
    _expect(
        table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == batch,
        f"block_table must be int32 [B={batch}, max_blocks], got {table.dtype} "
        f"{tuple(table.shape)}",
    )
    alignment = 32 if key.dtype in ANTIQUANT_KV_DTYPES else 16
    _expect(
        block_size > 0 and block_size % alignment == 0,
        f"block_size must be a multiple of {alignment} for {key.dtype} keys, got {block_size}",
    )
    _expect(
        key.dim() == 3 and key.shape[1:] == (block_size, num_kv_heads * head_size),
        f"paged key (blocknum, blocksize, H) must be (*, {block_size}, "
        f"{num_kv_heads * head_size}), got {tuple(key.shape)}",
    )
    kv_lens = a["actual_seq_lengths_kv"]
    capacity = table.shape[1] * block_size
    _expect(
        kv_lens is not None and len(kv_lens) == batch and all(0 <= n <= capacity for n in kv_lens),
        f"actual_seq_lengths_kv must hold {batch} per-request lengths <= {capacity}, got "
        f"{None if kv_lens is None else list(kv_lens)}",
    )
    if key.dtype in FIA_DTYPES:
        _expect(key.dtype == query.dtype, "query and key dtypes differ")
        _check_no_antiquant(a)
        return
    _expect(
        key.dtype in ANTIQUANT_KV_DTYPES,
        f"keys must be float16/bfloat16/int8, got {key.dtype}",
    )
    _check_antiquant(a, num_kv_heads, head_size, block_size, key.shape[0])


def _check_antiquant(
    a: dict[str, Any], num_kv_heads: int, head_size: int, block_size: int, num_blocks: int
) -> None:
    """Documented pairings of antiquant modes with scale shapes and dtypes (one query token)."""
    k_scale, v_scale = a["key_antiquant_scale"], a["value_antiquant_scale"]
    _expect(
        a["antiquant_scale"] is None and a["antiquant_offset"] is None,
        "the combined antiquant_scale / antiquant_offset are not modeled with separate K/V scales",
    )
    _expect(
        k_scale is not None and v_scale is not None,
        "int8 keys and values need key_antiquant_scale and value_antiquant_scale (both), got "
        f"key_antiquant_scale={_shape_of(k_scale)}, value_antiquant_scale={_shape_of(v_scale)}",
    )
    if a["key_antiquant_offset"] is not None or a["value_antiquant_offset"] is not None:
        raise NotModeled("asymmetric antiquant (offsets)")
    k_mode, v_mode = a["key_antiquant_mode"], a["value_antiquant_mode"]
    _expect(
        k_mode in ANTIQUANT_MODES and v_mode in ANTIQUANT_MODES,
        f"key/value_antiquant_mode must be in 0..5 with one query token, got {k_mode}/{v_mode}",
    )
    _expect(
        k_mode == v_mode or (k_mode, v_mode) == (0, 1),
        f"key_antiquant_mode and value_antiquant_mode must be equal (or 0 and 1), got "
        f"{k_mode} and {v_mode}",
    )
    query_dtype = a["query"].dtype
    for name, scale, mode in (("key", k_scale, k_mode), ("value", v_scale, v_mode)):
        shapes, dtype = _antiquant_layout(mode, a, num_kv_heads, head_size, block_size, num_blocks)
        _expect(
            tuple(scale.shape) in shapes and scale.dtype == (dtype or query_dtype),
            f"{name}_antiquant_scale of antiquant mode {mode} must be "
            f"{' or '.join(str(s) for s in shapes)} {dtype or query_dtype}, got "
            f"{tuple(scale.shape)} {scale.dtype}",
        )
        _expect(scale.is_contiguous(), f"{name}_antiquant_scale must be contiguous")


def _antiquant_layout(
    mode: int, a: dict[str, Any], num_kv_heads: int, head_size: int, block_size: int,
    num_blocks: int,
) -> tuple[tuple[tuple[int, ...], ...], torch.dtype | None]:  # fmt: skip
    """The scale shapes a mode documents and their dtype (None: the query's)."""
    batch = a["query"].shape[0]
    hidden = num_kv_heads * head_size
    if mode == 0:
        return (
            (1,),
            (1, num_kv_heads, 1, head_size),
            (1, num_kv_heads, head_size),
            (1, hidden),
        ), None
    if mode == 1:
        return tuple((1, batch, s) for s in _kv_extent(a)), torch.float32
    if mode == 2:
        return ((num_kv_heads,),), None
    if mode == 3:
        return tuple((batch, num_kv_heads, s) for s in _kv_extent(a)), torch.float32
    if mode == 4:
        return ((num_blocks, block_size),), torch.float32
    return ((num_blocks, num_kv_heads, block_size),), torch.float32


def _kv_extent(a: dict[str, Any]) -> tuple[int, ...]:
    """Possible S of per-token scales: at least the longest KV length (not pinned down)."""
    longest = max(a["actual_seq_lengths_kv"], default=0)
    return tuple(range(longest, a["block_table"].shape[1] * a["block_size"] + 1))


def _dequantized(
    codes: torch.Tensor, scale: torch.Tensor, mode: int, num_kv_heads: int
) -> torch.Tensor:
    """``(blocknum, blocksize, H)`` codes as float32 ``[blocks, block_size, KV_N, D]``."""
    pages = codes.float().reshape(codes.shape[0], codes.shape[1], num_kv_heads, -1)
    scale = scale.float()
    if mode == 0:
        factor = scale.reshape(-1) if scale.numel() == 1 else scale.reshape(num_kv_heads, -1)
    elif mode == 2:
        factor = scale.reshape(num_kv_heads, 1)
    elif mode == 4:
        factor = scale.reshape(*scale.shape, 1, 1)
    elif mode == 5:
        factor = scale.transpose(1, 2).unsqueeze(-1)
    else:
        raise NotModeled(f"antiquant mode {mode}")
    return pages * factor


def _fia_bnsd_compute(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    query = a["query"]
    batch, num_heads, _, _ = query.shape
    num_kv_heads = a["num_key_value_heads"] or a["num_heads"]
    key, value = a["key"], a["value"]
    if key.dtype in ANTIQUANT_KV_DTYPES:
        key = _dequantized(key, a["key_antiquant_scale"], a["key_antiquant_mode"], num_kv_heads)
        value = _dequantized(
            value, a["value_antiquant_scale"], a["value_antiquant_mode"], num_kv_heads
        )
    else:
        key, value = _paged_tokens(key, num_kv_heads), _paged_tokens(value, num_kv_heads)
    out = torch.zeros(batch, num_heads, 1, query.shape[3], dtype=torch.float32)
    lse = torch.full((batch, num_heads, 1, 1), float("inf"), dtype=torch.float32)
    block_size = a["block_size"]
    for b in range(batch):
        kv_len = a["actual_seq_lengths_kv"][b]
        blocks = a["block_table"][b, : math.ceil(kv_len / block_size)].long()
        _expect(
            bool((blocks >= 0).all()) and bool((blocks < key.shape[0]).all()),
            f"block_table row {b} holds block ids outside [0, {key.shape[0]})",
        )
        k = key[blocks].reshape(-1, num_kv_heads, key.shape[-1])[:kv_len]
        v = value[blocks].reshape(-1, num_kv_heads, value.shape[-1])[:kv_len]
        visible = torch.ones(1, kv_len, dtype=torch.bool)
        rows, row_lse = _softmax_attention(query[b].transpose(0, 1), k, v, visible, a["scale"])
        out[b], lse[b] = rows.transpose(0, 1), row_lse.transpose(0, 1)
    return out.to(query.dtype), lse


def _shape_of(tensor: Any) -> str:
    return "None" if tensor is None else str(tuple(tensor.shape))


def _fia(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fia_compute(a)
    return out, lse if a["softmax_lse_flag"] else torch.zeros(1, dtype=torch.float32)


def _fia_out(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fia(a)
    attention_out, softmax_lse = a["out"]
    _expect(
        attention_out.shape == out.shape and attention_out.dtype == out.dtype,
        f"attention_out must be {tuple(out.shape)} {out.dtype}, got "
        f"{tuple(attention_out.shape)} {attention_out.dtype}",
    )
    _expect(
        softmax_lse.shape == lse.shape,
        f"softmax_lse must be {tuple(lse.shape)} "
        f"(softmax_lse_flag={a['softmax_lse_flag']}), got {tuple(softmax_lse.shape)}",
    )
    attention_out.copy_(out)
    softmax_lse.copy_(lse)
    return attention_out, softmax_lse


def _fia_workspace(a: dict[str, Any]) -> torch.Tensor:
    _fia_check(a)
    return torch.empty(1, dtype=torch.uint8)


# ---------------------------------------------------------------- fused infer attention v2 (MLA)

MLA_QUERY_HEADS = (32, 64, 128)  # query N with query_rope and a query D of 512
MLA_BLOCK_SIZES = (16, 128)  # page attention with query_rope, ND caches
MLA_MAX_QUERY_TOKENS = 16  # query S per request with query_rope


def _fia_v2_check(a: dict[str, Any]) -> None:
    """The documented constraints of the two MLA uses of the v2 op (see module doc)."""
    _expect(
        a["input_layout"] in FIA_LAYOUTS,
        f"input_layout {a['input_layout']!r} is not one of the documented layouts {FIA_LAYOUTS}",
    )
    _expect(
        a["sparse_mode"] in FIA_SPARSE_MODES,
        f"sparse_mode={a['sparse_mode']} is not documented (supported: {FIA_SPARSE_MODES})",
    )
    _expect(
        (a["query_rope"] is None) == (a["key_rope"] is None),
        "query_rope and key_rope must be given together",
    )
    if a["query_rope"] is None or a["input_layout"] != "TND":
        raise NotModeled(f"the v2 op without query_rope, or in {a['input_layout']!r}")
    names = ("query", "key", "value", "query_rope", "key_rope")
    for name in names:
        _expect(a[name].is_contiguous(), f"{name} must be contiguous")
    query = a["query"]
    _expect(
        query.dtype in FIA_DTYPES, f"query dtype must be one of {FIA_DTYPES}, got {query.dtype}"
    )
    _expect(
        all(a[name].dtype == query.dtype for name in names),
        "query, key, value, query_rope and key_rope must share one dtype",
    )
    _expect(query.dim() == 3, f"TND query must be [T, N, D], got {tuple(query.shape)}")
    _expect(
        query.shape[1] == a["num_query_heads"],
        f"num_query_heads={a['num_query_heads']} but query has {query.shape[1]} heads",
    )
    _expect(not a["return_softmax_lse"], "MLA with query_rope does not return the softmax LSE")
    ends = a["actual_seq_qlen"]
    _expect(ends is not None and len(ends) > 0, "TND needs actual_seq_qlen")
    _expect(
        all(e >= 0 for e in ends) and all(x <= y for x, y in itertools.pairwise(ends)),
        f"TND actual_seq_qlen are cumulative (non-decreasing), got {list(ends)}",
    )
    _expect(
        ends[-1] == query.shape[0],
        f"TND actual_seq_qlen[-1] must equal T={query.shape[0]}, got {ends[-1]}",
    )
    _expect(
        a["query_rope"].shape == (*query.shape[:2], 64),
        f"query_rope must be {(*query.shape[:2], 64)} (rope D 64), got {tuple(a['query_rope'].shape)}",
    )
    if query.shape[2] == 512:
        _check_mla_paged(a)
    elif query.shape[2] == 128:
        _check_mla_unpaged(a)
    else:
        raise SchemaViolation(
            f"with query_rope the query D must be 512 or 128, got {query.shape[2]}"
        )


def _check_mla_sparse(a: dict[str, Any], several_tokens: bool) -> None:
    """Paged (query D 512): one token per request takes sparse_mode 0 without a mask,
    more take 3 with the mask; non-paged TND: 0 without a mask or 3 with it."""
    if a["block_table"] is None:
        _expect(a["sparse_mode"] in (0, 3), "TND MLA takes sparse_mode 0 or 3")
    elif several_tokens:
        _expect(
            a["sparse_mode"] == 3,
            "MLA with several query tokens per request takes sparse_mode=3 with the mask, "
            f"got sparse_mode={a['sparse_mode']}",
        )
    else:
        _expect(
            a["sparse_mode"] == 0 and a["atten_mask"] is None,
            "MLA with one query token per request takes sparse_mode=0 without a mask, got "
            f"sparse_mode={a['sparse_mode']}",
        )
    if a["sparse_mode"] == 3:
        _check_compressed_mask(a["atten_mask"], 3)
    else:
        _expect(a["atten_mask"] is None, "sparse_mode=0 with a mask is not modeled")


def _check_mla_paged(a: dict[str, Any]) -> None:
    query, key, value, key_rope, table = (
        a["query"],
        a["key"],
        a["value"],
        a["key_rope"],
        a["block_table"],
    )
    _expect(table is not None, "with a query D of 512 page attention is required (block_table)")
    _expect(
        query.shape[1] in MLA_QUERY_HEADS,
        f"with a query D of 512 the query N must be one of {MLA_QUERY_HEADS}, got {query.shape[1]}",
    )
    _expect(a["num_key_value_heads"] == 1, "with a query D of 512 the key N must be 1")
    _expect(
        key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    )
    _expect(
        a["block_size"] in MLA_BLOCK_SIZES,
        f"MLA page attention takes block_size in {MLA_BLOCK_SIZES}, got {a['block_size']}",
    )
    _expect(
        key.dim() == 3 and key.shape[1:] == (a["block_size"], 512),
        f"paged key must be (blocknum, {a['block_size']}, 512), got {tuple(key.shape)}",
    )
    _expect(
        key_rope.shape == (*key.shape[:2], 64),
        f"key_rope must be {(*key.shape[:2], 64)}, got {tuple(key_rope.shape)}",
    )
    ends = list(a["actual_seq_qlen"])
    lengths = [e - s for s, e in zip([0, *ends[:-1]], ends)]
    _expect(
        all(1 <= n <= MLA_MAX_QUERY_TOKENS for n in lengths),
        f"MLA takes 1 to {MLA_MAX_QUERY_TOKENS} query tokens per request, got {lengths}",
    )
    _check_mla_sparse(a, max(lengths) > 1)
    _expect(
        table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == len(ends),
        f"block_table must be int32 [{len(ends)}, max_blocks], got {table.dtype} {tuple(table.shape)}",
    )
    kv_lens = a["actual_seq_kvlen"]
    capacity = table.shape[1] * a["block_size"]
    _expect(
        kv_lens is not None
        and len(kv_lens) == len(ends)
        and all(0 <= n <= capacity for n in kv_lens),
        f"paged actual_seq_kvlen are per-request lengths <= {capacity} ({len(ends)} of them), "
        f"got {kv_lens}",
    )


def _check_mla_unpaged(a: dict[str, Any]) -> None:
    query, key, value, key_rope = a["query"], a["key"], a["value"], a["key_rope"]
    _expect(a["block_table"] is None, "with a query D of 128 page attention is not supported")
    _expect(query.dtype == torch.bfloat16, f"TND without paging takes bfloat16, got {query.dtype}")
    _expect(
        key.dim() == value.dim() == 3 and key.shape[2] == value.shape[2] == 128,
        f"with query_rope the Q, K and V D must be 128, got key {tuple(key.shape)}, "
        f"value {tuple(value.shape)}",
    )
    kv_heads = a["num_key_value_heads"] or a["num_query_heads"]
    _expect(
        key.shape[1] == value.shape[1] == kv_heads and a["num_query_heads"] % kv_heads == 0,
        f"key/value N must be num_key_value_heads={kv_heads} dividing num_query_heads",
    )
    _expect(
        key_rope.shape == (*key.shape[:2], 64),
        f"key_rope must be {(*key.shape[:2], 64)}, got {tuple(key_rope.shape)}",
    )
    q_ends, kv_ends = list(a["actual_seq_qlen"]), a["actual_seq_kvlen"]
    _expect(
        kv_ends is not None and len(kv_ends) == len(q_ends) and len(q_ends) <= 4096,
        "TND needs actual_seq_kvlen with as many (<= 4096) entries as actual_seq_qlen",
    )
    _expect(
        all(x <= y for x, y in zip([0, *kv_ends], kv_ends)) and kv_ends[-1] == key.shape[0],
        f"TND actual_seq_kvlen are cumulative ends reaching {key.shape[0]}, got {list(kv_ends)}",
    )
    _check_mla_sparse(a, True)


def _fia_v2_compute(a: dict[str, Any]) -> torch.Tensor:
    _fia_v2_check(a)
    query, query_rope = a["query"], a["query_rope"]
    q = torch.cat([query, query_rope], -1)
    out = torch.zeros(*query.shape[:2], a["value"].shape[-1], dtype=torch.float32)
    q_ends = list(a["actual_seq_qlen"])
    paged = a["block_table"] is not None
    key, value = torch.cat([a["key"], a["key_rope"]], -1), a["value"]
    if paged:  # (blocknum, blocksize, H) with one KV head: rows of one token each
        key, value = key.unsqueeze(2), value.unsqueeze(2)
    kv_ends = list(a["actual_seq_kvlen"])
    for b, (start, end) in enumerate(zip([0, *q_ends[:-1]], q_ends)):
        if paged:
            kv_len = kv_ends[b]
            blocks = a["block_table"][b, : math.ceil(kv_len / a["block_size"])].long()
            _expect(
                bool((blocks >= 0).all()) and bool((blocks < key.shape[0]).all()),
                f"block_table row {b} holds block ids outside [0, {key.shape[0]})",
            )
            k = key[blocks].reshape(-1, 1, key.shape[-1])[:kv_len]
            v = value[blocks].reshape(-1, 1, value.shape[-1])[:kv_len]
        else:
            kv_start = kv_ends[b - 1] if b else 0
            kv_len = kv_ends[b] - kv_start
            k, v = key[kv_start : kv_start + kv_len], value[kv_start : kv_start + kv_len]
        visible = visible_keys(end - start, kv_len, a["sparse_mode"], MAX_TOKENS, 0)
        if kv_len:
            out[start:end], _ = _softmax_attention(q[start:end], k, v, visible, a["softmax_scale"])
    return out.to(query.dtype)


def _fia_v2(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return _fia_v2_compute(a), torch.zeros(1, dtype=torch.float32)


def _fia_v2_out(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fia_v2(a)
    attention_out, softmax_lse = a["out"]
    _expect(
        attention_out.shape == out.shape and attention_out.dtype == out.dtype,
        f"attention_out must be {tuple(out.shape)} {out.dtype}, got "
        f"{tuple(attention_out.shape)} {attention_out.dtype}",
    )
    _expect(softmax_lse.shape == lse.shape, f"softmax_lse must be {tuple(lse.shape)} (no LSE)")
    attention_out.copy_(out)
    return attention_out, softmax_lse


def _fia_v2_workspace(a: dict[str, Any]) -> torch.Tensor:
    _fia_v2_check(a)
    return torch.empty(1, dtype=torch.uint8)


# ---------------------------------------------------------------- ATB MultiLatentAttention

ATB_MLA_HEADS = (8, 16, 32, 64, 128)  # headNum
ATB_MLA_MAX_BLOCK_SIZE = 128
ATB_MLA_MAX_BATCH = 8192
ATB_MLA_CACHE_MODES = (None, "krope_ctkv")  # op-plugin's default; int8/NZ caches not modeled


def _atb_mla_check(a: dict[str, Any]) -> None:
    """The documented constraints of the paged decode with LSE (see the module doc)."""
    _expect(
        a["return_lse"] is True and a["calc_type"] == "calc_type_ring",
        "the LSE of npu_multi_head_latent_attention needs return_lse=True with "
        f"calc_type='calc_type_ring', got return_lse={a['return_lse']!r}, "
        f"calc_type={a['calc_type']!r}",
    )
    _expect(
        a["mask"] is None and a["mask_type"] in (None, "undefined"),
        "calc_type_ring takes no mask (mask_type 'undefined')",
    )
    _expect(a["qseqlen"] is None, "qseqlen belongs to calc_type_spec (several query tokens)")
    if a["cache_mode"] not in ATB_MLA_CACHE_MODES or a["qk_descale"] is not None:
        raise NotModeled(f"npu_multi_head_latent_attention with cache_mode={a['cache_mode']!r}")
    q, q_rope, ctkv, k_rope, table = (
        a["q_nope"], a["q_rope"], a["ctkv"], a["k_rope"], a["block_tables"]
    )  # fmt: skip
    for name in ("q_nope", "q_rope", "ctkv", "k_rope", "block_tables"):
        _expect(a[name].is_contiguous(), f"{name} must be contiguous")
    _expect(q.dtype in FIA_DTYPES, f"q_nope dtype must be one of {FIA_DTYPES}, got {q.dtype}")
    _expect(
        q_rope.dtype == ctkv.dtype == k_rope.dtype == q.dtype,
        "q_nope, q_rope, ctkv and k_rope must share one dtype",
    )
    heads = a["head_num"]
    _expect(heads in ATB_MLA_HEADS, f"head_num must be one of {ATB_MLA_HEADS}, got {heads}")
    _expect(
        q.dim() == 3 and q.shape[1:] == (heads, 512),
        f"q_nope must be [num_tokens, {heads}, 512], got {tuple(q.shape)}",
    )
    _expect(
        q_rope.shape == (*q.shape[:2], 64),
        f"q_rope must be {(*q.shape[:2], 64)}, got {tuple(q_rope.shape)}",
    )
    _expect(a["kv_headnum"] == 1, f"kv_headnum must be 1, got {a['kv_headnum']}")
    _expect(0 < a["qk_scale"] <= 1, f"qk_scale must lie in (0, 1], got {a['qk_scale']}")
    _expect(
        ctkv.dim() == 4 and ctkv.shape[2:] == (1, 512),
        f"ctkv must be [num_blocks, block_size, 1, 512], got {tuple(ctkv.shape)}",
    )
    block_size = ctkv.shape[1]
    _expect(
        block_size <= ATB_MLA_MAX_BLOCK_SIZE,
        f"block_size must be <= {ATB_MLA_MAX_BLOCK_SIZE}, got {block_size}",
    )
    _expect(
        k_rope.shape == (*ctkv.shape[:3], 64),
        f"k_rope must be {(*ctkv.shape[:3], 64)}, got {tuple(k_rope.shape)}",
    )
    lengths = list(a["context_lens"])
    batch = len(lengths)
    _expect(
        batch == q.shape[0],
        f"one query token per request: context_lens has {batch} entries for {q.shape[0]} tokens",
    )
    _expect(batch <= ATB_MLA_MAX_BATCH, f"batch must be <= {ATB_MLA_MAX_BATCH}, got {batch}")
    _expect(
        table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == batch,
        f"block_tables must be int32 [{batch}, max_blocks], got {table.dtype} {tuple(table.shape)}",
    )
    capacity = table.shape[1] * block_size
    _expect(
        all(0 <= n <= capacity for n in lengths),
        f"context_lens are per-request KV lengths <= {capacity}, got {lengths}",
    )


def _atb_mla_lse_out(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    _atb_mla_check(a)
    q, output, lse = a["q_nope"], a["output"], a["lse"]
    _expect(
        output.shape == q.shape and output.dtype == q.dtype and output.is_contiguous(),
        f"output must be a contiguous {tuple(q.shape)} {q.dtype}, got "
        f"{tuple(output.shape)} {output.dtype}",
    )
    lse_shape = (*q.shape[:2], 1)
    _expect(
        lse.shape == lse_shape and lse.dtype == q.dtype and lse.is_contiguous(),
        f"lse must be a contiguous {lse_shape} {q.dtype}, got {tuple(lse.shape)} {lse.dtype}",
    )
    _expect(
        a["workspace"] is None or isinstance(a["workspace"], torch.Tensor),
        "workspace must be a tensor from _npu_multi_head_latent_attention_get_workspace",
    )
    ctkv, k_rope, table = a["ctkv"], a["k_rope"], a["block_tables"]
    block_size = ctkv.shape[1]
    keys = torch.cat([ctkv, k_rope], -1)  # [blocks, block_size, 1, 576]
    query = torch.cat([q, a["q_rope"]], -1)
    for b, kv_len in enumerate(a["context_lens"]):
        if kv_len == 0:  # undocumented: the caller must not read these rows
            output[b], lse[b] = float("nan"), float("nan")
            continue
        blocks = table[b, : math.ceil(kv_len / block_size)].long()
        _expect(
            bool((blocks >= 0).all()) and bool((blocks < ctkv.shape[0]).all()),
            f"block_tables row {b} holds block ids outside [0, {ctkv.shape[0]})",
        )
        k = keys[blocks].reshape(-1, 1, keys.shape[-1])[:kv_len]
        visible = torch.ones(1, kv_len, dtype=torch.bool)
        rows, row_lse = _softmax_attention(
            query[b : b + 1], k, k[..., :512], visible, a["qk_scale"]
        )
        output[b], lse[b] = rows[0], row_lse[0]
    return output, lse


def _atb_mla_workspace(a: dict[str, Any]) -> torch.Tensor:
    _atb_mla_check(a)
    return torch.empty(1, dtype=torch.uint8)


# ---------------------------------------------------------------- KV cache write


def _scatter_pa_kv_cache(a: dict[str, Any]) -> None:
    mode = a["cache_mode"]
    _expect(
        mode in SCATTER_CACHE_MODES,
        f"cache_mode={mode!r} is not documented ({SCATTER_CACHE_MODES})",
    )
    key, value, key_cache, value_cache, slots = (
        a["key"],
        a["value"],
        a["key_cache"],
        a["value_cache"],
        a["slot_mapping"],
    )
    for name in ("key", "value", "key_cache", "value_cache", "slot_mapping"):
        _expect(a[name].is_contiguous(), f"{name} must be contiguous")
    _expect(
        key.dtype == value.dtype == key_cache.dtype == value_cache.dtype,
        "key, value and the caches must share one dtype",
    )
    _expect(
        slots.dtype in (torch.int32, torch.int64),
        f"slot_mapping must be int32/int64, got {slots.dtype}",
    )
    if mode == "PA_NZ" and key.dim() == 3:
        hidden = key.shape[1] * key.shape[2]
        _expect(
            key_cache.dim() == 4 and key_cache.shape[1] * key_cache.shape[3] == hidden,
            f"PA_NZ key_cache must be [num_blocks, N*D/last, block_size, last] with "
            f"N*D={hidden}, got {tuple(key_cache.shape)} (ND caches need cache_mode='Norm')",
        )
    if mode != "Norm" or key.dim() != 3:
        raise NotModeled(f"npu_scatter_pa_kv_cache with cache_mode={mode!r}, key {key.dim()}-D")
    _expect(
        key_cache.dim() == 4 and key_cache.shape[2:] == key.shape[1:],
        f"Norm key_cache must be [num_blocks, block_size, {key.shape[1]}, {key.shape[2]}], "
        f"got {tuple(key_cache.shape)}",
    )
    _expect(
        value_cache.shape[:3] == key_cache.shape[:3] and value_cache.shape[3] == value.shape[2],
        f"value_cache {tuple(value_cache.shape)} does not fit value {tuple(value.shape)}",
    )
    _expect(
        slots.dim() == 1 and slots.shape[0] == key.shape[0],
        f"slot_mapping must be [{key.shape[0]}], got {tuple(slots.shape)}",
    )
    capacity = key_cache.shape[0] * key_cache.shape[1]
    _expect(
        bool(((slots >= 0) & (slots < capacity)).all()),
        f"slot_mapping values must lie in [0, {capacity}), got {slots.tolist()}",
    )
    _expect(slots.unique().numel() == slots.numel(), "slot_mapping values must be unique")
    key_cache.view(capacity, *key_cache.shape[2:])[slots.long()] = key
    value_cache.view(capacity, *value_cache.shape[2:])[slots.long()] = value


# ---------------------------------------------------------------- fusion attention (no cache)


def _fusion_attention(a: dict[str, Any]) -> tuple[Any, ...]:
    layout, sparse_mode = a["input_layout"], a["sparse_mode"]
    _expect(
        layout in FUSION_LAYOUTS, f"input_layout {layout!r} is not documented ({FUSION_LAYOUTS})"
    )
    _expect(sparse_mode in range(9), f"sparse_mode={sparse_mode} is not documented (0..8)")
    if layout != "TND" or sparse_mode not in (0, 2, 3, 4):
        raise NotModeled(f"npu_fusion_attention with {layout}, sparse_mode={sparse_mode}")
    query, key, value = a["query"], a["key"], a["value"]
    _expect(query.dim() == key.dim() == value.dim() == 3, "TND tensors are [T, N, D]")
    _expect(
        query.shape[1] == a["head_num"],
        f"head_num={a['head_num']} but query has {query.shape[1]} heads",
    )
    _expect(a["keep_prob"] == 1.0, "inference needs keep_prob=1.0")
    q_ends, kv_ends = a["actual_seq_qlen"], a["actual_seq_kvlen"]
    _expect(
        q_ends is not None and kv_ends is not None and len(q_ends) == len(kv_ends),
        "TND needs actual_seq_qlen and actual_seq_kvlen of one length",
    )
    for ends, total, name in ((q_ends, query.shape[0], "qlen"), (kv_ends, key.shape[0], "kvlen")):
        _expect(
            all(x <= y for x, y in zip([0, *ends], ends)) and ends[-1] == total,
            f"actual_seq_{name} are cumulative ends reaching {total}, got {list(ends)}",
        )
    if sparse_mode in (2, 3, 4):
        _check_compressed_mask(a["atten_mask"], sparse_mode)
    else:
        _expect(a["atten_mask"] is None, "sparse_mode=0 with a mask is not modeled")
    out = torch.zeros(query.shape, dtype=torch.float32)
    softmax_max = torch.zeros(query.shape[0], query.shape[1], 8, dtype=torch.float32)
    for (qs, qe), (ks, ke) in zip(zip([0, *q_ends], q_ends), zip([0, *kv_ends], kv_ends)):
        visible = visible_keys(qe - qs, ke - ks, sparse_mode, a["pre_tockens"], a["next_tockens"])
        out[qs:qe], lse = _softmax_attention(
            query[qs:qe], key[ks:ke], value[ks:ke], visible, a["scale"]
        )
        softmax_max[qs:qe] = lse
    # The documented pair satisfies LSE = softmax_max + log(softmax_sum); the stand-in
    # answers max = LSE and sum = 1 (how the op splits the two is not modeled).
    empty = torch.empty(0)
    return out.to(query.dtype), softmax_max, torch.ones_like(softmax_max), empty, 0, 0, 0


IMPLEMENTATIONS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "npu_fused_infer_attention_score": _fia,
    "npu_fused_infer_attention_score.out": _fia_out,
    "_npu_fused_infer_attention_score_get_max_workspace": _fia_workspace,
    "npu_fused_infer_attention_score_v2": _fia_v2,
    "npu_fused_infer_attention_score_v2.out": _fia_v2_out,
    "_npu_fused_infer_attention_score_v2_get_max_workspace": _fia_v2_workspace,
    "npu_scatter_pa_kv_cache": _scatter_pa_kv_cache,
    "npu_fusion_attention": _fusion_attention,
    "atb.npu_multi_head_latent_attention.lse_out": _atb_mla_lse_out,
    "atb._npu_multi_head_latent_attention_get_workspace.lse": _atb_mla_workspace,
}


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise SchemaViolation(message)
