"""Every entry of ``vllm_seam`` against the installed vLLM, and the rest of the bridge
against the seam.

Each entry resolves in the installed vLLM and its callables take the parameters listed
(``inspect.signature``; a Triton kernel: ``arg_names``, or the plain function where
vLLM runs without a Triton backend; a compiled op: its schema). An instance attribute
must be assigned or registered in the source of its class's vLLM modules.

:func:`seam_bypasses` scans the bridge's sources outside ``vllm_seam.py``:
``python packages/npu-vllm-bridge/tests/test_vllm_seam.py`` prints what it finds.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from npu_vllm_bridge import vllm_seam
from npu_vllm_bridge.vllm_seam import INTERNALS, Internal
from npu_vllm_bridge.vllm_version import installed_vllm_version

SRC = Path(vllm_seam.__file__).parent
SEAM = Path(vllm_seam.__file__)


def _params(entry: Internal, obj: object) -> tuple[str, ...]:
    if entry.kind == vllm_seam.TRITON_KERNEL:
        # vLLM's triton.jit without a Triton backend returns the function itself.
        names = getattr(obj, "arg_names", None)
        return tuple(names) if names is not None else tuple(inspect.signature(obj).parameters)
    if entry.kind == vllm_seam.COMPILED_OP:
        return tuple(arg.name for arg in obj.default._schema.arguments)
    return tuple(inspect.signature(obj).parameters)


def _assigned_in_sources(owner: type, name: str) -> bool:
    """Whether a vLLM module defining ``owner`` or a base assigns or registers ``name``."""
    pattern = re.compile(rf"\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]|[\"']{re.escape(name)}[\"']")
    modules = {inspect.getmodule(k) for k in owner.__mro__ if k.__module__.startswith("vllm.")}
    return any(pattern.search(inspect.getsource(m)) for m in modules if m is not None)


@pytest.mark.parametrize("entry", INTERNALS, ids=lambda e: f"{e.kind}:{e.path}")
def test_entry_resolves_with_its_parameters(entry: Internal) -> None:
    installed = Version(installed_vllm_version())
    if entry.since is not None and installed.release < Version(entry.since).release:
        owner = importlib.import_module(entry.module)
        assert not hasattr(owner, entry.name), f"{entry.path} exists before {entry.since}"
        return
    if entry.kind == vllm_seam.COMPILED_OP and importlib.util.find_spec(entry.module) is None:
        pytest.skip(f"{entry.module} is not built in this vLLM ({installed})")
    obj = entry.resolve()
    if entry.kind == vllm_seam.INSTANCE_ATTRIBUTE:
        if isinstance(obj, type):
            assert _assigned_in_sources(obj, entry.name), f"no assignment of {entry.path}"
        else:  # a module-level object
            assert hasattr(obj, entry.name), entry.path
    expected = entry.params_in(installed.release)
    if expected is not None:
        assert _params(entry, obj) == expected, entry.path
    if entry.kind in (vllm_seam.FUNCTION, vllm_seam.METHOD, vllm_seam.CLASS):
        assert entry.params is not None, f"{entry.path}: a callable lists its parameters"


def test_entries_are_checked_against_the_supported_releases() -> None:
    releases = {Version(v).release[:2] for v in vllm_seam.CHECKED_AGAINST}
    assert Version(installed_vllm_version()).release[:2] in releases
    assert len({e.path for e in INTERNALS}) == len(INTERNALS), "an entry listed twice"


def test_accessors_refuse_an_entry_of_another_kind() -> None:
    with pytest.raises(ValueError, match="kind method"):
        vllm_seam.call_method(object(), vllm_seam.ATTN_K_SCALE)
    with pytest.raises(TypeError, match=r"vllm_seam\.Internal"):
        vllm_seam.get_attribute(object(), "_k_scale")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="_ngram_scan_kernel"):
        vllm_seam.v2_kernel_path("_no_such_kernel")
    with pytest.raises(ValueError, match="Internal kind"):
        Internal("vllm.x", "y", "global", None, "")


def test_swap_and_patch_restore_what_they_replace() -> None:
    module = importlib.import_module(vllm_seam.GPU_RUNNER_UBATCH_WRAPPER.module)
    original = module.UBatchWrapper

    class StandIn:
        pass

    with vllm_seam.ubatch_wrapper_bypassed(StandIn):
        assert module.UBatchWrapper is StandIn
    assert module.UBatchWrapper is original

    class Runner:
        def _warmup_and_capture(self, desc: int) -> int:
            return desc

    runner = Runner()
    calls = []
    before = vllm_seam.wrap_instance_method(
        runner,
        vllm_seam.V1_WARMUP_AND_CAPTURE,
        lambda own: lambda desc: calls.append(desc) or own(desc) + 1,
    )
    assert vllm_seam.warmup_and_capture(runner, 3) == 4 and calls == [3] and before(3) == 3
    assert Runner()._warmup_and_capture(3) == 3  # the class is left alone


def _seam_names() -> dict[str, set[str]]:
    """Each entry's constant and the accessors whose body names it, by entry path."""
    tree = ast.parse(SEAM.read_text())
    constants = {
        name: value
        for name, value in vars(vllm_seam).items()
        if isinstance(value, Internal) and name.isupper()
    }
    uses: dict[str, set[str]] = {e.path: set() for e in INTERNALS}
    for name, entry in constants.items():
        uses[entry.path].add(name)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            for name, entry in constants.items():
                if name in named:
                    uses[entry.path].add(node.name)
            for group in ("V2_KERNELS", "COMPILED_OPS"):
                if group in named:
                    for entry in getattr(vllm_seam, group):
                        uses[entry.path].add(node.name)
    return uses


def _bridge_sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(SRC.rglob("*.py")) if path != SEAM}


def test_every_entry_is_used_through_the_seam() -> None:
    words: set[str] = set()
    strings: set[str] = set()
    overridden: set[str] = set()
    for text in _bridge_sources().values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Name):
                words.add(node.id)
            elif isinstance(node, ast.Attribute):
                words.add(node.attr)
            elif isinstance(node, ast.alias):
                words.add(node.asname or node.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
            elif isinstance(node, ast.ClassDef):  # an override of a vLLM hook is its use
                overridden.update(f.name for f in node.body if isinstance(f, ast.FunctionDef))
    groups = {e.path for e in (*vllm_seam.V2_KERNELS, *vllm_seam.COMPILED_OPS)}
    hooks = {
        e.path
        for e in INTERNALS
        if e.kind == vllm_seam.METHOD and e.name.startswith("_") and e.name in overridden
    }
    dead = [
        path
        for path, names in _seam_names().items()
        if not names & words
        and path not in hooks
        and not (path in groups and path.rsplit(".", 1)[1] in strings)
    ]
    assert not dead, "entries no call site uses:\n" + "\n".join(dead)


# --- the bridge outside the seam -------------------------------------------------------

_VLLM_PRIVATE_PATH = re.compile(r"\bvllm(\.\w+)*\._\w+")
# A kernel named by its dotted path (vLLM's kernel dispatcher keys), private or not.
_VLLM_KERNEL_PATH = re.compile(r"^vllm(\.\w+)+\.\w*[kK]ernel\w*$")


def _vllm_bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds to vLLM modules or their members by import."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    names.add(alias.asname or "vllm")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _scan(path: Path, text: str, entry_names: set[str]) -> list[str]:
    tree = ast.parse(text)
    _mark_parents(tree)
    vllm_names = _vllm_bound_names(tree)
    own_names = _own_bound_names(tree)
    hits: list[str] = []

    def hit(node: ast.AST, what: str) -> None:
        hits.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            if _VLLM_PRIVATE_PATH.search(f"{node.module}.x") and "._" in f".{node.module}":
                hit(node, f"import from {node.module}")
            for alias in node.names:
                if alias.name.startswith("_"):
                    hit(node, f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vllm") and "._" in alias.name:
                    hit(node, f"import {alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _VLLM_PRIVATE_PATH.search(node.value) or _VLLM_KERNEL_PATH.search(node.value)
            if match and not isinstance(getattr(node, "parent", None), ast.Expr):
                hit(node, f"string {match.group(0)!r}")
        elif isinstance(node, ast.Attribute):
            receiver = node.value
            name = node.attr
            is_self = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
            dunder = name.startswith("__") and name.endswith("__")
            stored = isinstance(node.ctx, ast.Store) and not is_self
            if name.startswith("_") and not dunder:
                if name in entry_names or (not is_self and not _own(receiver, own_names)):
                    hit(node, f"{ast.unparse(node)}")
            elif stored and (name in entry_names or _from_vllm(receiver, vllm_names)):
                hit(node, f"assignment to {ast.unparse(node)}")
        elif isinstance(node, ast.ClassDef):
            methods = [f for f in node.body if isinstance(f, ast.FunctionDef)]
            for method in methods:
                if method.name in entry_names - _OVERRIDDEN_HOOKS:
                    hit(method, f"override of vLLM's {method.name}")
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("setattr", "mock.patch.object", "patch.object") and node.args:
                target = node.args[0]
                if _from_vllm(target, vllm_names):
                    hit(node, f"{func}({ast.unparse(target)}, ...)")
        elif isinstance(node, ast.For) and "sys.modules" in ast.unparse(node.iter):
            body = ast.unparse(node)
            if "setattr(" in body and "vllm" in body:
                hit(node, "a sweep over sys.modules that rebinds vLLM's names")
    return hits


def _own_bound_names(tree: ast.Module) -> set[str]:
    """Names bound to the bridge's own objects: its imports, module-level assignments,
    and classes and functions it defines."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("npu_"):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.asname or a.name for a in node.names if a.name.startswith("npu_"))
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _own(node: ast.AST, own_names: set[str]) -> bool:
    """Whether the expression is rooted in one of the bridge's own names."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id in own_names


def _from_vllm(node: ast.AST, vllm_names: set[str]) -> bool:
    """Whether the expression is rooted in a name imported from vLLM."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id in vllm_names


def _mark_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]


def seam_bypasses() -> list[str]:
    """Each place outside ``vllm_seam.py`` that reaches a vLLM internal directly."""
    entry_names = {e.name for e in INTERNALS if e.kind != vllm_seam.COMPILED_OP}
    private_names = {n for n in entry_names if n.startswith("_")}
    hits: list[str] = []
    for path, text in _bridge_sources().items():
        hits += _scan(path, text, private_names | _PATCHED_PUBLIC_NAMES)
    return hits


# vLLM's hooks the bridge overrides in its subclasses: a method definition cannot go
# through a module. Worker._make_model_runner is documented as the platform's hook
# ("subclasses override this"); the seam lists it and checks its signature.
_OVERRIDDEN_HOOKS = {vllm_seam.WORKER_MAKE_MODEL_RUNNER.name}

# Public vLLM names the bridge replaces on instances (through the seam only).
_PATCHED_PUBLIC_NAMES = {
    vllm_seam.V2_SPECULATOR_PROPOSE.name,
    vllm_seam.V2_MODEL_STATE_PREPARE_ATTN.name,
    vllm_seam.MLA_DCP_MANAGER.name,
    vllm_seam.CPU_COMMUNICATOR_DIST_MODULE.name,
    vllm_seam.COMPILATION_COUNTER_CUDAGRAPHS.name,
}


def test_nothing_outside_the_seam_reaches_vllm_internals() -> None:
    found = seam_bypasses()
    assert not found, "vLLM internals reached outside vllm_seam.py:\n" + "\n".join(found)


if __name__ == "__main__":
    found = seam_bypasses()
    print("\n".join(found) or "no vLLM internals reached outside vllm_seam.py")
    sys.exit(1 if found else 0)
