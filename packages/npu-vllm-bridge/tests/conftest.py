"""Make the helper modules beside the tests importable under ``--import-mode=importlib``.

On an empty vLLM build (no ``vllm._C``, as on Ascend hosts) vLLM has no CPU platform of
its own ("Failed to infer device type"): the bridge's host platform is the CPU platform
there, so the tests run in host mode unless ``NPU_BRIDGE_DEVICE`` says otherwise.
"""

import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

if importlib.util.find_spec("vllm._C") is None:
    os.environ.setdefault("NPU_BRIDGE_DEVICE", "cpu")
