"""``python -m npu_vllm_bridge.serve`` dispatches as ``vllm serve`` does: vLLM's own
``serve`` subcommand decides, from the parsed options, whether this node runs the API
server or only its workers (``--headless``). vLLM's two launchers are replaced by
recorders; nothing is started.
"""

from __future__ import annotations

import os

import pytest
import vllm.entrypoints.cli.serve as vllm_serve

from npu_vllm_bridge import serve

NODE = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29555"]


@pytest.fixture
def launched(monkeypatch):
    """What vLLM's serve subcommand launched: ``("server" | "headless", args)``."""
    calls = []

    async def run_server(args, **kwargs):
        calls.append(("server", args))

    monkeypatch.setattr(vllm_serve, "run_server", run_server)
    monkeypatch.setattr(vllm_serve, "run_headless", lambda args: calls.append(("headless", args)))
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    return calls


def test_follower_runs_headless(launched, tmp_path):
    serve.main(
        [str(tmp_path), "--pipeline-parallel-size", "2", *NODE, "--node-rank", "1", "--headless"]
    )
    [(kind, args)] = launched
    assert kind == "headless"
    assert (args.model, args.nnodes, args.node_rank, args.api_server_count) == (
        str(tmp_path),
        2,
        1,
        0,
    )
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # as vLLM's CLI sets


def test_leader_runs_the_api_server(launched, tmp_path):
    serve.main([str(tmp_path), "--tensor-parallel-size", "2", *NODE, "--node-rank", "0"])
    [(kind, args)] = launched
    assert kind == "server"
    assert (args.model, args.node_rank, args.master_port) == (str(tmp_path), 0, 29555)


def test_unknown_option_is_refused(launched, tmp_path):
    with pytest.raises(SystemExit):
        serve.main([str(tmp_path), "--no-such-option"])
    assert launched == []
