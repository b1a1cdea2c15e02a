"""Linear with oneDNN-packed weights (CPU fp32): same results as F.linear, each row independent of its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import Linear, onednn_available, pack_linear_weights

pytestmark = pytest.mark.skipif(not onednn_available(torch.empty(0)), reason="torch built without oneDNN")


def packed_layer(in_features: int, out_features: int, bias: bool, seed: int) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias).requires_grad_(False)
    weight = layer.weight.detach().clone()
    layer.pack_weights()
    return layer, weight


@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 576), (37, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear(in_features, out_features, bias):
    layer, weight = packed_layer(in_features, out_features, bias, seed=in_features)
    assert layer.packed_weight is not None and layer.weight is None  # no second copy of the weight
    for rows in (1, 3, 64, 300):
        x = torch.randn(rows, in_features)
        with torch.inference_mode():
            y = layer(x)
        expected = (x.double() @ weight.double().T + (layer.bias.double() if bias else 0)).float()
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_each_row_is_independent_of_the_batch_and_the_thread_count():
    layer, _ = packed_layer(576, 3072, bias=False, seed=0)
    x = torch.randn(300, 576)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            full = layer(x)
            for rows in (1, 2, 4, 7, 16, 128, 129):
                assert torch.equal(layer(x[:rows]), full[:rows]), rows
            assert torch.equal(layer(x[5:6]), full[5:6])
            torch.set_num_threads(1)
            assert torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)


def test_a_tied_weight_stays_with_the_module_that_shares_it():
    embed = nn.Embedding(50, 16)
    head = Linear(16, 50, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    pack_linear_weights(model)
    assert head.packed_weight is not None and head.weight is None
    assert embed.weight.shape == (50, 16)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(head(x), F.linear(x, embed.weight), atol=1e-5, rtol=1e-5)


def test_other_dtypes_keep_the_plain_weight():
    layer = Linear(16, 8, bias=True).to(torch.bfloat16)
    layer.pack_weights()
    assert layer.packed_weight is None and layer.weight is not None
