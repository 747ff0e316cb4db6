"""Errors raised by graph capture, replay and task update."""

from __future__ import annotations


class GraphCaptureError(RuntimeError):
    """A graph capture failed; the message names the graph, its key and its mode.

    Nothing of the failed capture stays registered: no graph, no tasks, no outputs.
    """


class GraphReplayError(RuntimeError):
    """A replay was asked for a graph that cannot be replayed as asked."""


class TaskUpdateError(ValueError):
    """A task update does not match what was captured (count, kind or shape of ops)."""
