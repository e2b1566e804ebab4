"""The small AVX2 kernels against the torch ops they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine import cpu_kernels


@pytest.mark.parametrize("vocab", [1, 5, 8, 13, 49152])
def test_argmax_rows_follows_torch_rules(lib, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = 0.5  # all tied: the first index
    x[2, vocab // 2] = float("nan")  # NaN counts as the largest value
    x[2, -1] = float("nan")
    x[3, -1] = float("inf")
    x[3, 0] = float("inf")
    x[4] = float("-inf")
    assert torch.equal(cpu_kernels.argmax_rows(lib, x), torch.argmax(x, dim=-1))


def test_silu_mul_matches_torch(lib):
    gate_up = torch.randn(5, 2 * 100, generator=torch.Generator().manual_seed(1)) * 8
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(cpu_kernels.silu_mul(lib, gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
