"""Host mode: vLLM on a CPU through the bridge (``NPU_BRIDGE_DEVICE=cpu``).

Everything here exists only to run vLLM on a CPU: the host platform, worker and runners,
PyTorch copies of vLLM's compiled ops and of V2's Triton kernels, the Triton-interpreter
set-up, the host communicator and the collectives host graphs record. No other bridge
module imports this package (an import-linter contract in the root ``pyproject.toml``);
the plugin names the host platform by its class path only.
"""
