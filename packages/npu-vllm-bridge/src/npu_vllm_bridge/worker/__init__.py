"""Workers and model runners: host (vLLM's CPU ones + graph wiring) and NPU."""
