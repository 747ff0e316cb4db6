"""Simulated-NPU processes (``NPU_SIM=1``): install the simulation when vLLM loads the
bridge's host platform (see ``npu_sim_install``). Only on ``PYTHONPATH`` for such runs."""

import os
import sys
from pathlib import Path

if os.environ.get("NPU_SIM") == "1":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import npu_sim_install

    npu_sim_install.install_on_host_platform_import()
