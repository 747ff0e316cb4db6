"""SmolLM2-135M-Instruct's greedy answers to sixteen chats, by hand, to compare vLLM builds.

    python tests-integration/chat_answers.py offline OUT.json [--eager]   # LLM.chat
    python tests-integration/chat_answers.py server OUT.json [--eager]    # OpenAI server
    python tests-integration/chat_answers.py compare REFERENCE.json OTHER.json...

Host mode, ``max_model_len`` 2048, ``max_num_seqs`` 16, float32, each answer up to 24
tokens or its end of turn; graphs at vLLM's defaults unless ``--eager``. The model
runner is vLLM's choice or ``VLLM_USE_V2_MODEL_RUNNER``. ``compare`` exits 1 unless every
answer of each OTHER equals REFERENCE's token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_prompts import MAX_TOKENS, QUESTIONS, messages

MORE_QUESTIONS = (
    "What is the boiling point of water at sea level?",
    "Suggest a name for a friendly robot.",
    "How many days are in a leap year?",
    "Describe a cat in five words.",
    "What does a compiler do?",
    "Name a fruit that is yellow.",
    "Write one sentence about autumn.",
    "What is the opposite of cold?",
)
CHATS = QUESTIONS + MORE_QUESTIONS  # sixteen: max_num_seqs at once
ENGINE = dict(dtype="float32", max_model_len=2048, max_num_seqs=16, seed=0)


def _offline(model: Path, eager: bool) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), gpu_memory_utilization=0.1, enforce_eager=eager, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs = llm.chat([messages(q) for q in CHATS], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _served(model: Path, eager: bool, log: Path) -> list[list[int]]:
    from servers import serve

    args = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16"]
    args += ["--gpu-memory-utilization", "0.1", "--seed", "0"] + (["--enforce-eager"] * eager)

    def chat(server, question: str) -> list[int]:
        body = {
            "model": server.model,
            "messages": messages(question),
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        status, reply = server.post("/v1/chat/completions", json.dumps(body).encode())
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {reply}")
        return reply["choices"][0]["token_ids"]

    with serve(model, args, log) as server, ThreadPoolExecutor(len(CHATS)) as pool:
        return list(pool.map(lambda question: chat(server, question), CHATS))


def _compare(reference: Path, others: list[Path]) -> int:
    expected = json.loads(reference.read_text())["answers"]
    failed = 0
    for other in others:
        answers = json.loads(other.read_text())["answers"]
        differ = [i for i, (a, b) in enumerate(zip(answers, expected)) if a != b]
        differ += list(range(min(len(answers), len(expected)), max(len(answers), len(expected))))
        print(f"{other}: {len(expected) - len(differ)} of {len(expected)} equal {reference}")
        failed += bool(differ)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["offline", "server", "compare"])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    if args.what == "compare":
        return _compare(args.paths[0], args.paths[1:])
    os.environ["NPU_BRIDGE_DEVICE"] = "cpu"
    from smollm2 import smollm2_checkpoint

    model = smollm2_checkpoint()
    out = args.paths[0]
    if args.what == "offline":
        answers = _offline(model, args.eager)
    else:
        answers = _served(model, args.eager, out.with_suffix(".log"))
    import vllm

    out.write_text(json.dumps({"vllm": vllm.__version__, "answers": answers}))
    print(f"{out}: {len(answers)} answers, vLLM {vllm.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
