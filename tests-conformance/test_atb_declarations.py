"""The ATB operators' header declarations, read as Python signatures, agree with the
schemas ``libop_plugin_atb.so`` registers (what ``torch.ops.atb`` binds a call to).

``AtbOpsInterface.h`` carries C++ parameter names and no defaults; the registered
schemas carry the Python names and defaults. Parameter for parameter, kinds and
types must agree; the names differ in one documented place (``head_num`` in C++,
``q_headnum`` registered), which is why the ascend MLA provider passes it by position.
"""

from __future__ import annotations

import pytest
from torch_npu_schemas import parse_atb_header

KNOWN_RENAMES = {("head_num", "q_headnum")}  # (header, registered)


def _overloads(api):
    return [o for group in api.atb_overloads.values() for o in group]


def test_the_mla_operator_is_declared_and_registered(torch_npu_api) -> None:
    names = {o.name for o in torch_npu_api.atb_overloads["atb.npu_multi_head_latent_attention"]}
    assert names == {
        "atb.npu_multi_head_latent_attention",
        "atb.npu_multi_head_latent_attention.out",
        "atb.npu_multi_head_latent_attention.lse",
        "atb.npu_multi_head_latent_attention.lse_out",
    }
    (workspace,) = torch_npu_api.atb_overloads["atb._npu_multi_head_latent_attention_get_workspace"]
    assert workspace.cpp_name == "_npu_multi_head_latent_attention_lse_get_workspace"
    lse_out = next(o for o in _overloads(torch_npu_api) if o.name.endswith("attention.lse_out"))
    assert lse_out.registered is not None
    assert str(lse_out.declared.signature) == (
        "(q_nope, q_rope, ctkv, k_rope, block_tables, context_lens, head_num, qk_scale, "
        "kv_headnum, return_lse, *, mask=None, qseqlen=None, qk_descale=None, "
        "pv_descale=None, mask_type=None, calc_type=None, cache_mode=None, workspace=None, "
        "output, lse)"
    )


def test_declarations_agree_with_registered_schemas(torch_npu_api) -> None:
    checked = 0
    for overload in _overloads(torch_npu_api):
        if overload.registered is None:
            continue
        ours = list(overload.declared.signature.parameters.values())
        theirs = list(overload.registered.signature.parameters.values())
        assert len(ours) == len(theirs), overload.name
        for mine, other in zip(ours, theirs):
            assert mine.kind == other.kind, (overload.name, mine, other)
            assert mine.name == other.name or (mine.name, other.name) in KNOWN_RENAMES
            mine_type = overload.declared.types[mine.name].replace("SymInt", "int")
            assert mine_type == overload.registered.types[other.name], (overload.name, mine)
        checked += 1
    assert checked >= 8


def test_header_parser_reads_declarations() -> None:
    header = """
    TORCH_NPU_API std::tuple<at::Tensor&, at::Tensor&> f_out(const at::Tensor &q,
        c10::SymIntArrayRef lens, int64_t heads, double scale, bool flag,
        c10::OptionalArrayRef<c10::SymInt> qlens, c10::optional<c10::string_view> mode_opt,
        at::Tensor&output, at::Tensor&lse);
    """
    (schema,) = parse_atb_header(header).values()
    assert (
        str(schema.signature)
        == "(q, lens, heads, scale, flag, *, qlens=None, mode=None, output, lse)"
    )
    assert schema.types["lens"] == "List[SymInt]" and schema.types["mode"] == "Optional[str]"
    with pytest.raises(ValueError, match="unknown C\\+\\+ parameter type 'float'"):
        parse_atb_header("TORCH_NPU_API void g(float x);")
