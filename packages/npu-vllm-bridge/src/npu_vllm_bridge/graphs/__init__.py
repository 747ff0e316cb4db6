"""Graph wiring: vLLM's graph wrapper and model-runner hooks over npu-graphs."""
