"""Start-up checks of speculative decoding: what runs is accepted, the rest refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tiny_configs import write_config
from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig

from npu_vllm_bridge.platforms import checks
from npu_vllm_bridge.platforms.speculative import check_speculative


def _model(path, dtype="float32", **fields) -> ModelConfig:
    return ModelConfig(
        model=write_config(path, **{"head_dim": 64, **fields}),
        skip_tokenizer_init=True,
        dtype=dtype,
    )


def _config(target: ModelConfig, method: str, k: int = 2, draft: ModelConfig | None = None, **more):
    """What the checks read of a VllmConfig with a SpeculativeConfig (a real one loads
    the draft and checks it against the target's architecture)."""
    speculative = SimpleNamespace(
        method=method,
        num_speculative_tokens=k,
        draft_model_config=draft,
        parallel_drafting=more.pop("parallel_drafting", False),
        uses_dynamic_speculative_decoding=lambda: more.get("dynamic", False),
    )
    return SimpleNamespace(model_config=target, speculative_config=speculative)


def test_ngram_passes_the_startup_checks(tmp_path):
    target = _model(tmp_path / "target")
    speculative = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1
    )
    config = VllmConfig(model_config=target, speculative_config=speculative)
    checks.check_model_and_options(config)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_draft_heads_with_the_targets_layout_are_accepted(tmp_path, method):
    target = _model(tmp_path / "target")
    draft = _model(tmp_path / "draft", num_hidden_layers=1)
    check_speculative(_config(target, method, draft=draft))


def test_no_speculation_is_accepted(tmp_path):
    check_speculative(SimpleNamespace(model_config=None, speculative_config=None))


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("medusa", "does not support speculative decoding method 'medusa'"),
        ("suffix", "does not support speculative decoding method 'suffix'"),
        ("ngram_gpu", "does not support speculative decoding method 'ngram_gpu'"),
    ],
)
def test_other_methods_are_refused(tmp_path, method, message):
    with pytest.raises(ValueError, match=message):
        check_speculative(_config(_model(tmp_path / "target"), method))


def test_too_many_speculative_tokens_are_refused(tmp_path):
    check_speculative(_config(_model(tmp_path / "target"), "ngram", k=15))
    with pytest.raises(
        ValueError, match=r"at most 15 speculative tokens.*got num_speculative_tokens=16"
    ):
        check_speculative(_config(_model(tmp_path / "target"), "ngram", k=16))


def test_dynamic_and_parallel_drafting_are_refused(tmp_path):
    target = _model(tmp_path / "target")
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        check_speculative(_config(target, "ngram", dynamic=True))
    with pytest.raises(ValueError, match="parallel drafting"):
        check_speculative(_config(target, "draft_model", parallel_drafting=True))


def test_draft_with_another_kv_cache_dtype_is_refused(tmp_path):
    target = _model(tmp_path / "target")
    draft = _model(tmp_path / "draft", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"KV cache must have the target's dtype"):
        check_speculative(_config(target, "draft_model", draft=draft))


def test_draft_with_another_kv_cache_layout_is_refused(tmp_path):
    """An MLA draft (latent cache) for a paged-K/V target."""
    target = _model(tmp_path / "target")
    draft = SimpleNamespace(model="mla-draft", use_mla=True, dtype=target.dtype)
    with pytest.raises(
        ValueError, match=r"keeps an MLA latent cache but the target .* keeps paged K/V"
    ):
        check_speculative(_config(target, "eagle", draft=draft))


def test_draft_head_size_the_provider_lacks_is_refused(tmp_path):
    target = _model(tmp_path / "target")
    draft = _model(tmp_path / "draft", head_dim=48)
    with pytest.raises(
        ValueError,
        match=r"head size 48 \(the .* draft .*\) with the 'reference' attention provider",
    ):
        check_speculative(_config(target, "eagle", draft=draft))


def test_mtp_needs_an_mla_target(tmp_path):
    with pytest.raises(ValueError, match=r"MTP speculative decoding .* only on MLA"):
        check_speculative(_config(_model(tmp_path / "target"), "mtp"))


def test_a_draft_models_own_config_passes_the_startup_checks(tmp_path):
    """vLLM checks the draft model's VllmConfig (``runner="draft"``) with the platform
    when it loads a ``draft_model`` drafter; the bridge serves its attention too."""
    draft = ModelConfig(
        model=write_config(tmp_path / "draft", head_dim=64),
        skip_tokenizer_init=True,
        runner="draft",
    )
    assert draft.runner_type == "draft"
    checks.check_model_and_options(VllmConfig(model_config=draft))


def _quantized_spec_config(tmp_path, kv_cache_dtype: str, mode: str):
    from vllm.config import CUDAGraphMode

    config = _config(_model(tmp_path / "target", dtype="float16", head_dim=128), "ngram")
    config.cache_config = SimpleNamespace(cache_dtype=kv_cache_dtype)
    config.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode])
    return config


def _use_provider(monkeypatch, name: str) -> None:
    from vllm.platforms import current_platform

    from npu_vllm_bridge.settings import BridgeSettings

    monkeypatch.setattr(
        type(current_platform), "bridge_settings", BridgeSettings(name), raising=False
    )


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "FULL"])
def test_ascend_verify_over_int8_pages_in_full_graphs_is_refused(tmp_path, monkeypatch, mode):
    """The ascend provider dequantizes the pages of a verify step with torch ops, which a
    task update cannot re-issue: refused at start-up, naming what to change."""
    _use_provider(monkeypatch, "ascend")
    with pytest.raises(
        ValueError,
        match=r"'ascend' attention provider cannot run speculative decoding's verify steps "
        r"over kv_cache_dtype='int8_per_token_head' pages in FULL graphs; use "
        r"kv_cache_dtype='auto', or cudagraph_mode PIECEWISE",
    ):
        checks.check_quantized_verify(_quantized_spec_config(tmp_path, "int8_per_token_head", mode))


@pytest.mark.parametrize(
    ("provider", "kv_cache_dtype", "mode"),
    [
        ("ascend", "int8_per_token_head", "PIECEWISE"),
        ("ascend", "int8_per_token_head", "NONE"),
        ("ascend", "auto", "FULL_DECODE_ONLY"),
        ("reference", "int8_per_token_head", "FULL_DECODE_ONLY"),
        ("reference", "fp8", "FULL_AND_PIECEWISE"),
    ],
)
def test_quantized_verify_is_accepted_where_it_runs(
    tmp_path, monkeypatch, provider, kv_cache_dtype, mode
):
    _use_provider(monkeypatch, provider)
    checks.check_quantized_verify(_quantized_spec_config(tmp_path, kv_cache_dtype, mode))
