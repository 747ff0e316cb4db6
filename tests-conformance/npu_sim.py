"""Run vLLM on a simulated Ascend NPU: greedy tokens and what the NPU was asked to do.

    python tests-conformance/npu_sim.py --model DIR --runner {v1,v2} \\
        --mode {eager,FULL_DECODE_ONLY,FULL_AND_PIECEWISE} --dtype {float16,bfloat16} \\
        --prompts FILE --max-tokens N [--max-num-seqs N] [--max-model-len N]

``FILE`` holds a JSON list of token-id lists. vLLM runs in host mode
(``NPU_BRIDGE_DEVICE=cpu``) with the stand-in ``torch_npu`` installed after ``import
vllm`` and the host platform switched to the NPU platform's settings
(``npu_sim_install``): the ``ascend`` providers, ``planes`` KV pages, the ``npu`` graph
backend with every graph captured at start-up. Prints two lines:

    TOKENS <json: the greedy tokens of each prompt, in prompt order>
    NPU <json: graphs_captured, replays, task_updates, synchronizes (inside replayed
         steps), torch_npu_calls (op name -> calls), and more; see Simulation.report>

Parallel runs: ``--tensor-parallel-size``, ``--decode-context-parallel-size`` (worker
processes of vLLM's multiprocessing executor, which simulate the NPU through
``npu_sim_site``'s ``sitecustomize``), ``--data-parallel-size N`` (N processes of this
script, one engine per DP rank; rank r generates prompts r, r + N, ...), ``--enable-dbo``.
vLLM's process groups talk through the NPU platform's communicator, over gloo. The NPU
line sums every worker process's report and keeps each under ``ranks``.

The torch-npu wheel comes as the conformance tests get it (``$TORCH_NPU_WHEEL_DIR``, else
pytest's cache folder of this repository; downloaded once with pip).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ("eager", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
BLOCK_SIZE = 128  # the NPU platform's page (the fused attention ops')
KV_CACHE_BYTES = 256 * 2**20
PR_SET_PDEATHSIG = 1  # prctl(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--runner", required=True, choices=("v1", "v2"))
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--dtype", required=True, choices=("float16", "bfloat16"))
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--max-tokens", required=True, type=int)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="token budget of a step"
    )
    parser.add_argument("--capture-sizes", type=int, nargs="*", default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=KV_CACHE_BYTES)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (8-bit KV caches)"
    )
    parser.add_argument(
        "--engine-json", default="{}", help="more LLM(...) keyword arguments, as JSON"
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM\'s speculative_config, as JSON (e.g. \'{"method": "mtp", '
        '"num_speculative_tokens": 1}\'); the NPU line then has spec_decode (drafts, '
        "draft tokens, accepted tokens)",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="no simulation: host mode as it is (reference provider, host graphs), the same "
        "engine otherwise; the NPU line is then empty",
    )
    parser.add_argument(
        "--fault", default=None, help="a deliberate fault to run with (npu_sim_faults.FAULTS)"
    )
    add_parallel_arguments(parser)
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    check_parallel_arguments(parser, args)
    return args


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Tensor, decode-context and data parallelism, and micro-batch overlap."""
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--decode-context-parallel-size", type=int, default=1, help="DCP ranks (of the TP ranks)"
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="DP ranks: one engine process each (vLLM's offline data parallelism); rank r "
        "generates prompts r, r + N, ...",
    )
    parser.add_argument("--enable-dbo", action="store_true", help="micro-batch overlap (DBO)")
    parser.add_argument("--dbo-decode-token-threshold", type=int, default=None)
    parser.add_argument("--dbo-prefill-token-threshold", type=int, default=None)
    # Set by the run for each DP rank's process.
    parser.add_argument("--data-parallel-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data-parallel-port", type=int, default=None, help=argparse.SUPPRESS)


def check_parallel_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("tensor_parallel_size", "decode_context_parallel_size", "data_parallel_size"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    rank = args.data_parallel_rank
    if rank is not None and not 0 <= rank < args.data_parallel_size:
        parser.error(f"--data-parallel-rank must be in [0, {args.data_parallel_size}), got {rank}")


def read_prompts(path: Path) -> list[list[int]]:
    """The prompts of ``path``: a JSON list of non-empty token-id lists."""
    prompts = json.loads(path.read_text())
    if not isinstance(prompts, list) or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
    ):
        raise ValueError(f"{path} must hold a JSON list of non-empty token-id lists")
    return prompts


def engine_arguments(args: argparse.Namespace) -> dict:
    """``LLM(...)`` keyword arguments of a run."""
    engine = dict(
        model=str(args.model),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        skip_tokenizer_init=True,
        seed=0,
    )
    if args.max_num_batched_tokens is not None:
        engine.update(max_num_batched_tokens=args.max_num_batched_tokens)
        engine.update(enable_chunked_prefill=True)
    for name in ("tensor_parallel_size", "decode_context_parallel_size"):
        if getattr(args, name) > 1:
            engine[name] = getattr(args, name)
    if args.enable_dbo:
        engine["enable_dbo"] = True
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            if getattr(args, name) is not None:
                engine[name] = getattr(args, name)
    if args.mode == "eager":
        engine["enforce_eager"] = True
    else:
        compilation = {"cudagraph_mode": args.mode}
        if args.capture_sizes:
            compilation["cudagraph_capture_sizes"] = args.capture_sizes
        engine["compilation_config"] = compilation
    if args.speculative_config is not None:
        engine["speculative_config"] = json.loads(args.speculative_config)
        engine["disable_log_stats"] = False  # vLLM's acceptance counters
    engine.update(json.loads(args.engine_json))
    return engine


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    prompts = read_prompts(args.prompts)
    if args.data_parallel_size > 1 and args.data_parallel_rank is None:
        tokens, report = run_data_parallel(args, argv, len(prompts))
    else:
        tokens, report = run_engine(args, prompts)
    print("TOKENS " + json.dumps(tokens), flush=True)
    print("NPU " + json.dumps(report), flush=True)


def run_engine(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[list, dict]:
    """One engine (of a DP rank: its prompts ``rank::size``): the greedy tokens of its
    prompts and the NPU report of every worker process, summed (``ranks``: each's own)."""
    sys.path.insert(0, str(HERE))
    import npu_sim_install

    if args.reference:
        os.environ["NPU_BRIDGE_DEVICE"] = "cpu"
    else:  # this process and any worker it spawns (their sitecustomize installs it)
        os.environ.update(npu_sim_install.simulation_environment(fault=args.fault))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    rank, size = args.data_parallel_rank, args.data_parallel_size
    if rank is not None:  # vLLM's offline data parallelism: one engine per rank
        os.environ.update(
            VLLM_DP_RANK=str(rank),
            VLLM_DP_RANK_LOCAL=str(rank),
            VLLM_DP_SIZE=str(size),
            VLLM_DP_MASTER_IP="127.0.0.1",
            VLLM_DP_MASTER_PORT=str(args.data_parallel_port),
        )
        prompts = prompts[rank::size]
    import vllm  # noqa: F401  (before the stand-in torch_npu)

    if not args.reference:
        npu_sim_install.install_simulated_npu()
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(**engine_arguments(args))
    ready = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [params] * len(prompts), use_tqdm=False
    )
    done = time.perf_counter()
    if args.reference:
        report = {"model_runner": llm.collective_rpc(_model_runner_name)[0]}
    else:  # every worker process's own simulation
        report = merge_reports(llm.collective_rpc("npu_sim_report"))
    report.update(
        cached_tokens=[o.num_cached_tokens or 0 for o in outputs],
        start_s=round(ready - started, 1),
        generate_s=round(done - ready, 1),
        bridge_graphs=merge_reports(llm.collective_rpc(_bridge_graph_counters))["counts"],
    )
    if args.speculative_config is not None:
        report["spec_decode"] = spec_decode_stats(llm)
    return [list(o.outputs[0].token_ids) for o in outputs], report


def _bridge_graph_counters(worker: Any) -> dict[str, Any]:
    """The graph counters of a worker's model runner (the drafter's graphs too); none
    counted by vLLM's own runner (``--reference``)."""
    from npu_vllm_bridge.graphs.counters import GraphCounters

    graph_counters = getattr(worker.model_runner, "graph_counters", GraphCounters)
    return {"counts": graph_counters().as_dict()}


SPEC_DECODE_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def spec_decode_stats(llm: Any) -> dict[str, int]:
    """vLLM's speculative-decoding counters of the run: drafts, draft tokens, accepted."""
    from vllm.v1.metrics.reader import Counter as MetricCounter

    stats = dict.fromkeys(SPEC_DECODE_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if isinstance(metric, MetricCounter) and metric.name in SPEC_DECODE_COUNTERS:
            stats[SPEC_DECODE_COUNTERS[metric.name]] += int(metric.value)
    return stats


def _model_runner_name(worker: Any) -> str:
    return type(worker.model_runner).__name__


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of several processes' (or DP ranks') reports: counts summed (counts by
    name too), times the longest, names kept once; each process's own under ``ranks``."""
    merged: dict[str, Any] = {}
    ranks: list[dict[str, Any]] = []
    for report in reports:
        ranks.extend(report.get("ranks", [report]))
        for key, value in report.items():
            if key in ("ranks", "dp_rank", "rank", "cached_tokens"):
                continue
            if key.endswith("_s"):
                merged[key] = max(merged.get(key, 0), value)
            elif isinstance(value, dict):
                counts = Counter(merged.get(key, {}))
                counts.update(value)
                merged[key] = dict(sorted(counts.items()))
            elif isinstance(value, (int, float)):
                merged[key] = merged.get(key, 0) + value
            elif merged.setdefault(key, value) != value:
                raise ValueError(f"processes disagree on {key}: {merged[key]!r}, {value!r}")
    merged["ranks"] = ranks
    return merged


def run_data_parallel(
    args: argparse.Namespace, argv: list[str], num_prompts: int
) -> tuple[list, dict]:
    """``--data-parallel-size N``: N processes of this script, one DP rank each (rank r
    generates prompts r, r + N, ...); their tokens in prompt order and their reports
    merged. A rank that fails stops the others (they would wait for it)."""
    size, port = args.data_parallel_size, _free_port()
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(size)]
        command = [sys.executable, str(Path(__file__).resolve()), *argv]
        command += ["--data-parallel-port", str(port), "--data-parallel-rank"]
        procs = [
            subprocess.Popen(
                [*command, str(rank)], stdout=log, text=True, preexec_fn=_die_with_parent
            )
            for rank, log in enumerate(logs)
        ]
        try:
            while any(proc.poll() is None for proc in procs):
                if any(proc.poll() for proc in procs):  # one failed
                    break
                time.sleep(0.5)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        results = [_rank_result(rank, log) for rank, log in enumerate(logs)]
    statuses = [proc.returncode for proc in procs]
    if any(statuses) or not all(results):
        raise SystemExit(f"DP ranks failed: exit statuses {statuses} (-9: stopped by the run)")
    tokens: list = [None] * num_prompts
    cached: list = [None] * num_prompts
    for rank, (rank_tokens, report) in enumerate(results):
        tokens[rank::size] = rank_tokens
        cached[rank::size] = report.get("cached_tokens", [])
    report = merge_reports([report for _, report in results])
    report["cached_tokens"] = cached
    return tokens, report


def _rank_result(rank: int, log: Any) -> tuple[list, dict] | None:
    """A DP rank's tokens and report (None: it printed none); its other output goes to
    stderr."""
    log.seek(0)
    lines = {}
    for line in log:
        head, _, rest = line.partition(" ")
        if head in ("TOKENS", "NPU"):
            lines[head] = json.loads(rest)
        else:
            sys.stderr.write(f"(DP rank {rank}) {line}")
    return (lines["TOKENS"], lines["NPU"]) if len(lines) == 2 else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """A DP rank's process is killed when the run that started it dies (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


if __name__ == "__main__":
    main()
