"""``engine_runner.py`` for host mode on vLLM's Model Runner V2.

Same spec and output, with one more result field, ``"model_runners"`` (the bridge's
model runner classes this process built), and with ``NPU_BRIDGE_TEST_SKIP_TASK_UPDATES=1``
the V2 graph manager replays its FULL graphs without updating their attention tasks
(the stale-update control; ``"skipped_task_updates"`` counts them).

    python v2_runner.py SPEC.json
"""

from __future__ import annotations

import os

import engine_runner

SKIP_UPDATES_ENV = "NPU_BRIDGE_TEST_SKIP_TASK_UPDATES"


def main() -> None:
    built: list[str] = []
    skipped: list[object] = []
    record_model_runners(built)
    if os.environ.get(SKIP_UPDATES_ENV) == "1":
        from npu_vllm_bridge.graphs.full_graphs import FullGraphs

        def replay_without_update(self, key, attn_metadata, *args, **kwargs):
            skipped.append(key)
            return self.graphs.replay(key, *args, **kwargs)

        FullGraphs.replay = replay_without_update
    counters = engine_runner._bridge_counters

    def counters_and_runners(worker) -> dict:
        return {**counters(worker), "model_runners": built, "skipped_task_updates": len(skipped)}

    engine_runner._bridge_counters = counters_and_runners
    engine_runner.main()


def record_model_runners(built: list[str]) -> None:
    """Append the class name of every model runner the host worker builds to ``built``."""
    from npu_vllm_bridge.host.worker import HostWorker

    make_runner = HostWorker._bridge_model_runner

    def recording_make_runner(worker):
        runner = make_runner(worker)
        built.append(type(runner).__name__)
        return runner

    HostWorker._bridge_model_runner = recording_make_runner


if __name__ == "__main__":
    main()
