"""The torch_npu / torch.npu calls a source file makes, read with ``ast``.

``calls_through`` lists the dotted names called through a root (``torch.npu``,
``torch_npu``, or a variable assigned from ``torch_npu_module()``), so the tests
can assert that the conformance runs exercised every call site. ``check_source``
checks each call site statically against torch_npu's API (names, keywords,
positional arity), which also covers code that cannot run here.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

from torch_npu_schemas import TorchNpuApi

TORCH_NPU_ROOTS = {"torch_npu"}
NPU_NAMESPACE_ROOTS = {"torch.npu", "torch_npu.npu"}
TORCH_NPU_FACTORIES = {"torch_npu_module"}
# torch_npu/npu/<module>.py files read by torch_npu_schemas (their functions are known)
PARSED_SUBMODULES = {"graphs", "streams", "utils", "memory", "npu_config"}


@dataclass(frozen=True)
class CallSite:
    root: str  # "torch_npu" or "torch.npu"
    name: str  # dotted name after the root, e.g. "npu_fused_infer_attention_score.out"
    node: ast.Call
    line: int


def calls_through(path: Path, roots: set[str], root_factories: set[str]) -> set[str]:
    """Dotted names called through a root: ``root.a.b(...)`` gives ``"a.b"``."""
    tree = ast.parse(path.read_text())
    return {site.name for site in _sites(tree, {r: r for r in roots}, root_factories, "root")}


def find_call_sites(source: str) -> list[CallSite]:
    """Call sites of ``torch_npu.*`` and ``torch.npu.*`` (aliases followed) in ``source``."""
    tree = ast.parse(source)
    roots = {name: "torch_npu" for name in TORCH_NPU_ROOTS}
    roots.update({name: "torch.npu" for name in NPU_NAMESPACE_ROOTS})
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch_npu" and alias.asname:
                    roots[alias.asname] = "torch_npu"
    return sorted(_sites(tree, roots, TORCH_NPU_FACTORIES, None), key=lambda site: site.line)


def _sites(tree: ast.AST, roots: dict[str, str], factories: set[str], label: str | None):
    aliases = dict(roots)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _root_of(node.value, aliases, factories):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    aliases[target.id] = _root_of(node.value, aliases, factories)
    sites = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            parts, base = [], node.func
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
                root = _root_of(base, aliases, factories)
                if root:
                    name = ".".join(reversed(parts))
                    sites.append(CallSite(label or root, name, node, node.lineno))
                    break
    return sites


def _root_of(node: ast.expr, aliases: dict[str, str], factories: set[str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return aliases.get(f"{node.value.id}.{node.attr}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in factories:
        return "torch_npu"
    return None


def check_source(source: str, api: TorchNpuApi, atb_ops: frozenset[str]) -> list[str]:
    """Problems of every torch_npu / torch.npu call site in ``source`` (empty: all fit).

    Operators are bound against their schemas, ``torch.npu`` functions and class
    constructors against torch_npu's Python signatures. ATB operators (registered
    from a shared library, no schema in the wheel's yaml) are bound against their
    header declarations and registered schemas (one of the overloads must take the
    call), or checked by name where the header does not declare them.
    Method calls on returned objects cannot be resolved statically and are skipped.
    """
    problems = []
    for site in find_call_sites(source):
        if site.root == "torch_npu" and site.name.startswith("npu."):
            site = CallSite("torch.npu", site.name[len("npu.") :], site.node, site.line)
        overloads = api.atb_overloads.get(site.name) if site.root == "torch_npu" else None
        if overloads:
            problem = _bind_atb(overloads, site.node)
            if problem:
                problems.append(f"line {site.line}: torch_npu.{site.name}: {problem}")
            continue
        signature, problem = _resolve(site, api, atb_ops)
        if problem:
            problems.append(f"line {site.line}: {problem}")
        elif signature is not None:
            problem = _bind(signature, site.node)
            if problem:
                problems.append(f"line {site.line}: {site.root}.{site.name}: {problem}")
    return problems


def _resolve(site: CallSite, api: TorchNpuApi, atb_ops: frozenset[str]):
    if site.root == "torch_npu":
        schema = api.operators.get(site.name)
        if schema is not None:
            return schema.signature, None
        if site.name in atb_ops:
            return None, None
        return None, f"torch_npu {api.version} has no operator {site.name!r}"
    head, _, rest = site.name.partition(".")
    if head in PARSED_SUBMODULES and rest and "." not in rest:  # torch.npu.utils.f(...)
        head, rest = rest, ""
        if head not in api.python.functions and head not in api.python.classes:
            return None, f"torch.npu.{site.name} is not in torch_npu {api.version}"
    elif head not in api.python.exported:
        return None, f"torch.npu has no {head!r} in torch_npu {api.version}"
    if not rest:
        if head in api.python.functions:
            return api.python.functions[head], None
        return api.python.classes.get(head, {}).get("__call__"), None
    methods = api.python.classes.get(head)
    if methods is not None and rest not in methods:
        return None, f"torch.npu.{head} has no attribute {rest!r}"
    return None, None  # a static method call or attribute chain: existence checked only


def _bind_atb(overloads, call: ast.Call) -> str | None:
    """None if one overload takes the call (its declaration and registered schema)."""
    errors = []
    for overload in overloads:
        schemas = [overload.declared, overload.registered]
        found = [_bind(s.signature, call) for s in schemas if s is not None]
        if not any(found):
            return None
        errors.append(f"{overload.name}: {'; '.join(e for e in found if e)}")
    return "no overload takes this call: " + " | ".join(errors)


def _bind(signature: inspect.Signature, call: ast.Call) -> str | None:
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    double_starred = any(k.arg is None for k in call.keywords)
    args = [] if starred else [object()] * len(call.args)
    kwargs = {k.arg: object() for k in call.keywords if k.arg is not None}
    try:
        if starred or double_starred:
            signature.bind_partial(*args, **kwargs)
        else:
            signature.bind(*args, **kwargs)
    except TypeError as error:
        return str(error)
    return None
