"""The package imports, carries a version, and exposes its public names."""

import importlib.metadata

import pytest

import npu_graphs


def test_version_matches_distribution() -> None:
    try:
        installed = importlib.metadata.version("npu-graphs")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("npu-graphs is not installed (run from a source path)")
    assert npu_graphs.__version__ == installed


def test_public_names_present() -> None:
    for name in npu_graphs.__all__:
        assert hasattr(npu_graphs, name), name


def test_does_not_import_siblings_or_vllm() -> None:
    import sys

    assert not any(m.split(".")[0] in {"npu_attention", "vllm", "torch_npu"} for m in sys.modules)
