"""Install the stand-in ``torch_npu`` and ``torch.npu`` for the duration of a block."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from npu_runtime_stand_in import NpuRuntime, StandInNpuNamespace, capture_collectives
from schema_stand_in import CallLog, StandInTorchNpu
from torch_npu_schemas import TorchNpuApi

_MISSING = object()


def install_stand_in(api: TorchNpuApi, log: CallLog) -> StandInTorchNpu:
    """Put a stand-in ``torch_npu`` in ``sys.modules`` and its ``torch.npu`` on torch.

    ``module.npu`` is the ``torch.npu`` namespace; ops and runtime share ``log``.
    torch.distributed's collectives called during a capture are captured whole
    (``module.restore_collectives()`` puts torch.distributed's own back).
    """
    module = StandInTorchNpu(api, log)
    runtime = NpuRuntime(api.python, log)
    module.restore_collectives = capture_collectives(runtime)
    module.launcher = runtime
    module.npu = StandInNpuNamespace(runtime)
    sys.modules["torch_npu"], sys.modules["torch_npu.npu"] = module, module.npu
    torch.npu = module.npu
    return module


@contextlib.contextmanager
def installed_stand_in(api: TorchNpuApi) -> Iterator[StandInTorchNpu]:
    """Stand-in ``torch_npu`` (in ``sys.modules``) and ``torch.npu``; restored on exit."""
    saved_modules = {
        name: sys.modules.get(name, _MISSING) for name in ("torch_npu", "torch_npu.npu")
    }
    saved_npu = getattr(torch, "npu", _MISSING)
    module = install_stand_in(api, CallLog())
    try:
        yield module
    finally:
        module.npu.runtime.close()
        module.restore_collectives()
        for name, saved in saved_modules.items():
            if saved is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved
        if saved_npu is _MISSING:
            del torch.npu
        else:
            torch.npu = saved_npu
