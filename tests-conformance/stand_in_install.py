"""Install the stand-in ``torch_npu`` and ``torch.npu`` for the duration of a block."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from npu_runtime_stand_in import NpuRuntime, StandInNpuNamespace
from schema_stand_in import CallLog, StandInTorchNpu
from torch_npu_schemas import TorchNpuApi

_MISSING = object()


@contextlib.contextmanager
def installed_stand_in(api: TorchNpuApi) -> Iterator[StandInTorchNpu]:
    """Stand-in ``torch_npu`` (in ``sys.modules``) and ``torch.npu``; restored on exit.

    ``module.npu`` is the ``torch.npu`` namespace; ops and runtime share one call log.
    """
    log = CallLog()
    module = StandInTorchNpu(api, log)
    runtime = NpuRuntime(api.python, log)
    module.launcher = runtime
    module.npu = StandInNpuNamespace(runtime)
    saved_modules = {
        name: sys.modules.get(name, _MISSING) for name in ("torch_npu", "torch_npu.npu")
    }
    saved_npu = getattr(torch, "npu", _MISSING)
    sys.modules["torch_npu"], sys.modules["torch_npu.npu"] = module, module.npu
    torch.npu = module.npu
    try:
        yield module
    finally:
        for name, saved in saved_modules.items():
            if saved is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved
        if saved_npu is _MISSING:
            del torch.npu
        else:
            torch.npu = saved_npu
