"""SmolLM2 chats through the bridge's host mode with each 8-bit KV cache kind.

Sixteen chat prompts (the checkpoint's own template) are answered greedily in one
batch (up to end-of-turn or 32 tokens) at ``max_model_len=2048``, in bfloat16, with
``kv_cache_dtype`` ``auto`` and each 8-bit kind, eagerly and with FULL_DECODE_ONLY
graphs, all engines given the same KV-cache bytes. Printed per run: the answers'
token agreement with ``auto`` (position by position), the mean absolute difference
of the chosen tokens' log-probabilities while the answers agree, the KV-cache
capacity in tokens (vLLM's ``KV cache size: N tokens`` line, read from its log), and
the first answers as text. With ``--cpu-attn``, vLLM's own CPU backend (CPU_ATTN, the
plugin inactive) runs the kinds it supports (``auto``, ``fp8``, ``fp8_e4m3``) too,
and each bridge run is compared with CPU_ATTN's run of the same kind.

    python examples/kv_cache_dtypes.py [--kinds fp8 int8_per_token_head] [--cpu-attn]

Each engine runs in its own process (the bridge's platform is chosen at import).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

KINDS = ("auto", "fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head")
CPU_ATTN_KINDS = ("auto", "fp8", "fp8_e4m3")
QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "What is 12 plus 30?",
    "Give one tip for writing clear code.",
    "Why is the sky blue? Answer in one sentence.",
    "Translate 'good morning' into Spanish.",
    "List the planets of the solar system in order from the sun.",
    "What does a bee make?",
    "Suggest a name for a pet cat.",
    "How many days are in a leap year?",
    "What is the opposite of hot?",
    "Describe a rainy day in two sentences.",
    "What language is spoken in Brazil?",
    "Give me a word that rhymes with moon.",
    "What is water made of?",
)
MAX_TOKENS = 32
EOS_TOKEN_ID = 2
KV_CACHE_BYTES = 64 * 2**20
MODES = {
    "eager": {"enforce_eager": True},
    "graphs": {
        "enforce_eager": False,
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"},
    },
}


def _engine(model: str, kind: str, mode: str) -> None:
    """Run one engine (in this process) and print its result as JSON."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
            return_dict=True,
        )["input_ids"]
        for q in QUESTIONS
    ]  # fmt: skip
    llm = LLM(
        model=model, dtype="bfloat16", max_model_len=2048, max_num_seqs=16, seed=0,
        kv_cache_dtype=kind, kv_cache_memory_bytes=KV_CACHE_BYTES, **MODES[mode],
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, stop_token_ids=[EOS_TOKEN_ID]
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    answers = []
    for output in outputs:
        completion = output.outputs[0]
        chosen = [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs)]
        answers.append({"tokens": list(completion.token_ids), "logprobs": chosen,
                        "text": tokenizer.decode(completion.token_ids, skip_special_tokens=True)})  # fmt: skip
    print("RESULT " + json.dumps({"answers": answers}), flush=True)


def run(model: str, kind: str, mode: str, bridge: bool) -> dict:
    """One engine in a fresh process; its answers and the KV capacity from its log."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("NPU_BRIDGE_DEVICE", None)
    if bridge:  # else vLLM's own CPU platform and CPU_ATTN
        env["NPU_BRIDGE_DEVICE"] = "cpu"
    proc = subprocess.run(
        [sys.executable, __file__, "--engine", model, kind, mode],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    result = json.loads(lines[-1][len("RESULT ") :])
    found = re.findall(r"KV cache size: ([\d,]+) tokens", proc.stdout + proc.stderr)
    result["kv_tokens"] = int(found[-1].replace(",", "")) if found else None
    return result


def compare(ours: dict, theirs: dict) -> tuple[float, float, int]:
    """(token agreement, mean |logprob difference| over agreeing prefixes, answers equal)."""
    same = total = equal = 0
    diffs: list[float] = []
    for a, b in zip(ours["answers"], theirs["answers"]):
        total += len(b["tokens"])
        equal += a["tokens"] == b["tokens"]
        for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
            same += x == y
            if a["tokens"][: i + 1] == b["tokens"][: i + 1]:
                diffs.append(abs(a["logprobs"][i] - b["logprobs"][i]))
    return same / max(total, 1), sum(diffs) / max(len(diffs), 1), equal


def main() -> None:
    if sys.argv[1:2] == ["--engine"]:
        _engine(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS[1:]))
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--cpu-attn", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from smollm2 import smollm2_checkpoint

    model = str(smollm2_checkpoint())
    results: dict[str, dict] = {}
    for mode in args.modes:
        for kind in ["auto", *args.kinds]:
            results[f"bridge/{kind}/{mode}"] = run(model, kind, mode, bridge=True)
    if args.cpu_attn:
        for kind in ["auto", *[k for k in args.kinds if k in CPU_ATTN_KINDS]]:
            results[f"cpu_attn/{kind}/eager"] = run(model, kind, "eager", bridge=False)
    print(
        f"{'run':44} {'kv tokens':>10} {'vs auto':>8} {'|dlogp|':>8} {'equal':>6} {'vs CPU_ATTN':>11}"
    )
    for name, result in results.items():
        if "error" in result:
            print(f"{name:44} ERROR {result['error'][-400:]}")
            continue
        source, kind, mode = name.split("/")
        base = results.get(f"{source}/auto/{mode}", {})
        agree, dlogp, equal = compare(result, base) if "answers" in base else (0, 0, 0)
        peer = results.get(f"cpu_attn/{kind}/eager") if source == "bridge" else None
        vs_peer = f"{compare(result, peer)[0]:.3f}" if peer and "answers" in peer else "-"
        print(
            f"{name:44} {result['kv_tokens']!s:>10} {agree:8.3f} {dlogp:8.4f} {equal:>3}/16 {vs_peer:>11}"
        )
    for name, result in results.items():
        if "answers" in result and name.endswith("/eager"):
            print(f"\n{name}:")
            for answer in result["answers"][:4]:
                print("  ", answer["text"].replace("\n", " ")[:100])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
