"""vLLM attention backends over npu-attention: ``backend`` (the classes vLLM selects),
``builder`` / ``mla_builder`` (one plan per step), ``impl`` / ``mla_impl`` (one layer),
``tasks`` (each op as an updatable graph task), ``capabilities`` (what they serve).

Nothing is imported here: the platform modules import ``capabilities`` while vLLM
resolves its platform, before the backend's vLLM modules can load.
"""
