"""Hadamard rotations: the base matrices, the normalized matrix and its convention, and every kernel
(CPU paths, Triton interpreter, torch.compile) against the dense fp32 reference."""
import math

import pytest
import torch

from torch_lowbit.rotations import (SUPPORTED_BASE_ORDERS, base_hadamard_matrix, base_order, hadamard_matrix,
                                    hadamard_transform, hadamard_transform_reference, random_signs,
                                    supported_hadamard_size)

BASE_ORDERS = [k for k in SUPPORTED_BASE_ORDERS if k > 1]


def _data(*shape, dtype=torch.float32):
    # heavy-ish tails and one outlier channel, like activations the rotation is meant to spread
    x = torch.randn(*shape) * (1 + torch.rand(shape[-1]) * 3)
    x[..., 1] *= 20
    return x.to(dtype)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("k", BASE_ORDERS)
def test_base_matrix_is_hadamard(k):
    h = base_hadamard_matrix(k).double()
    assert h.shape == (k, k)
    assert torch.all(h.abs() == 1)
    assert torch.equal(h @ h.T, k * torch.eye(k, dtype=torch.float64))


def test_supported_orders_cover_quarot_and_smollm2():
    assert SUPPORTED_BASE_ORDERS == (1, 12, 20, 28, 36, 40, 44, 52, 60, 108, 140, 156, 172)
    for n in (576, 1536, 4096, 14336, 11008, 5120, 13824, 44 * 64):  # SmolLM2, Llama shapes
        assert supported_hadamard_size(n), n
    assert base_order(576) == 36 and base_order(14336) == 28 and base_order(4096) == 1
    assert base_order(160) == 40  # 40 * 4 == 20 * 8: the larger base order wins
    for n in (0, -4, 3, 84, 100, 4097, 7, 17 * 4096):
        assert not supported_hadamard_size(n), n


@pytest.mark.parametrize("n", [1, 2, 64, 12, 12 * 8, 36 * 16, 20 * 8, 40 * 4, 44 * 2, 172 * 2, 28 * 32, 4096])
def test_hadamard_matrix_orthogonal_and_kronecker(n):
    h = hadamard_matrix(n, dtype=torch.float64)
    assert h.shape == (n, n) and h.dtype == torch.float64
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    # every entry is +-1/sqrt(n), and the layout is H_k ⊗ H_{2^m} (k contiguous blocks of 2^m)
    torch.testing.assert_close(h.abs(), torch.full_like(h, 1 / math.sqrt(n)), atol=1e-15, rtol=0)
    k = base_order(n)
    p = n // k
    hk = base_hadamard_matrix(k).double()
    blocks = h.reshape(k, p, k, p) * math.sqrt(n)
    h_p = blocks[0, :, 0, :] * hk[0, 0]
    assert torch.equal(h_p[0], torch.ones(p, dtype=torch.float64))  # Sylvester: first row all +1
    assert torch.equal(h_p, h_p.T)
    for a in range(k):
        for c in range(k):
            assert torch.equal(blocks[a, :, c, :], hk[a, c] * h_p)


def test_hadamard_matrix_dtype():
    h = hadamard_matrix(24, dtype=torch.bfloat16)  # 24 = 12 * 2
    assert h.dtype == torch.bfloat16 and torch.equal(h, hadamard_matrix(24).to(torch.bfloat16))


@pytest.mark.parametrize("n", [3, 100, 4097, 0])
def test_unsupported_size_message(n):
    with pytest.raises(ValueError, match=r"k \* 2\^m") as e:
        hadamard_matrix(n)
    if n == 100:
        assert "96" in str(e.value) and "104" in str(e.value)  # 12*8 and 52*2
    if n == 4097:
        assert "4096" in str(e.value) and "4480" in str(e.value)  # 2^12 and 140*32


def test_random_signs_deterministic():
    s = random_signs(576, seed=7)
    assert s.dtype == torch.float32 and s.shape == (576,)
    assert torch.all(s.abs() == 1) and 200 < int((s > 0).sum()) < 376
    assert torch.equal(s, random_signs(576, seed=7))
    assert not torch.equal(s, random_signs(576, seed=8))
    # pinned: the same signs on every machine (CPU generator), so a saved rotation stays valid
    assert random_signs(16, seed=0).tolist() == _PINNED_SIGNS_SEED0


# torch.randint(0, 2) on a CPU generator seeded with 0, mapped to +-1 (torch 2.13)
_PINNED_SIGNS_SEED0 = [-1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -1.0]


@pytest.mark.parametrize("n", [64, 12 * 4, 36 * 16, 28 * 8])
@pytest.mark.parametrize("with_signs", [False, True])
def test_reference_convention(n, with_signs):
    x = _data(3, n, dtype=torch.float64)
    s = random_signs(n, seed=n) if with_signs else None
    h = hadamard_matrix(n, dtype=torch.float64)
    y = hadamard_transform_reference(x, s)
    expected = (x * s.double() if with_signs else x) @ h
    # the reference computes in fp32: only fp32 rounding separates it from the float64 product
    assert y.dtype == torch.float64 and _rel(y, expected) < 2e-6
    x_back = hadamard_transform_reference(y, s, inverse=True)
    assert _rel(x_back, y @ h.T * (s.double() if with_signs else 1)) < 2e-6
    assert _rel(x_back, x) < 4e-6
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)  # orthogonal
