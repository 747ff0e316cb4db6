"""Simulated-NPU processes (``NPU_SIM=1``): install the simulation when vLLM loads the
bridge's host platform (see ``npu_sim_install``). Only on ``PYTHONPATH`` for such runs.
With ``COVERAGE_PROCESS_START`` set (and coverage importable), each process measures its
line coverage."""

import os
import sys
from pathlib import Path

if os.environ.get("COVERAGE_PROCESS_START"):  # line coverage of every process of a run
    import coverage

    coverage.process_startup()

if os.environ.get("NPU_SIM") == "1":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import npu_sim_install

    npu_sim_install.install_on_host_platform_import()
