"""A tiny Llama through vLLM with npu-vllm-bridge: Ascend NPU if usable, else host mode.

    nox -s demo                      # or: python examples/demo.py [--enforce-eager]

On first use it writes a small Llama-style checkpoint with random weights
(transformers) under ``~/.cache/npu-vllm-bridge/`` (``--model-dir`` to change),
starts vLLM with the bridge as its platform plugin, generates greedily for a few
token-id prompts and prints the outputs, the decode speed and how many steps
replayed a captured graph.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "npu-vllm-bridge" / "tiny-llama-2l-128h"
PROMPT_LENGTHS = (7, 19, 42, 64, 100, 150)


class _SkipTokenizerWarmupNoise(logging.Filter):
    """Drop vLLM's chat-template warmup traceback: the demo runs without a tokenizer
    (token-id prompts), so that warmup cannot apply and its failure means nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Chat template warmup failed" not in record.getMessage()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "npu"),
        default=os.environ.get("NPU_BRIDGE_DEVICE", "auto") or "auto",
        help="npu: Ascend NPU; cpu: host mode; auto: npu when one is usable (default)",
    )
    parser.add_argument("--max-tokens", type=int, default=48)
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


def ensure_checkpoint(model_dir: Path) -> Path:
    """Write a 2-layer Llama (hidden 128, 4 query / 2 KV heads of 64) once; reuse it after."""
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        return model_dir
    import torch
    import transformers

    print(f"Writing a random-weight tiny Llama to {model_dir} ...")
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    return model_dir


def main() -> None:
    args = parse_args()
    device = choose_device(args.device)
    # The platform is chosen once, when vLLM is imported: set the switch first.
    os.environ["NPU_BRIDGE_DEVICE"] = device
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # counters live in-process
    model_dir = ensure_checkpoint(args.model_dir)

    from vllm import LLM, SamplingParams

    from npu_vllm_bridge.graphs.counters import graph_counters

    logging.getLogger("vllm.renderers.base").addFilter(_SkipTokenizerWarmupNoise())

    on_npu = device == "npu"
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16" if on_npu else "float32",
        block_size=128 if on_npu else 32,
        max_model_len=512,
        max_num_seqs=8,
        # Prompts are prefilled in chunks of up to 64 tokens, which replay the
        # piecewise graphs of these sizes; decode steps replay full graphs.
        max_num_batched_tokens=64,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]},
        gpu_memory_utilization=0.8 if on_npu else 0.2,
        enforce_eager=args.enforce_eager,
        seed=0,
    )
    prompts = [
        {"prompt_token_ids": [(7 * i + 3 * n) % 500 + 3 for i in range(n)]} for n in PROMPT_LENGTHS
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start

    print(f"\nnpu-vllm-bridge demo: device={device}, model={model_dir.name}")
    for prompt, output in zip(prompts, outputs):
        tokens = list(output.outputs[0].token_ids)
        print(f"  prompt of {len(prompt['prompt_token_ids']):3d} tokens -> {tokens[:16]} ...")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"Generated {generated} tokens in {seconds:.2f} s: {generated / seconds:.1f} tokens/s")
    counters = graph_counters()
    if args.enforce_eager:
        print("Graphs: off (--enforce-eager)")
    else:
        print(
            f"Graphs: {counters.captured} captured ({counters.capture_bytes / 2**20:.1f} MiB). "
            f"Steps: {counters.replayed_steps} replayed a FULL graph after updating its "
            f"attention tasks ({counters.task_updates} updates), {counters.piecewise_steps} "
            f"replayed PIECEWISE graphs, {counters.eager_steps} ran eagerly"
        )


if __name__ == "__main__":
    main()
