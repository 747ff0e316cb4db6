"""One data-parallel rank of a MoE engine in host mode (run as a script by
test_data_parallel_moe.py): ``dp_rank_runner.py SPEC.json RANK``.

The spec names the model, the DP size, the master port and every prompt (token ids);
rank ``r`` of ``n`` generates prompts ``r, r + n, ...`` greedily and prints
``RESULT {"tokens": [...]}``. vLLM's data parallelism runs one engine per rank, wired
by the ``VLLM_DP_*`` variables (vLLM's multi-process offline data-parallel setup).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


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

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=64 * 2**20,
        seed=0,
    )
    prompts = spec["prompts"][rank::size]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"]),
    )
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps({"tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
