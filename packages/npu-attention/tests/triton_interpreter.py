"""Import first in Triton test modules: without a GPU, route Triton kernels through
Triton's interpreter (``TRITON_INTERPRET=1`` must be set before the kernels are
decorated, so kernel modules imported earlier are reloaded)."""

from __future__ import annotations

import importlib
import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    _KERNELS = "npu_attention.providers.triton_kernels"
    # Submodules first, the package (which re-exports them) last.
    for _name in sorted((m for m in sys.modules if m.startswith(_KERNELS)), reverse=True):
        importlib.reload(sys.modules[_name])
