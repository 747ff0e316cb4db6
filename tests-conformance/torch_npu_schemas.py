"""torch_npu's published API, read from its wheel without importing it.

Two sources inside the wheel:

- ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``: operator schemas
  (``func: name.overload(Tensor query, ..., *, int num_heads=1, ...) -> ...``),
  parsed with torch's own schema parser.
- Python modules (``torch_npu/npu/graphs.py``, ``streams.py``, ...): function and
  class signatures, read with ``ast``.

Both become ``inspect.Signature`` objects, so checking a call is ``bind``: the
function exists, every keyword exists, required arguments are given and the
positional arity fits. Operator arguments are also checked against their schema
types (``SymInt[]`` must be a list of ints, not a tensor).
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

# The torch_npu release the conformance checks read (the ascend extras allow
# torch-npu>=2.11,<2.15). Schemas do not depend on the platform, so one fixed
# wheel is fetched wherever the checks run.
TORCH_NPU_VERSION = "2.14.0"
WHEEL_PLATFORM_ARGS = (
    "--only-binary=:all:",
    "--platform",
    "manylinux_2_28_x86_64",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
)
OPERATOR_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
# ATB operators are registered from a shared library: only their names are in Python.
ATB_OPS_FILE = "torch_npu/op_plugin/atb/_atb_ops.py"
PYTHON_API_FILES = (
    "torch_npu/npu/graphs.py",
    "torch_npu/npu/streams.py",
    "torch_npu/npu/utils.py",
    "torch_npu/npu/memory.py",
    "torch_npu/npu/npu_config.py",
    "torch_npu/npu/__init__.py",  # last: its __all__ is what ``torch.npu`` exports
)


class SchemaViolation(Exception):
    """A call that torch_npu's published API does not accept."""


def download_wheel(dest: Path, version: str = TORCH_NPU_VERSION) -> Path:
    """Fetch the torch_npu wheel into ``dest`` with pip (no dependencies).

    Raises:
        RuntimeError: pip failed or produced no wheel; carries pip's output.
    """
    existing = sorted(dest.glob(f"torch_npu-{version}-*.whl"))
    if existing:
        return existing[0]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        f"torch-npu=={version}",
        "-d",
        str(dest),
        *WHEEL_PLATFORM_ARGS,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob(f"torch_npu-{version}-*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download torch-npu=={version} (the conformance checks need its "
            f"schemas): {' '.join(command)} exited {result.returncode}\n"
            f"{result.stdout}\n{result.stderr}"
        )
    return wheels[0]


@dataclass(frozen=True)
class OpSchema:
    """One operator overload: its signature as Python sees it, and argument types."""

    name: str  # "npu_fused_infer_attention_score" or "npu_fused_infer_attention_score.out"
    signature: inspect.Signature
    types: dict[str, str]  # argument name -> schema type, e.g. "Optional[List[SymInt]]"
    out_names: tuple[str, ...]  # mutable outputs, passed as out=[...] from Python

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Bind a call; return every argument by name, defaults applied.

        Raises:
            SchemaViolation: unknown keyword, missing required argument, too many
                positional arguments, or a value of the wrong type.
        """
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            raise SchemaViolation(f"torch_npu.{self.name}: {error}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for name, value in arguments.items():
            if name == "out":
                self._check_out(value)
            elif not value_matches(self.types[name], value):
                raise SchemaViolation(
                    f"torch_npu.{self.name}: argument {name!r} must be "
                    f"{self.types[name]}, got {type(value).__name__}"
                )
        return arguments

    def _check_out(self, value: Any) -> None:
        if not isinstance(value, (list, tuple)) or len(value) != len(self.out_names):
            raise SchemaViolation(
                f"torch_npu.{self.name}: out must be a list of {len(self.out_names)} tensors "
                f"{self.out_names}, got {value!r:.80}"
            )
        if not all(isinstance(t, torch.Tensor) for t in value):
            raise SchemaViolation(f"torch_npu.{self.name}: out must hold tensors")


def parse_operator_schemas(yaml_text: str) -> dict[str, OpSchema]:
    """Every ``func:`` of the codegen yaml, keyed ``name`` or ``name.overload``."""
    document = yaml.safe_load(yaml_text)
    schemas: dict[str, OpSchema] = {}
    for section_name, section in document.items():
        # "supported" lists aten operators torch_npu implements, not torch_npu.* functions.
        if section_name == "supported" or not isinstance(section, list):
            continue
        for entry in section:
            if isinstance(entry, dict) and "func" in entry:
                schema = _op_schema(entry["func"])
                schemas.setdefault(schema.name, schema)
    return schemas


def _op_schema(func: str) -> OpSchema:
    parsed = torch._C.parse_schema(func)
    name = parsed.name + (f".{parsed.overload_name}" if parsed.overload_name else "")
    params, types, outs = [], {}, []
    for arg in parsed.arguments:
        is_out = arg.kwarg_only and arg.alias_info is not None and arg.alias_info.is_write
        if is_out and not arg.has_default_value():
            outs.append(arg.name)
            continue
        kind = (
            inspect.Parameter.KEYWORD_ONLY
            if arg.kwarg_only
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        default = arg.default_value if arg.has_default_value() else inspect.Parameter.empty
        params.append(inspect.Parameter(arg.name, kind, default=default))
        types[arg.name] = str(arg.type)
    if outs:
        params.append(inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY))
    return OpSchema(name, inspect.Signature(params), types, tuple(outs))


def value_matches(schema_type: str, value: Any) -> bool:
    """Whether ``value`` is acceptable for an argument of ``schema_type``."""
    if schema_type.startswith("Optional[") and schema_type.endswith("]"):
        return value is None or value_matches(schema_type[len("Optional[") : -1], value)
    if schema_type.startswith("List[") and schema_type.endswith("]"):
        inner = schema_type[len("List[") : -1]
        return isinstance(value, (list, tuple)) and all(value_matches(inner, v) for v in value)
    checks = {
        "Tensor": lambda v: isinstance(v, torch.Tensor),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "SymInt": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    }
    check = checks.get(schema_type)
    return True if check is None else check(value)


@dataclass(frozen=True)
class PythonApi:
    """Functions and classes of ``torch.npu`` (torch_npu's Python modules), as signatures."""

    functions: dict[str, inspect.Signature]
    classes: dict[str, dict[str, inspect.Signature]]  # class -> method -> signature
    # "__call__" of a class entry is its constructor.
    exported: frozenset[str]  # the names ``torch.npu`` exports (``__all__``)

    def function(self, name: str) -> inspect.Signature:
        if name not in self.functions or name not in self.exported:
            raise SchemaViolation(f"torch.npu has no function {name!r} in torch_npu's Python API")
        return self.functions[name]

    def method(self, class_name: str, method: str) -> inspect.Signature:
        methods = self.classes.get(class_name)
        if methods is None or class_name not in self.exported:
            raise SchemaViolation(f"torch.npu has no class {class_name!r}")
        if method not in methods:
            raise SchemaViolation(f"torch.npu.{class_name} has no method {method!r}")
        return methods[method]


def bind_python(signature: inspect.Signature, where: str, args: tuple, kwargs: dict) -> dict:
    """Bind a call to a Python API signature; ``SchemaViolation`` if it does not fit."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise SchemaViolation(f"{where}: {error}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def parse_python_api(sources: dict[str, str]) -> PythonApi:
    """Module-level functions and classes of each source, by name (later files win);
    the exported names are the ``__all__`` of the last source."""
    functions: dict[str, inspect.Signature] = {}
    classes: dict[str, dict[str, inspect.Signature]] = {}
    exported: frozenset[str] = frozenset()
    for source in sources.values():
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                functions[node.name] = _signature(node.args, drop_first=False)
            elif isinstance(node, ast.ClassDef):
                classes[node.name] = _class_methods(node)
            elif isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
            ):
                exported = frozenset(ast.literal_eval(node.value))
    return PythonApi(functions, classes, exported)


def _class_methods(node: ast.ClassDef) -> dict[str, inspect.Signature]:
    methods: dict[str, inspect.Signature] = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            is_static = any(
                isinstance(d, ast.Name) and d.id == "staticmethod" for d in item.decorator_list
            )
            methods[item.name] = _signature(item.args, drop_first=not is_static)
    constructor = methods.get("__init__") or methods.get("__new__")
    methods["__call__"] = constructor if constructor is not None else inspect.Signature()
    return methods


def _signature(args: ast.arguments, drop_first: bool) -> inspect.Signature:
    P = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = []
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        if drop_first and index == 0:
            continue
        kind = P.POSITIONAL_ONLY if arg in args.posonlyargs else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=_default(default)))
    if args.vararg is not None:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=_default(default)))
    if args.kwarg is not None:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return inspect.Parameter.empty
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)  # a non-literal default: its source text


@dataclass(frozen=True)
class TorchNpuApi:
    """Everything the conformance checks read from one torch_npu wheel."""

    version: str
    operators: dict[str, OpSchema]
    python: PythonApi
    atb_ops: frozenset[str]  # "name" (torch_npu.name) or "atb.name"; names only


def parse_atb_op_names(source: str) -> frozenset[str]:
    """``torch_npu.<name>`` (``API_LIST``) and ``torch_npu.atb.<name>`` (``ATB_API_LIST``)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if target == "API_LIST":
                names.update(ast.literal_eval(node.value))
            elif target == "ATB_API_LIST":
                names.update(f"atb.{name}" for name in ast.literal_eval(node.value))
    return frozenset(names)


def read_wheel(wheel: Path, version: str = TORCH_NPU_VERSION) -> TorchNpuApi:
    """Parse the operator schemas and Python API out of ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        operators = parse_operator_schemas(archive.read(OPERATOR_YAML).decode())
        sources = {path: archive.read(path).decode() for path in PYTHON_API_FILES}
        atb_ops = parse_atb_op_names(archive.read(ATB_OPS_FILE).decode())
    return TorchNpuApi(version, operators, parse_python_api(sources), atb_ops)
