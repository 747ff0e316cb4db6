"""Device-graph capture and replay keyed by batch shape, with per-step task updates."""

from npu_graphs._version import __version__

__all__ = ["__version__"]
