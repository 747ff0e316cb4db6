"""Static list of the torch_npu / torch.npu calls a source file makes (read with ``ast``).

Lets the tests assert that the conformance runs exercised every call site, so a
call added later cannot slip past the schema checks unseen.
"""

from __future__ import annotations

import ast
from pathlib import Path


def calls_through(path: Path, roots: set[str], root_factories: set[str]) -> set[str]:
    """Dotted names called through a root: ``root.a.b(...)`` gives ``"a.b"``.

    A root is a name in ``roots`` (``torch.npu`` counts as the name ``torch.npu``),
    a call of a function in ``root_factories`` (``torch_npu_module().x(...)``), or a
    local variable assigned from such a call (``npu = torch_npu_module()``).
    """
    tree = ast.parse(path.read_text())
    aliases = set(roots)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_root(node.value, aliases, root_factories):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            parts, base = [], node.func
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
                if _is_root(base, aliases, root_factories):
                    found.add(".".join(reversed(parts)))
                    break
    return found


def _is_root(node: ast.expr, aliases: set[str], factories: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in aliases
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}" in aliases
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in factories
    )
