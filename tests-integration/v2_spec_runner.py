"""``spec_runner.py`` for host mode on vLLM's Model Runner V2.

Same spec and output, with more result fields:

* ``"model_runners"``: the bridge's model runner classes this engine built;
* ``"drafts"``: per proposal of the EAGLE / MTP drafter while the engine generated, the
  draft tokens of each request of the batch (``[[token, ...], ...]``, batch order);
* an engine's ``"skip_draft_updates": true`` makes the drafter's FULL replays (V2's
  ``BridgeSpeculatorGraphManager``) skip their task update (``"skipped_draft_updates"``
  counts them), the stale-update control.

    python v2_spec_runner.py SPEC.json
"""

from __future__ import annotations

import functools

import spec_runner
from v2_runner import record_model_runners


def main() -> None:
    from vllm import LLM
    from vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator import (
        MultiModuleMTPSpeculator,
    )
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (
        TargetDependentARSpeculator,
    )

    built: list[str] = []
    drafts: list[list[list[int]]] = []
    generating: list[bool] = []

    record_model_runners(built)

    for cls in (TargetDependentARSpeculator, MultiModuleMTPSpeculator):
        cls.propose = _recording_propose(cls.propose, drafts, generating)

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
        result = run_engine(*args, **kwargs)
        return {**result, "model_runners": list(built), "drafts": list(drafts)}

    spec_runner._run_engine = run_engine_with_v2_fields
    spec_runner._skip_draft_updates = _skip_v2_draft_updates
    spec_runner.main()


def _recording_propose(propose, drafts: list, generating: list):
    @functools.wraps(propose)  # the bridge's hook reads propose's signature
    def recording_propose(self, *args, **kwargs):
        tokens = propose(self, *args, **kwargs)
        if generating and not kwargs.get("dummy_run", False):
            drafts.append(tokens.tolist())
        return tokens

    return recording_propose


def _skip_v2_draft_updates(skipped: list[int]):
    """The drafter's managers replay without re-issuing their tasks; returns the
    function that puts the update back."""
    from npu_vllm_bridge.graphs.v2_draft_graphs import BridgeSpeculatorGraphManager

    update = BridgeSpeculatorGraphManager._update_tasks

    def skip(self, desc, attn_metadata) -> None:
        skipped.append(1)

    def restore() -> None:
        BridgeSpeculatorGraphManager._update_tasks = update

    BridgeSpeculatorGraphManager._update_tasks = skip
    return restore


if __name__ == "__main__":
    main()
