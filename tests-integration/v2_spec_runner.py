"""``spec_runner.py`` for host mode on vLLM's Model Runner V2.

Same spec and output, with more result fields:

* ``"model_runners"``: the bridge's model runner classes this engine built;
* ``"drafts"``: per proposal of the EAGLE / MTP / ngram drafter while the engine
  generated, the draft tokens of each request of the batch (``[[token, ...], ...]``,
  batch order);
* ``"rule_drafts"``: for the ngram drafter, per proposal, the drafts its documented rule
  gives on each request's token history at that step (:func:`ngram_drafts_by_rule`);
* an engine's ``"skip_draft_updates": true`` makes the drafter's FULL replays (V2's
  ``BridgeSpeculatorGraphManager``) skip their task update (``"skipped_draft_updates"``
  counts them), the stale-update control.

    python v2_spec_runner.py SPEC.json
"""

from __future__ import annotations

import functools
import inspect

import spec_runner
from v2_runner import record_model_runners


def main() -> None:
    from vllm import LLM
    from vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator import (
        MultiModuleMTPSpeculator,
    )
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (
        TargetDependentARSpeculator,
    )

    built: list[str] = []
    drafts: list[list[list[int]]] = []
    rule_drafts: list[list[list[int]]] = []
    generating: list[bool] = []

    record_model_runners(built)

    for cls in (TargetDependentARSpeculator, MultiModuleMTPSpeculator):
        cls.propose = _recording_propose(cls.propose, drafts, generating)
    NgramGPUSpeculator.propose = _recording_propose(
        NgramGPUSpeculator.propose, drafts, generating, rule_drafts
    )

    generate = LLM.generate

    def generate_recording_drafts(self, *args, **kwargs):
        generating.append(True)
        try:
            return generate(self, *args, **kwargs)
        finally:
            generating.clear()

    LLM.generate = generate_recording_drafts

    run_engine = spec_runner._run_engine

    def run_engine_with_v2_fields(*args, **kwargs) -> dict:
        built.clear()
        drafts.clear()
        rule_drafts.clear()
        result = run_engine(*args, **kwargs)
        return {
            **result,
            "model_runners": list(built),
            "drafts": list(drafts),
            "rule_drafts": list(rule_drafts),
        }

    spec_runner._run_engine = run_engine_with_v2_fields
    spec_runner._skip_draft_updates = _skip_v2_draft_updates
    spec_runner.main()


def _recording_propose(propose, drafts: list, generating: list, rule_drafts: list | None = None):
    signature = inspect.signature(propose)

    @functools.wraps(propose)  # the bridge's hook reads propose's signature
    def recording_propose(self, *args, **kwargs):
        recording = generating and not kwargs.get("dummy_run", False)
        if recording and rule_drafts is not None:
            arguments = signature.bind(self, *args, **kwargs).arguments
            rule_drafts.append(_ngram_rule_drafts(self, **arguments))
        tokens = propose(self, *args, **kwargs)
        if recording:
            drafts.append(tokens.tolist())
        return tokens

    return recording_propose


def _ngram_rule_drafts(speculator, input_batch, num_sampled, last_sampled, **_) -> list:
    """What :func:`ngram_drafts_by_rule` drafts for each request of the batch, from the
    token histories vLLM's ngram speculator reads (its request states)."""
    states = speculator.req_states
    lengths = states.total_len.gpu.tolist()
    last = last_sampled.view(-1).tolist()
    return [
        ngram_drafts_by_rule(
            states.all_token_ids.gpu[state, : lengths[state]].tolist(),
            int(num_sampled[row]),
            last[state],
            speculator.min_n,
            speculator.max_n,
            speculator.num_speculative_steps,
        )
        for row, state in enumerate(input_batch.idx_mapping.tolist())
    ]


def ngram_drafts_by_rule(
    history: list[int], num_sampled: int, last: int, min_n: int, max_n: int, k: int
) -> list[int]:
    """vLLM's ngram drafting rule on Model Runner V2, from its documentation: the
    longest suffix of ``min_n`` to ``max_n`` tokens that occurred before (ending before
    the suffix itself), at its rightmost occurrence; the ``k`` tokens that followed it,
    the last sampled token where the history ends first; without a match, or when
    the request sampled nothing, ``k`` times the last sampled token."""
    if num_sampled > 0:
        for n in range(max_n, min_n - 1, -1):
            for pos in range(len(history) - n - 1, -1, -1):
                if history[pos : pos + n] == history[len(history) - n :]:
                    follows = history[pos + n : pos + n + k]
                    return follows + [last] * (k - len(follows))
    return [last] * k


def _skip_v2_draft_updates(skipped: list[int]):
    """The drafter's graph components replay without re-issuing their tasks (the task
    registry's update does nothing during a drafter replay that has tasks); returns the
    function that puts the update back."""
    from npu_graphs import TaskRegistry
    from npu_vllm_bridge.graphs.full_graphs import DRAFTER, FullGraphs

    replay, update = FullGraphs.replay, TaskRegistry.update

    def replay_skipping_update(self, key, attn_metadata, *args, **kwargs):
        if self.role != DRAFTER or not self.tasks.num_tasks(key):
            return replay(self, key, attn_metadata, *args, **kwargs)
        skipped.append(1)
        TaskRegistry.update = lambda registry, key, step: None
        try:
            return replay(self, key, attn_metadata, *args, **kwargs)
        finally:
            TaskRegistry.update = update

    def restore() -> None:
        FullGraphs.replay = replay

    FullGraphs.replay = replay_skipping_update
    return restore


if __name__ == "__main__":
    main()
