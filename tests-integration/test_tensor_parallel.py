"""vLLM's own tensor and pipeline parallelism in host mode: two ranks over gloo, through
the bridge.

A tiny random Llama whose head counts split evenly over two ranks (4 query heads, 2 KV
heads) answers greedily with ``tensor_parallel_size=2`` and with
``pipeline_parallel_size=2`` (one decoder layer per rank), eager and with
FULL_DECODE_ONLY host graphs; the tokens must equal transformers' (float32, one prompt
at a time, one rank). ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is enough: the engine stays in
the test's process and vLLM's multiprocess executor starts one worker per rank.

``VLLM_CPU_OMP_THREADS_BIND`` is removed from the engine's environment: with fewer NUMA
nodes than ranks vLLM's ``auto`` binding refuses to start, so the host platform sets
one CPU share per rank, which the workers must receive.
"""

from __future__ import annotations

import os
import random

import pytest
from checkpoints import hf_greedy, write_checkpoint
from engines import TWO_RANK_KV_CACHE_BYTES, run_engine

from npu_vllm_bridge.host.platform import omp_threads_bind

# Random prompts over 1-5 KV blocks of 32 tokens. None of them meets the end-of-sequence
# token (2) within its budget: vLLM generates past it (ignore_eos) while transformers
# (min_new_tokens) suppresses it, so such a prompt would differ by construction.
_RNG = random.Random(0)
PROMPTS = tuple([_RNG.randrange(3, 500) for _ in range(n)] for n in (6, 40, 130))
MAX_TOKENS = (10, 6, 8)  # the decode batch shrinks as requests finish
LAYOUTS = {"TP=2": {"tensor_parallel_size": 2}, "PP=2": {"pipeline_parallel_size": 2}}
TWO_RANK_ENGINE = dict(
    max_model_len=512,
    # Each rank's KV cache at a fixed size: a share of host memory (gpu_memory_utilization)
    # is a share of the rank's NUMA node, which on a host of several nodes can be less
    # than the worker process itself already holds.
    kv_cache_memory_bytes=TWO_RANK_KV_CACHE_BYTES,
)
GRAPH_MODES = {
    "eager": {"enforce_eager": True},
    "FULL_DECODE_ONLY": {
        "enforce_eager": False,
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"},
    },
}


def _numa_nodes() -> list[int]:
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    return get_visible_memory_node()


def _cpu_binding(omp_env: dict[str, str]) -> str:
    """The CPU list vLLM bound a worker's OpenMP threads to, whatever the runtime."""
    return "".join(omp_env.get(k, "") for k in ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"))


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    """The tiny Llama and transformers' greedy answers."""
    model = write_checkpoint("llama", tmp_path_factory.mktemp("tp") / "llama")
    return model, hf_greedy(model, list(PROMPTS), list(MAX_TOKENS))


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("mode", list(GRAPH_MODES.values()), ids=list(GRAPH_MODES))
def test_two_ranks_equal_transformers(tp_model, tmp_path, mode, layout):
    model, hf = tp_model
    rounds = [[{"prompt": p, "max_tokens": m} for p, m in zip(PROMPTS, MAX_TOKENS)]]
    result = run_engine(
        model,
        rounds,
        bridge=True,
        tmp_path=tmp_path,
        unset_env=("VLLM_CPU_OMP_THREADS_BIND",),
        **TWO_RANK_ENGINE,
        **layout,
        **mode,
    )
    assert "error" not in result, result["error"]
    assert result["platform"] == "HostPlatform"
    # One CPU share per rank (the default, or vLLM's auto binding on several NUMA nodes),
    # in the form of whichever OpenMP runtime vLLM found (GNU, Intel or the standard).
    binds = [_cpu_binding(rank["omp_env"]) for rank in result["rank_counters"]]
    assert len(binds) == 2 and all(binds) and binds[0] != binds[1], result["rank_counters"]
    if len(_numa_nodes()) < 2:  # vLLM's auto binding cannot apply: the default did
        assert result["omp_threads_bind"] == omp_threads_bind(sorted(os.sched_getaffinity(0)), 2)
    if mode.get("compilation_config"):
        for rank in result["rank_counters"]:
            assert rank["counters"]["replayed_steps"] > 0, rank
            assert rank["vllm_cudagraph_captured"] > 0, rank
    assert result["tokens"] == [hf]


@pytest.mark.parametrize(
    ("cpus", "ranks", "expected"),
    [
        ([0, 1], 2, "0|1"),
        ([3, 0, 1, 2], 2, "0,1|2,3"),
        ([0, 1, 2, 3, 4], 2, "0,1,2|3,4"),
        ([0, 1, 2, 3, 4, 5, 6, 7], 4, "0,1|2,3|4,5|6,7"),
        ([5], 2, "5|5"),  # fewer CPUs than ranks: shared
        ([0, 1], 1, "0,1"),
    ],
)
def test_omp_threads_bind_gives_each_rank_its_share(cpus, ranks, expected):
    assert omp_threads_bind(cpus, ranks) == expected


@pytest.mark.parametrize(("cpus", "ranks", "match"), [([0, 1], 0, "ranks"), ([], 2, "cpus")])
def test_omp_threads_bind_refuses_bad_input(cpus, ranks, match):
    with pytest.raises(ValueError, match=match):
        omp_threads_bind(cpus, ranks)


def test_default_bind_only_when_unset_and_several_ranks(monkeypatch):
    """The default is set for two ranks on one NUMA node, kept when the user set it,
    and not set for one rank."""
    import vllm.utils.cpu_resource_utils as cpu_utils

    from npu_vllm_bridge.host import platform as host_platform

    monkeypatch.setattr(cpu_utils, "get_visible_memory_node", lambda: [0])
    monkeypatch.delenv(host_platform.OMP_THREADS_BIND, raising=False)
    host_platform._default_omp_threads_bind(1)
    assert host_platform.OMP_THREADS_BIND not in os.environ
    host_platform._default_omp_threads_bind(2)
    cpus = sorted(os.sched_getaffinity(0))
    assert os.environ[host_platform.OMP_THREADS_BIND] == omp_threads_bind(cpus, 2)
    monkeypatch.setenv(host_platform.OMP_THREADS_BIND, "nobind")
    host_platform._default_omp_threads_bind(2)
    assert os.environ[host_platform.OMP_THREADS_BIND] == "nobind"
    # One NUMA node per rank: vLLM's own auto binding applies.
    monkeypatch.delenv(host_platform.OMP_THREADS_BIND)
    monkeypatch.setattr(cpu_utils, "get_visible_memory_node", lambda: [0, 1])
    host_platform._default_omp_threads_bind(2)
    assert host_platform.OMP_THREADS_BIND not in os.environ
