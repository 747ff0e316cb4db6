"""Run several vLLM engines one after another in this process and print, per engine,
its greedy tokens, speculative-decoding statistics and the bridge's graph counters.

Used by ``test_spec_decode.py`` in a subprocess (vLLM resolves its platform once per
process; ``NPU_BRIDGE_DEVICE=cpu`` selects the bridge's host platform). One process
for several engines saves the start-up of Python, torch and vLLM per configuration.

    python spec_runner.py SPEC.json

SPEC: {"model": path, "prompts": [[ids], ...], "max_tokens": [n per prompt], "engines": {name:
{LLM kwargs}}}; an engine's ``"skip_draft_updates": true`` (not an LLM kwarg) makes the
drafter's FULL replays skip their task update (V2 only: ``v2_spec_runner.py``); its ``"model"``, ``"prompts"`` and
``"max_tokens"`` replace the spec's. Output: one line per engine, ``RESULT {"name": ..., "tokens": [[...]],
"spec": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
"accepted_per_position"}, "counters": {...}, "states": {...}}``, or with
``"error"`` when the engine refuses to start.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
from collections import Counter
from pathlib import Path

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def spec_decode_stats(llm) -> dict:
    """vLLM's cumulative acceptance counters (this process, every engine so far)."""
    from vllm.v1.metrics.reader import Counter as MetricCounter
    from vllm.v1.metrics.reader import Vector

    stats: dict = {name: 0 for name in SPEC_COUNTERS.values()}
    stats["accepted_per_position"] = []
    for metric in llm.get_metrics():
        if isinstance(metric, MetricCounter) and metric.name in SPEC_COUNTERS:
            stats[SPEC_COUNTERS[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name.startswith(
            "vllm:spec_decode_num_accepted_tokens_per_pos"
        ):
            stats["accepted_per_position"] = list(metric.values)
    return stats


def _difference(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    per_pos_before = before["accepted_per_position"]
    out["accepted_per_position"] = [
        a - (per_pos_before[i] if i < len(per_pos_before) else 0)
        for i, a in enumerate(after["accepted_per_position"])
    ]
    return out


def _record_plan_states(states: Counter) -> None:
    import npu_attention

    plan = npu_attention.plan

    def recording_plan(*args, **kwargs):
        result = plan(*args, **kwargs)
        states[result.state.name] += 1
        return result

    npu_attention.plan = recording_plan


def _graph_counters(worker) -> dict:
    """The worker's model runner's graph counters (the drafter's graphs too)."""
    return worker.model_runner.graph_counters().as_dict()


def run_one(name: str, spec: dict, engine: dict, states: Counter) -> dict:
    states.clear()
    gc.collect()  # the previous engine's graph wrappers leave the bridge's weak set
    engine = dict(engine)
    skipped: list[int] = []
    restore = _skip_draft_updates(skipped) if engine.pop("skip_draft_updates", False) else None
    try:
        return _run_engine(name, spec, engine, states, skipped)
    finally:
        if restore is not None:
            restore()


def _run_engine(name: str, spec: dict, engine: dict, states: Counter, skipped: list) -> dict:
    from vllm import LLM, SamplingParams

    spec = {
        **spec,
        **{key: engine.pop(key) for key in ("model", "prompts", "max_tokens") if key in engine},
    }
    try:
        llm = LLM(model=spec["model"], skip_tokenizer_init=True, disable_log_stats=False, **engine)
    except Exception as exc:  # a refusal under test
        return {"name": name, "error": f"{type(exc).__name__}: {exc}"}
    before = spec_decode_stats(llm)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["max_tokens"]
    ]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "name": name,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "spec": _difference(spec_decode_stats(llm), before),
        "counters": llm.collective_rpc(_graph_counters)[0],
        "states": dict(states),
        "skipped_draft_updates": len(skipped),
    }
    del llm, outputs
    gc.collect()
    return result


def _skip_draft_updates(skipped: list[int]):
    """A runner that forgets the drafter's task update (``v2_spec_runner.py`` puts V2's
    here); V1's drafters run as vLLM dispatches them, with no graph of the bridge's."""
    raise ValueError(
        "skip_draft_updates needs Model Runner V2's drafter graphs (v2_spec_runner.py)"
    )


def _register_triton_overrides_once() -> None:
    """vLLM's CPU worker rebinds Triton kernels to CPU ones at each worker start; a
    third engine in one process fails to rebind what is already rebound (its
    ``_rebind_kernels``), so only the first engine does it."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    register = platform.register_triton_kernel_overrides
    done = []

    def once() -> None:
        if not done:
            done.append(True)
            register()

    platform.register_triton_kernel_overrides = staticmethod(once)


def _override_host_settings(overrides: dict) -> None:
    """Replace fields of the host platform's ``BridgeSettings`` (``{field: value}``)."""
    from npu_vllm_bridge.host.platform import HostPlatform

    HostPlatform.bridge_settings = dataclasses.replace(HostPlatform.bridge_settings, **overrides)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    states: Counter = Counter()
    _record_plan_states(states)
    _register_triton_overrides_once()
    _override_host_settings(spec.get("host_platform", {}))
    for name, engine in spec["engines"].items():
        result = run_one(name, spec, engine, states)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
