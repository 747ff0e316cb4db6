"""The import-linter contract that fences host mode off names every bridge module.

A ``forbidden`` contract checks only the source modules it lists: a module added to
the bridge later and not listed there could import ``npu_vllm_bridge.host`` unseen.
Reference: the bridge's own top-level modules and subpackages, read from its sources.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import npu_vllm_bridge

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = "host-fenced-off"
HOST = "npu_vllm_bridge.host"


def _contract() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["id"] == CONTRACT)


def _bridge_modules() -> set[str]:
    package = Path(npu_vllm_bridge.__file__).parent
    names = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    names |= {p.parent.name for p in package.glob("*/__init__.py")}
    return {f"npu_vllm_bridge.{name}" for name in names}


def test_every_bridge_module_but_host_may_not_import_host() -> None:
    contract = _contract()
    assert contract["type"] == "forbidden" and contract["forbidden_modules"] == [HOST]
    assert set(contract["source_modules"]) == _bridge_modules() - {HOST}
    assert HOST in _bridge_modules()
