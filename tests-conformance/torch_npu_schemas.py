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

ATB operators (``torch_npu.atb.*``, registered as ``torch.ops.atb`` by a shared
library) have no yaml schema. Their C++ declarations in
``torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h`` are
parsed into signatures (``parse_atb_header``), and the schema strings the library
registers (``torch_npu/lib/libop_plugin_atb.so``, read as bytes) are parsed with
torch's schema parser where the file holds them whole: a call must bind to both.
The header gives C++ parameter names, which differ from the registered ones in
places (``head_num`` there, ``q_headnum`` in the schema): pass such arguments by
position.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
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
# ATB operators are registered from a shared library: their names are in Python, their
# C++ declarations in a header and their registered schemas in the library's strings.
ATB_OPS_FILE = "torch_npu/op_plugin/atb/_atb_ops.py"
ATB_HEADER = "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h"
ATB_LIBRARY = "torch_npu/lib/libop_plugin_atb.so"
# overload names the header spells as C++ suffixes: f_out, f_lse, f_lse_out, and
# g_lse_get_workspace for g_get_workspace.lse
ATB_OVERLOAD_SUFFIXES = ("lse_out", "out", "lse")
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


def _op_schema(func: str, collect_outs: bool = True) -> OpSchema:
    """``collect_outs``: mutable keyword outputs become one ``out=[...]`` (torch_npu's
    yaml operators); ATB operators take them by name (``output=``, ``lse=``)."""
    parsed = torch._C.parse_schema(func)
    name = parsed.name + (f".{parsed.overload_name}" if parsed.overload_name else "")
    params, types, outs = [], {}, []
    for arg in parsed.arguments:
        is_out = arg.kwarg_only and arg.alias_info is not None and arg.alias_info.is_write
        if collect_outs and is_out and not arg.has_default_value():
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
class AtbOverload:
    """One overload of an ATB operator: its header declaration as a signature, and the
    schema the library registers for it when the library's strings hold it whole."""

    name: str  # "atb.npu_multi_head_latent_attention.lse_out"
    cpp_name: str  # "npu_multi_head_latent_attention_lse_out"
    declared: OpSchema  # from AtbOpsInterface.h, C++ parameter names
    registered: OpSchema | None  # from libop_plugin_atb.so, the names Python binds

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Bind to the declaration and to the registered schema; arguments by their
        declared (header) names.

        Raises:
            SchemaViolation: the call does not fit one of them.
        """
        arguments = self.declared.bind(args, kwargs)
        if self.registered is not None:
            self.registered.bind(args, kwargs)
        return arguments


@dataclass(frozen=True)
class TorchNpuApi:
    """Everything the conformance checks read from one torch_npu wheel."""

    version: str
    operators: dict[str, OpSchema]
    python: PythonApi
    atb_ops: frozenset[str]  # "name" (torch_npu.name) or "atb.name"; names only
    # ATB operators the header declares, by the same names, overloads in header order
    atb_overloads: dict[str, tuple[AtbOverload, ...]] = field(default_factory=dict)


# C++ parameter types of AtbOpsInterface.h -> schema types
CPP_TYPES = {
    "const at::Tensor&": "Tensor",
    "at::Tensor&": "Tensor",
    "c10::SymIntArrayRef": "List[SymInt]",
    "c10::OptionalArrayRef<c10::SymInt>": "Optional[List[SymInt]]",
    "int64_t": "int",
    "const int64_t": "int",
    "double": "float",
    "const double": "float",
    "bool": "bool",
    "const c10::optional<at::Tensor>&": "Optional[Tensor]",
    "c10::optional<c10::string_view>": "Optional[str]",
}
_CPP_DECLARATION = re.compile(
    r"TORCH_NPU_API (?P<result>[^(;]*?)\s*(?P<name>[A-Za-z_]\w*)\((?P<params>[^;]*)\);"
)


def parse_atb_header(text: str) -> dict[str, OpSchema]:
    """Every ``TORCH_NPU_API`` function of ``AtbOpsInterface.h`` as an ``OpSchema``,
    keyed by its C++ name.

    The Python form follows the schemas these declarations implement: parameters up
    to the first optional one are positional, the rest keyword-only; optionals
    (``c10::optional<...>``, ``c10::OptionalArrayRef``) default to ``None``;
    ``SymIntArrayRef`` is a list of ints; mutable ``at::Tensor&`` after the optionals
    are required keyword outputs. Names lose the ``_opt`` suffix of C++ optionals.

    Raises:
        ValueError: a parameter type the mapping does not know.
    """
    P = inspect.Parameter
    schemas: dict[str, OpSchema] = {}
    for match in _CPP_DECLARATION.finditer(text):
        params, types, keyword_only = [], {}, False
        for declaration in _split_cpp_params(match["params"]):
            cpp_type, name = _cpp_type_and_name(declaration)
            if cpp_type not in CPP_TYPES:
                raise ValueError(f"{match['name']}: unknown C++ parameter type {cpp_type!r}")
            optional = CPP_TYPES[cpp_type].startswith("Optional[")
            keyword_only = keyword_only or optional
            name = name.removesuffix("_opt")
            kind = P.KEYWORD_ONLY if keyword_only else P.POSITIONAL_OR_KEYWORD
            params.append(P(name, kind, default=None if optional else P.empty))
            types[name] = CPP_TYPES[cpp_type]
        schemas[match["name"]] = OpSchema(match["name"], inspect.Signature(params), types, ())
    return schemas


def _split_cpp_params(text: str) -> list[str]:
    """Split a C++ parameter list at the commas outside template brackets."""
    parts, depth, current = [], 0, []
    for char in text:
        depth += {"<": 1, ">": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    tail = "".join(current).strip()
    return [p.strip() for p in parts] + ([tail] if tail else [])


def _cpp_type_and_name(declaration: str) -> tuple[str, str]:
    """``"const at::Tensor &query"`` -> ``("const at::Tensor&", "query")``."""
    match = re.fullmatch(r"(?P<type>.*?)\s*(?P<name>[A-Za-z_]\w*)", declaration.strip())
    if match is None:
        raise ValueError(f"cannot read the C++ parameter {declaration!r}")
    cpp_type = re.sub(r"\s+", " ", match["type"]).replace(" &", "&").replace("& ", "&").strip()
    return cpp_type, match["name"]


def parse_registered_schemas(library: bytes) -> dict[str, OpSchema]:
    """Schema strings (``name.overload(...) -> ...``) a compiled operator library holds
    whole, parsed with torch's parser; outputs are taken by name."""
    pattern = re.compile(r"[A-Za-z_]\w*(\.\w+)?\(.*\) -> .+")
    schemas: dict[str, OpSchema] = {}
    for raw in library.split(b"\x00"):
        text = raw.decode("latin-1")
        if pattern.fullmatch(text):
            try:
                schema = _op_schema(text, collect_outs=False)
            except RuntimeError:  # linker-merged fragments of several strings
                continue
            schemas.setdefault(schema.name, schema)
    return schemas


def atb_overloads(
    names: frozenset[str], declared: dict[str, OpSchema], registered: dict[str, OpSchema]
) -> dict[str, tuple[AtbOverload, ...]]:
    """The header's functions grouped by the ATB operator they overload (``f``,
    ``f_out``, ``f_lse``, ``f_lse_out``; ``g_lse_get_workspace`` for
    ``g_get_workspace.lse``), for each operator name the Python module lists."""
    overloads: dict[str, tuple[AtbOverload, ...]] = {}
    for public in sorted(names):
        base = public.removeprefix("atb.")
        found = []
        for cpp_name, schema in declared.items():
            overload = _overload_of(base, cpp_name)
            if overload is None:
                continue
            schema_name = base + (f".{overload}" if overload else "")
            qualified = ("atb." if public.startswith("atb.") else "") + schema_name
            known = registered.get(schema_name)
            declared_schema = _with_defaults(dataclasses.replace(schema, name=qualified), known)
            found.append(AtbOverload(qualified, cpp_name, declared_schema, known))
        if found:
            overloads[public] = tuple(found)
    return overloads


def _with_defaults(declared: OpSchema, registered: OpSchema | None) -> OpSchema:
    """The declaration with the registered schema's defaults (C++ declarations carry
    none), where both list the same parameters in the same order."""
    if registered is None:
        return declared
    ours = list(declared.signature.parameters.values())
    theirs = list(registered.signature.parameters.values())
    if len(ours) != len(theirs):
        return declared
    params = [
        mine.replace(default=other.default) if mine.default is mine.empty else mine
        for mine, other in zip(ours, theirs)
    ]
    try:
        return dataclasses.replace(declared, signature=inspect.Signature(params))
    except ValueError:  # a default before a required positional: keep the declaration
        return declared


def _overload_of(base: str, cpp_name: str) -> str | None:
    if cpp_name == base:
        return ""
    for suffix in ATB_OVERLOAD_SUFFIXES:
        if cpp_name == f"{base}_{suffix}":
            return suffix
        workspace = base.removesuffix("_get_workspace")
        if workspace != base and cpp_name == f"{workspace}_{suffix}_get_workspace":
            return suffix
    return None


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
        declared = parse_atb_header(archive.read(ATB_HEADER).decode())
        registered = parse_registered_schemas(archive.read(ATB_LIBRARY))
    overloads = atb_overloads(atb_ops, declared, registered)
    return TorchNpuApi(version, operators, parse_python_api(sources), atb_ops, overloads)
