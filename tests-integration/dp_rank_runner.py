"""One data-parallel rank of a MoE engine in host mode (run as a script by
test_data_parallel_moe.py): ``dp_rank_runner.py SPEC.json RANK``.

The spec names the model, the DP size, the master port and every prompt (token ids);
rank ``r`` of ``n`` generates prompts ``r, r + n, ...`` greedily and prints
``RESULT {"tokens": [...], "logprobs": [...], "counters": {...}}`` (each sampled
token's logprob; the bridge's graph and micro-batch counters of the rank). vLLM's data
parallelism runs one engine per rank, wired by the ``VLLM_DP_*`` variables (vLLM's
multi-process offline data-parallel setup). Optional spec keys: ``max_tokens`` as one
count per prompt, ``engine`` (more ``LLM`` arguments, e.g. ``enable_dbo``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _worker_counters(worker) -> dict:
    """The bridge's graph and micro-batch counters of the worker's model runner."""
    return worker.model_runner.graph_counters().as_dict()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank, size = int(sys.argv[2]), spec["dp_size"]
    if size > 1:
        os.environ.update(
            VLLM_DP_RANK=str(rank),
            VLLM_DP_RANK_LOCAL=str(rank),
            VLLM_DP_SIZE=str(size),
            VLLM_DP_MASTER_IP="127.0.0.1",
            VLLM_DP_MASTER_PORT=str(spec["port"]),
        )
    from vllm import LLM, SamplingParams

    engine = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "skip_tokenizer_init": True,
        "kv_cache_memory_bytes": 64 * 2**20,
        "seed": 0,
        **spec.get("engine", {}),
    }
    llm = LLM(model=spec["model"], **engine)
    prompts = spec["prompts"][rank::size]
    max_tokens = spec["max_tokens"]
    counts = max_tokens[rank::size] if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=n, logprobs=1) for n in counts],
    )
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [step[token].logprob for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outputs
    ]
    # The worker may be a process of its own (vLLM's DP ranks run the mp executor).
    counters = llm.collective_rpc(_worker_counters)[0]
    result = {"tokens": tokens, "logprobs": logprobs, "counters": counters}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
