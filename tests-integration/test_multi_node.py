"""Multi-node serving through vLLM's own machinery, in host mode: two "nodes" on
127.0.0.1, one rank each, started as a user starts them (``nodes.py``): the leader
serves the OpenAI API, the follower runs ``--headless``; ``--nnodes 2``, the master
address and port, ``VLLM_HOST_IP`` on both; ranks meet over gloo.

TP=2 and PP=2, eagerly and with FULL_DECODE_ONLY host graphs, on the tiny Llama with a
word-level tokenizer: four greedy completions sent at once must give transformers'
tokens (float32, one prompt at a time). With ``VLLM_CPU_OMP_THREADS_BIND`` unset, each
node has one worker, so the bridge leaves vLLM's ``auto`` binding, which gives that
worker its node's cores less the ones vLLM keeps for its own processes, as each node's
log must show; with graphs, each rank's counters (``NPU_BRIDGE_COUNTERS_DIR``) show
replays. Once stopped, neither node's process group may hold a live process.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from checkpoints import hf_greedy, write_checkpoint, write_word_tokenizer
from nodes import live_members, logged_binding, serve_two_nodes
from servers import Server

from npu_vllm_bridge.graphs.counters import COUNTERS_DIR_ENV

VOCAB_SIZE = 512
# Random prompts over 1-5 KV blocks; none meets the end-of-sequence token (2) within
# its budget (vLLM ignores it, transformers suppresses it).
_RNG = random.Random(0)
PROMPTS = tuple([_RNG.randrange(3, 500) for _ in range(n)] for n in (6, 40, 130, 3))
MAX_TOKENS = (10, 6, 8, 12)  # the decode batch shrinks as requests finish
SERVER_ARGS = [
    "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8",
    "--kv-cache-memory-bytes", str(64 * 2**20), "--seed", "0",
]  # fmt: skip
LAYOUTS = {"TP=2": ["--tensor-parallel-size", "2"], "PP=2": ["--pipeline-parallel-size", "2"]}
GRAPHS = {
    "eager": ["--enforce-eager"],
    "FULL_DECODE_ONLY": [
        "--compilation-config",
        json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY"}),
    ],
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama with a word-level tokenizer, and transformers' greedy answers."""
    model = write_checkpoint("llama", tmp_path_factory.mktemp("nodes") / "llama")
    write_word_tokenizer(model, VOCAB_SIZE)
    return model, hf_greedy(model, list(PROMPTS), list(MAX_TOKENS))


def _complete(server: Server, index: int) -> list[int]:
    body = {
        "model": server.model,
        "prompt": " ".join(f"t{token}" for token in PROMPTS[index]),
        "max_tokens": MAX_TOKENS[index],
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, reply = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["prompt_token_ids"] == PROMPTS[index], choice  # the word tokenizer's
    return choice["token_ids"]


def _physical_cores(cpus: list[int]) -> set[int]:
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

    core_of = {cpu.id: cpu.physical_core for cpu in get_allowed_cpu_list()}
    return {core_of[cpu] for cpu in cpus}


def _first_numa_node_cpus() -> list[int]:
    """The CPUs of the first NUMA node this process may use: what vLLM's ``auto``
    binding gives a node's only worker (every CPU of a host of one NUMA node)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_visible_memory_node

    first = get_visible_memory_node()[0]
    return [cpu.id for cpu in get_allowed_cpu_list() if cpu.numa_node == first]


def _check_node_binding(log) -> None:
    """One worker on the node, bound by vLLM's ``auto`` to the node's cores (both nodes
    run on this host) less those vLLM reserves for its own processes."""
    binding = logged_binding(log)
    summary = f"{log.name}: {binding}"
    assert binding.mask == "auto", summary  # one rank per node: the bridge sets nothing
    assert binding.local_world_size == 1 and list(binding.ranks) == [0], summary
    worker = binding.ranks[0]
    assert worker and not set(worker) & set(binding.reserved), summary
    node_cores = _physical_cores(_first_numa_node_cpus())
    assert _physical_cores(worker + binding.reserved) == node_cores, summary


# Graph modes and layouts meet in test_tensor_parallel; across nodes CI runs each
# layout once, TP=2 with graphs and PP=2 eagerly, and leaves the other pairs extended.
NODE_CASES = [
    pytest.param(layout, graphs, id=f"{layout}-{graphs}", marks=marks)
    for layout, graphs, marks in (
        ("TP=2", "FULL_DECODE_ONLY", ()),
        ("PP=2", "eager", ()),
        ("TP=2", "eager", pytest.mark.extended),
        ("PP=2", "FULL_DECODE_ONLY", pytest.mark.extended),
    )
]


@pytest.mark.parametrize(("layout", "graphs"), NODE_CASES)
def test_two_nodes_equal_transformers(llama, tmp_path, layout, graphs):
    model, hf = llama
    counters = tmp_path / "counters"
    counters.mkdir()
    env = {COUNTERS_DIR_ENV: str(counters)}
    args = SERVER_ARGS + LAYOUTS[layout] + GRAPHS[graphs]
    unset = ("VLLM_CPU_OMP_THREADS_BIND",)  # the default binding under test
    with (
        serve_two_nodes(model, args, tmp_path, env, unset) as nodes,
        ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool,
    ):
        tokens = list(pool.map(lambda i: _complete(nodes.server, i), range(len(PROMPTS))))
    assert nodes.left_after_sigterm == [], "alive after SIGTERM, killed"
    for group in nodes.groups:
        assert live_members(group) == [], f"left running: {live_members(group)}"
    assert tokens == hf
    for log in nodes.logs:
        _check_node_binding(log)
    for rank in (0, 1):  # rank 1's worker runs on the follower
        ran = json.loads((counters / f"dp0-rank{rank}.json").read_text())
        if graphs == "eager":
            assert ran["captured"] == 0 and ran["replayed_steps"] == 0, (rank, ran)
        else:
            assert ran["captured"] >= 1 and ran["replayed_steps"] >= 1, (rank, ran)
