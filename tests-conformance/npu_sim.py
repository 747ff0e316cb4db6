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

The torch-npu wheel comes as the conformance tests get it (``$TORCH_NPU_WHEEL_DIR``, else
pytest's cache folder of this repository; downloaded once with pip).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("eager", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
BLOCK_SIZE = 128  # the NPU platform's page (the fused attention ops')
KV_CACHE_BYTES = 256 * 2**20


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
        "--engine-json", default="{}", help="more LLM(...) keyword arguments, as JSON"
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
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    return args


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
        skip_tokenizer_init=True,
        seed=0,
    )
    if args.max_num_batched_tokens is not None:
        engine.update(max_num_batched_tokens=args.max_num_batched_tokens)
        engine.update(enable_chunked_prefill=True)
    if args.mode == "eager":
        engine["enforce_eager"] = True
    else:
        compilation = {"cudagraph_mode": args.mode}
        if args.capture_sizes:
            compilation["cudagraph_capture_sizes"] = args.capture_sizes
        engine["compilation_config"] = compilation
    engine.update(json.loads(args.engine_json))
    return engine


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts = read_prompts(args.prompts)
    sys.path.insert(0, str(HERE))
    import npu_sim_install

    if args.reference:
        os.environ["NPU_BRIDGE_DEVICE"] = "cpu"
    else:  # this process and any worker it spawns (their sitecustomize installs it)
        os.environ.update(npu_sim_install.simulation_environment(fault=args.fault))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    import vllm  # noqa: F401  (before the stand-in torch_npu)

    simulation = None if args.reference else npu_sim_install.install_simulated_npu()
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(**engine_arguments(args))
    ready = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [params] * len(prompts), use_tqdm=False
    )
    done = time.perf_counter()
    runner = type(llm.llm_engine.model_executor.driver_worker.worker.model_runner).__name__
    report = {} if simulation is None else simulation.report()
    report.update(
        cached_tokens=[o.num_cached_tokens or 0 for o in outputs],
        model_runner=runner,
        start_s=round(ready - started, 1),
        generate_s=round(done - ready, 1),
    )
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)
    print("NPU " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
