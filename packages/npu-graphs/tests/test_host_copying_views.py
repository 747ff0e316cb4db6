"""Host graphs redo alias-annotated ops that copied, and bake shape queries.

``aten.to`` with a dtype change and ``aten.reshape`` of a non-viewable tensor carry
alias annotations yet return fresh tensors; a replay that skipped them as views
would feed later ops the capture-time values. Reference: the same function run
eagerly on the new inputs. Under inference mode (as serving engines capture) such
composite ops reach the recorder undecomposed.
"""

from __future__ import annotations

import torch

from npu_graphs import GraphWrapper, RuntimeMode, graph_dispatch


@torch.inference_mode()
def _replay_matches_eager(fn, inputs, refresh) -> None:
    graph = GraphWrapper(lambda _: fn(*inputs), backend="host")
    with graph_dispatch(RuntimeMode.FULL, "k"):
        graph(None)
    for _ in range(2):
        refresh()
        with graph_dispatch(RuntimeMode.FULL, "k"):
            replayed = graph(None).clone()
        torch.testing.assert_close(replayed, fn(*inputs), rtol=0, atol=0)


def test_dtype_conversion_is_redone_at_replay():
    ids = torch.zeros(4, dtype=torch.int32)
    table = torch.randn(16, 8)
    _replay_matches_eager(
        lambda i: table[i.to(torch.int64)] * 2.0,
        (ids,),
        lambda: ids.copy_(torch.randint(0, 16, (4,), dtype=torch.int32)),
    )


def test_reshape_that_copies_is_redone_at_replay():
    x = torch.zeros(4, 6)
    _replay_matches_eager(
        lambda t: (t * 1.0).transpose(0, 1).reshape(-1) + 1.0,
        (x,),
        lambda: x.copy_(torch.randn(4, 6)),
    )


def test_shape_queries_are_baked():
    x = torch.zeros(5, 3)
    _replay_matches_eager(
        lambda t: t * torch.ops.aten.sym_size.int(t, 0),
        (x,),
        lambda: x.copy_(torch.randn(5, 3)),
    )
