"""The package imports, carries a version, and exposes its public names."""

import importlib.metadata

import npu_attention


def test_version_matches_distribution() -> None:
    assert npu_attention.__version__ == importlib.metadata.version("npu-attention")


def test_public_names_present() -> None:
    for name in npu_attention.__all__:
        assert hasattr(npu_attention, name), name


def test_does_not_import_siblings_or_vllm() -> None:
    import sys

    assert not any(m.split(".")[0] in {"npu_graphs", "vllm", "torch_npu"} for m in sys.modules)
