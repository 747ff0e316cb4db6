"""Where the bridge's plans send padding slots (``-1``).

vLLM's dummy runs (warm-up, memory profile, graph capture) and FULL-graph padding give
tokens slot ``-1``; under decode context parallelism so do the tokens another rank keeps.
vLLM's ``BlockPool`` keeps block 0 as its null block: no request's keys live there, and
the block-table rows of graph padding requests point at it. The bridge plans every step
with npu-attention's ``slot_handling="device"``: slot values stay on the device, and a
provider whose KV write cannot skip a ``-1`` slot (``ascend``, whose
``npu_scatter_pa_kv_cache`` documents slots in ``[0, N)`` only) writes those rows into
the null block. Every step then writes the same rows of the same tensors, as a graph
task re-issued with new host arguments needs; providers that skip ``-1`` slots
themselves (``reference``, ``triton``) still skip them. The null block has
``block_size`` rows and a step may hold more padding tokens (a FULL graph over 128
tokens; under DCP about half of a prefill's tokens), so the ascend providers issue the
write in calls of at most ``block_size`` tokens, each naming a slot once
(``npu_attention.providers.ascend.write_chunks``).
"""

from __future__ import annotations

from typing import Any

NULL_BLOCK = 0
SLOT_HANDLING: dict[str, Any] = {"slot_handling": "device", "null_block": NULL_BLOCK}
