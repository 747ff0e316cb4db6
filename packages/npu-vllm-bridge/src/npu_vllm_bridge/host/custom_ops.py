"""Host graphs run the custom ops that eager steps run.

vLLM turns its custom ops (on a CPU: its C++ rotary embedding, and on Arm its GELU
kernels) off when inductor compiles the model and on otherwise: ``VllmConfig`` appends
``"none"`` to ``compilation_config.custom_ops`` for ``backend == "inductor"`` with
compilation on, else ``"all"``, unless the user chose one. It decides before the
platform's ``check_and_update_config``, where host mode turns inductor off for host graphs
(they record aten ops, not inductor kernels). Left at vLLM's ``"none"``, steps with graphs
on would run vLLM's PyTorch rotary embedding uncompiled while ``enforce_eager`` runs the
C++ kernel: in bfloat16 the two round differently, so even a prefill, which runs eagerly
in FULL_DECODE_ONLY, gave other logits than in an eager engine. Host mode therefore
applies vLLM's rule again to the compile settings its graphs run with; a choice of the
user's stays. The kernels are recorded whole in host graphs (``worker.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

ALL, NONE = "all", "none"
# Compilation configs whose user chose neither "all" nor "none", by id, noted by the
# platform before vLLM appends its default (weak: a config that dies leaves no entry).
_DEFAULTED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def note_user_choice(compilation: Any) -> None:
    """Remember whether ``compilation`` (vLLM's ``CompilationConfig``) names ``"all"`` or
    ``"none"`` in its ``custom_ops``; call it before vLLM appends its default."""
    if not any(op in (ALL, NONE) for op in compilation.custom_ops):
        _DEFAULTED[id(compilation)] = compilation


def take_defaulted(compilation: Any) -> bool:
    """Whether vLLM, not the user, chose ``compilation``'s custom-op default (as noted by
    :func:`note_user_choice`); forgets the note."""
    return _DEFAULTED.pop(id(compilation), None) is compilation


def vllm_default(compilation: Any) -> str:
    """``"none"`` or ``"all"``: vLLM's default for these compile settings (off only where
    inductor compiles the model)."""
    from vllm.config import CompilationMode

    compiles = compilation.mode != CompilationMode.NONE and compilation.backend == "inductor"
    return NONE if compiles else ALL


def redo_vllm_default(compilation: Any) -> str | None:
    """Replace vLLM's default in ``compilation.custom_ops`` by the one its rule gives for
    the compile settings now in force; returns the new default, or ``None`` where it did
    not change. Only for a config whose default vLLM chose (:func:`take_defaulted`)."""
    custom_ops = compilation.custom_ops
    chosen = [op for op in custom_ops if op in (ALL, NONE)]
    if len(chosen) != 1:
        raise ValueError(f"expected one of {ALL!r} or {NONE!r} in custom_ops, got {custom_ops}")
    wanted = vllm_default(compilation)
    if chosen[0] == wanted:
        return None
    custom_ops[custom_ops.index(chosen[0])] = wanted
    return wanted
