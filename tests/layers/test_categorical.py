"""Inverse-CDF categorical draws (layers/sampling/categorical.py): the native kernel against the torch path, zero
weights never drawn, the frequencies of the distribution, and a row's draw independent of its batch and threads."""

import pytest
import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.sampling import categorical

native = pytest.mark.skipif(not cpu_kernels.native_library_available(), reason="no native kernels")


def _weights(n: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, vocab_size, generator=g) * 3).softmax(-1)
    w[torch.rand(n, vocab_size, generator=g) < 0.3] = 0.0  # top-k / top-p / min-p leave zeros
    return w


def _torch_draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return categorical.draw(w.double().float().clone().t().contiguous().t(), u)  # column-major: not native


@native
@pytest.mark.parametrize("vocab_size", [1, 7, 256, 1000, 49152])
def test_native_draws_equal_the_torch_path(vocab_size):
    w = _weights(48, vocab_size, seed=vocab_size)
    w[:, 0] += 1e-3  # every row keeps a positive weight
    u = torch.rand(48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    u[:3] = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert torch.equal(categorical.draw(w, u), _torch_draw(w, u))


@pytest.mark.parametrize("path", ["native", "torch"])
def test_zero_weights_are_never_drawn(path):
    if path == "native" and not cpu_kernels.native_library_available():
        pytest.skip("no native kernels")
    w = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 5)
    u = torch.tensor([0.0, 0.2499, 0.25, 1.0 - 2.0**-53, 1.0], dtype=torch.float64)  # 1.0: u * total == total
    drawn = categorical.draw(w, u) if path == "native" else _torch_draw(w, u)
    assert drawn.tolist() == [1, 1, 3, 3, 3]


@pytest.mark.parametrize("path", ["native", "torch"])
def test_frequencies_match_the_weights(path):
    if path == "native" and not cpu_kernels.native_library_available():
        pytest.skip("no native kernels")
    p = torch.tensor([0.5, 0.2, 0.0, 0.15, 0.1, 0.05])
    n = 20000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    w = p.expand(n, -1).contiguous()
    drawn = categorical.draw(w, u) if path == "native" else _torch_draw(w, u)
    counts = torch.bincount(drawn, minlength=len(p)).double()
    expected = p.double() * n
    assert counts[2] == 0
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: p = 0.0004


@native
def test_row_draw_independent_of_batch_and_threads():
    w = _weights(33, 49152, seed=3)
    w[:, 5] += 1e-3
    u = torch.rand(33, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [int(categorical.draw(w[i:i + 1], u[i:i + 1])[0]) for i in range(33)]
        torch.set_num_threads(2)
        assert categorical.draw(w, u).tolist() == alone
    finally:
        torch.set_num_threads(threads)


def test_seeded_rows_draw_from_their_own_generator():
    u = categorical.uniforms(4, {1: torch.Generator().manual_seed(5), 3: torch.Generator().manual_seed(6)},
                             torch.device("cpu"))
    assert u.dtype == torch.float64 and u.shape == (4,)
    assert float(u[1]) == float(torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(5))[0])
    assert float(u[3]) == float(torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(6))[0])
