"""vLLM platforms: ``npu`` (Ascend, torch_npu) and ``host`` (CPU, for development and CI)."""
