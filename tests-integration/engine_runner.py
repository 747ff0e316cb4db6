"""Run one vLLM engine in this process and print what it did as one JSON line.

Used by the integration tests in a subprocess, since vLLM resolves its platform once
per process: ``NPU_BRIDGE_DEVICE=cpu`` selects the bridge's host platform, unset
leaves vLLM on its own CPU platform (CPU_ATTN).

    python engine_runner.py SPEC.json

SPEC: {"model": path, "engine": {LLM kwargs} (or "engines": [{LLM kwargs}, ...], run one
after the other in this process; an engine's own "model" replaces the spec's, and its
"probe", a module of this folder, is installed before it starts and read after its rounds
into the result's "probe"), "rounds": [[{"prompt": [ids],
"max_tokens": n, "stop_token_ids": [ids] (optional: without it, exactly max_tokens
tokens)}, ...], ...], "host_platform": {BridgeSettings field: value}}. Each round is one ``generate`` call; later rounds
reuse the prefix cache of earlier ones. Output line: ``RESULT {"tokens": [[...]
per round], "cached_tokens": [[prefix-cache hits per prompt] per round], "counters": {...}
(the first rank's model runner's graph counters), "states": {...}, "backend": name}``
(with several ranks also ``"rank_counters"``: each worker's counters and OpenMP binding) or
``RESULT {"error": "Type: message"}`` when the engine refuses to start; with "engines",
``RESULT {"runs": [one such object per engine]}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections import Counter
from pathlib import Path


def _record_plan_states(states: Counter) -> None:
    import npu_attention

    plan = npu_attention.plan

    def recording_plan(*args, **kwargs):
        result = plan(*args, **kwargs)
        states[result.state.name] += 1
        return result

    npu_attention.plan = recording_plan


def _bridge_counters(worker) -> dict:
    """A worker's bridge graph counters (its model runner's) and its process's vLLM
    capture count (called through ``collective_rpc``)."""
    from vllm.compilation.counter import compilation_counter

    return {
        "counters": worker.model_runner.graph_counters().as_dict(),
        "vllm_cudagraph_captured": compilation_counter.num_cudagraph_captured,
        "model_runner": type(worker.model_runner).__name__,
        "pcp_world_size": getattr(_pcp_manager(worker), "pcp_world_size", 1),
        # The OpenMP binding vLLM gave this process (set only in CPU worker processes).
        "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP_"))},
    }


def _pcp_manager(worker):
    """The V2 runner's prefill-context-parallel manager (None: no PCP, or V1)."""
    return getattr(getattr(worker, "model_runner", None), "pcp_manager", None)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    bridge = os.environ.get("NPU_BRIDGE_DEVICE") == "cpu"
    states: Counter = Counter()
    if bridge:
        _record_plan_states(states)
    from vllm import LLM  # noqa: F401  (before the platform's attributes are set)

    if bridge:
        from npu_vllm_bridge.host.platform import HostPlatform

        overrides = spec.get("host_platform", {})
        HostPlatform.bridge_settings = dataclasses.replace(
            HostPlatform.bridge_settings, **overrides
        )
    if "engines" not in spec:
        result, _ = _run_engine(spec, spec["engine"], bridge, states)
        print("RESULT " + json.dumps(result), flush=True)
        return
    # Several engines one after the other in this process (vLLM imported once); each
    # engine's workers are stopped before the next starts.
    runs = []
    for engine in spec["engines"]:
        states.clear()
        result, llm = _run_engine(spec, engine, bridge, states)
        runs.append(result)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
    print("RESULT " + json.dumps({"runs": runs}), flush=True)


def _run_engine(spec: dict, engine: dict, bridge: bool, states: Counter) -> tuple[dict, object]:
    """One engine's rounds: (result, the LLM, or None when it refused to start)."""
    import importlib

    from vllm import LLM, SamplingParams

    engine = dict(engine)
    model = engine.pop("model", spec["model"])
    probe = engine.pop("probe", None)
    probe = probe and importlib.import_module(probe)
    if probe:
        probe.install()
    try:
        llm = LLM(model=model, skip_tokenizer_init=True, **engine)
    except Exception as exc:  # the refusal under test
        if probe:
            probe.collect()
        return {"error": f"{type(exc).__name__}: {exc}"}, None
    tokens, cached = [], []
    for round_ in spec["rounds"]:
        prompts = [{"prompt_token_ids": item["prompt"]} for item in round_]
        params = [
            SamplingParams(
                max_tokens=item["max_tokens"],
                temperature=0.0,
                ignore_eos="stop_token_ids" not in item,
                stop_token_ids=item.get("stop_token_ids"),
            )
            for item in round_
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
        cached.append([o.num_cached_tokens or 0 for o in outputs])
    result = {"tokens": tokens, "cached_tokens": cached, "states": dict(states)}
    if probe:
        result["probe"] = probe.collect()
    result["omp_threads_bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    result["num_layers"] = layers
    if bridge:
        ranks = llm.collective_rpc(_bridge_counters)
        result.update(ranks[0])  # the first rank's (the only one in this process)
        if llm.llm_engine.vllm_config.parallel_config.world_size > 1:
            # Workers run in their own processes: each rank's counters.
            result["rank_counters"] = ranks
    from vllm.platforms import current_platform

    result["platform"] = type(current_platform).__name__
    return result, llm


if __name__ == "__main__":
    main()
