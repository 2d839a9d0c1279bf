"""Hadamard rotations: the base matrices, the normalized matrix and its convention, and every kernel
(CPU paths, Triton interpreter, torch.compile) against an exact float64 transform, with tolerances
that follow from fp32 arithmetic (see `_bound`), not from one machine's BLAS rounding."""
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
    x[..., shape[-1] // 3] *= 20
    return x.to(dtype)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _fwht64(x):
    """x @ H_{2^m} (unnormalized Sylvester) along the last dim, in float64 butterflies (no dense matrix)."""
    n = x.shape[-1]
    h = 1
    while h < n:
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        x = torch.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], dim=-2).reshape(x.shape)
        h *= 2
    return x


def _exact(x, signs=None, inverse=False):
    """The transform in float64 from the Kronecker form: X (k blocks of 2^m) -> A^T X B / sqrt(n) forward,
    A X B / sqrt(n) inverse (A the base matrix, B the symmetric Sylvester matrix)."""
    n = x.shape[-1]
    k = base_order(n)
    a = base_hadamard_matrix(k).double()
    xd = x.double()
    s = signs.double() if signs is not None else None
    if not inverse and s is not None:
        xd = xd * s
    blocks = xd.reshape(*xd.shape[:-1], k, n // k)
    mixed = torch.einsum("ac,...ap->...cp", a, blocks) if not inverse else torch.einsum("ca,...ap->...cp", a, blocks)
    y = _fwht64(mixed).reshape(xd.shape) / math.sqrt(n)
    if inverse and s is not None:
        y = y * s
    return y


FP32_UNIT_ROUNDOFF = 2.0 ** -24
# unit roundoff of the output rounding (bf16: 8 significant bits, fp16: 11)
OUTPUT_UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _bound(n, dtype=torch.float32):
    """Normwise relative error bound of an fp32 Hadamard transform of size n = k * 2^m against the exact one.

    Each butterfly stage is orthogonal up to one rounding per element (<= 2u with the 1/sqrt(2)
    scaling folded anywhere), and the k x k base mix is a k-term dot product (<= k u); an fp32 dense
    reference adds its own length-n dot products (<= log2(n) u in pairwise/blocked BLAS sums, far less
    on average). Factor 2 of slack on top; then the output rounding (<= 1 unit roundoff of the dtype).
    """
    k = base_order(n)
    stages = math.log2(n // k)
    return 2 * (2 * stages + k + 2) * FP32_UNIT_ROUNDOFF + OUTPUT_UNIT_ROUNDOFF[dtype]


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


@pytest.mark.parametrize("n", [1, 2, 64, 12, 12 * 8, 36 * 16, 20 * 8, 40 * 4, 44 * 2, 172 * 2, 28 * 32, 1024])
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
    assert y.dtype == torch.float64 and _rel(y, expected) < _bound(n)
    torch.testing.assert_close(_exact(x, s, False), expected, rtol=1e-12, atol=1e-12)  # the test's own exact form
    x_back = hadamard_transform_reference(y, s, inverse=True)
    assert _rel(x_back, y @ h.T * (s.double() if with_signs else 1)) < _bound(n)
    torch.testing.assert_close(_exact(y, s, True), y @ h.T * (s.double() if with_signs else 1), rtol=1e-12, atol=1e-12)
    assert _rel(x_back, x) < 2 * _bound(n)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)  # orthogonal


# ---- the custom op (CPU paths, Triton interpreter, torch.compile) against the reference ----

import torch_lowbit as tl  # noqa: E402
from torch_lowbit.ops import cpu_extension  # noqa: E402

from conftest import triton_available  # noqa: E402

CPU_PATHS = list(dict.fromkeys(cpu_extension().available_cpu_paths() + ["scalar"]))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Every base order with blocks shorter than a vector (1), one vector (16) and more; powers of two
# cover every butterfly arrangement (in-register stages only, radix-4 passes, a radix-2 tail).
# Dense references stay <= 4096 wide here; wider ones have their own test.
SIZES = sorted({2 ** m for m in range(13)}
               | {k * p for k in BASE_ORDERS for p in (1, 2, 16, 32, 64, 128) if k * p <= 4096})


def _paths():
    for path in CPU_PATHS:
        with tl.use_backend("cpu", path=path):
            yield path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_op_matches_reference_every_cpu_path(n, dtype):
    x = _data(3, 5, n, dtype=dtype)  # odd leading shape
    s = random_signs(n, seed=n + 1)
    cases = [(signs, inverse) for signs in (None, s) for inverse in (False, True)]
    expected = [_exact(x, signs, inverse) for signs, inverse in cases]
    for path in _paths():
        for (signs, inverse), ref in zip(cases, expected):
            y = hadamard_transform(x, signs, inverse)
            assert y.dtype == dtype and y.shape == x.shape
            rel = _rel(y, ref)
            assert rel < _bound(n, dtype), f"path {path} signs {signs is not None} inverse {inverse}: {rel}"


@pytest.mark.parametrize("n", [8, 16, 64, 96, 576, 1536, 2048, 4096, 8192, 11008, 14336])
def test_simd_paths_equal_scalar_bit_for_bit(n):
    """The SIMD passes (csrc/common/hadamard_simd.h) add in the scalar code's order and multiply by exact
    +-1 entries, so every path gives the scalar path's bytes (in-register stages, radix-4 / radix-2
    passes, the L1 chunks, base-matrix mixes of 12 / 20 / 28 / 40 blocks)."""
    x = _data(3, n)
    with tl.use_backend("cpu", path="scalar"):
        ref = hadamard_transform(x)
    for path in _paths():
        assert torch.equal(hadamard_transform(x), ref), f"path {path} differs from scalar at n = {n}"


@pytest.mark.parametrize("n", [2 ** 13, 2 ** 14])
def test_op_matches_reference_wide(n):
    x = _data(2, n)
    s = random_signs(n, seed=3)
    for inverse in (False, True):
        ref = _exact(x, s, inverse)
        for path in _paths():
            rel = _rel(hadamard_transform(x, s, inverse), ref)
            assert rel < _bound(n), f"path {path} inverse {inverse}: {rel}"


@pytest.mark.parametrize("n", [64, 576, 14336, 12 * 4, 44 * 8, 172 * 16])
def test_op_inverse_of_forward_is_identity(n):
    x = _data(4, n)
    s = random_signs(n, seed=11)
    for path in _paths():
        y = hadamard_transform(x, s)
        assert _rel(y, x) > 0.5  # it did rotate
        assert _rel(hadamard_transform(y, s, inverse=True), x) < 2 * _bound(n), path
        assert _rel(hadamard_transform(hadamard_transform(x, inverse=True), None), x) < 2 * _bound(n), path


@pytest.mark.parametrize("n", [576, 1536, 64])
@pytest.mark.parametrize("inverse", [False, True])
def test_op_gradient_is_the_dense_products(n, inverse):
    """Autograd through the op (training through an online rotation) equals autograd through the dense
    reference product, with and without signs."""
    gen = torch.Generator().manual_seed(n + inverse)
    signs = random_signs(n, seed=n)
    for s in (signs, None):
        x = torch.randn(3, 5, n, generator=gen, requires_grad=True)
        weight = torch.randn(3, 5, n, generator=gen)
        (hadamard_transform(x, s, inverse=inverse) * weight).sum().backward()
        x_ref = x.detach().clone().requires_grad_(True)
        (hadamard_transform_reference(x_ref, s, inverse=inverse) * weight).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 8, 64, 12 * 4, 36 * 16, 44 * 2, 172])
def test_op_rows_of_identity_give_the_matrix(n):
    # forward without signs maps e_i to row i of H_n: the op realizes exactly hadamard_matrix(n)
    eye = torch.eye(n)
    for path in _paths():
        torch.testing.assert_close(hadamard_transform(eye), hadamard_matrix(n), atol=1e-6, rtol=0, msg=path)
        torch.testing.assert_close(hadamard_transform(eye, inverse=True), hadamard_matrix(n).T, atol=1e-6, rtol=0,
                                   msg=path)


def test_op_non_contiguous_and_empty_batch():
    wide = _data(6, 2 * 576)
    x = wide[:, ::2]  # stride 2 along the rotated dim
    s = random_signs(576, seed=5)
    assert _rel(hadamard_transform(x, s), _exact(x, s)) < _bound(576)
    empty = torch.empty(0, 3, 64)
    assert hadamard_transform(empty).shape == (0, 3, 64)


def test_op_threads_do_not_change_results():
    x = _data(64, 28 * 32)
    s = random_signs(28 * 32, seed=2)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = hadamard_transform(x, s)
        torch.set_num_threads(2)
        two = hadamard_transform(x, s)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)  # rows are independent: the split cannot change any value


def test_reference_backend_switch():
    x = _data(2, 576)
    with tl.use_backend("reference"):
        y = hadamard_transform(x)
    assert torch.equal(y, hadamard_transform_reference(x))


@pytest.mark.skipif(not triton_available(), reason="needs Triton (interpreter or GPU)")
# 20 * 8 runs with k = 40 (the larger base order wins); n = 20 is the one size that uses H_20
@pytest.mark.parametrize("n", [1, 2, 64, 1024, 20, 12 * 16, 36 * 16, 20 * 8, 28 * 4, 44 * 2, 172 * 2])
def test_triton_kernel_matches_reference(n):
    from torch_lowbit.triton_kernels.hadamard import hadamard_transform as triton_hadamard_transform

    s = random_signs(n, seed=n)
    cases = [(torch.float32, signs, inverse) for signs in (None, s) for inverse in (False, True)]
    cases.append((torch.bfloat16, s, False))
    for dtype, signs, inverse in cases:
        x = _data(3, 5, n, dtype=dtype)
        y = triton_hadamard_transform(x, signs, inverse)
        assert y.dtype == dtype and y.shape == x.shape
        rel = _rel(y, _exact(x, signs, inverse))
        assert rel < _bound(n, dtype), f"{dtype} signs {signs is not None} inverse {inverse}: {rel}"


@pytest.mark.parametrize("n", [64, 12 * 16, 36 * 16, 28 * 8])
def test_fast_hadamard_transform_glue(n):
    # The CUDA path with the optional fast_hadamard_transform package (not installable here): its
    # signs, block reshape and base mix, run with a stand-in for the package's kernel (the same
    # contract: x @ H_len along the last dim, times scale).
    from torch_lowbit.rotations.ops import _cuda_with_fast_hadamard_transform

    def stand_in_fht(x, scale):
        length = x.shape[-1]
        return x @ (hadamard_matrix(length) * math.sqrt(length)) * scale

    s = random_signs(n, seed=4)
    x = _data(3, 5, n)
    for signs in (None, s):
        for inverse in (False, True):
            y = _cuda_with_fast_hadamard_transform(stand_in_fht, x, signs, inverse)
            assert _rel(y, _exact(x, signs, inverse)) < _bound(n), (signs is not None, inverse)


@pytest.mark.parametrize("n", [576, 4096])
def test_compile_fullgraph(n):
    torch._dynamo.reset()
    s = random_signs(n, seed=9)

    def rotate_and_back(x):
        y = hadamard_transform(x * 2, s)
        return hadamard_transform(y.relu() + y, s, inverse=True)

    compiled = torch.compile(rotate_and_back, fullgraph=True)  # a graph break would raise
    x = _data(3, n)
    # both sides are fp32 transforms of the same input: at most twice one transform's error apart
    assert _rel(compiled(x), rotate_and_back(x)) < 2 * 2 * _bound(n)
    assert _rel(compiled(x.bfloat16()), rotate_and_back(x.bfloat16())) < 2 * 2 * _bound(n, torch.bfloat16)


def test_fake_impl_shapes_on_meta():
    y = hadamard_transform(torch.empty(7, 3, 576, device="meta", dtype=torch.bfloat16), random_signs(576, 0))
    assert y.device.type == "meta" and y.shape == (7, 3, 576) and y.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="signs must be a 1-D tensor of 576"):
        torch.ops.torch_lowbit.hadamard_transform(torch.empty(2, 576, device="meta"), torch.ones(575), False)


BAD_INPUTS = [
    ("size", lambda: (torch.randn(2, 100), None), r"last dimension 100 is not k \* 2\^m"),
    ("int dtype", lambda: (torch.randint(1, 9, (2, 64), dtype=torch.int32), None), "fp32, bf16 or fp16"),
    ("float64", lambda: (torch.randn(2, 64, dtype=torch.float64), None), "fp32, bf16 or fp16"),
    ("signs length", lambda: (torch.randn(2, 64), random_signs(32, 0)), "signs must be a 1-D tensor of 64"),
    ("signs 2-D", lambda: (torch.randn(2, 64), random_signs(64, 0)[None]), "signs must be a 1-D tensor of 64"),
    ("signs dtype", lambda: (torch.randn(2, 64), random_signs(64, 0).double()), "signs must be fp32"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_op_rejects_bad_inputs(case):
    _, make, message = case
    x, signs = make()
    for path in _paths():
        with pytest.raises(RuntimeError, match=message):
            torch.ops.torch_lowbit.hadamard_transform(x, signs, False)


def test_wrapper_names_nearest_sizes():
    with pytest.raises(ValueError, match=r"nearest supported: 96 or 104"):
        hadamard_transform(torch.randn(2, 100))
    with pytest.raises(ValueError, match="at least one dimension"):
        hadamard_transform(torch.tensor(3.0))


def test_register_base_rejects_non_hadamard():
    h = base_hadamard_matrix(12)
    broken = h.clone()
    broken[3, 5] *= -1
    with pytest.raises(RuntimeError, match=r"H H\^T != k I"):
        cpu_extension().register_hadamard_base(broken)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        cpu_extension().register_hadamard_base(torch.ones(2, 2))
    with pytest.raises(RuntimeError, match=r"entries must be \+-1"):
        cpu_extension().register_hadamard_base(h * 0.5)
    # the registered table is untouched: the op still matches the reference for k = 12
    x = _data(2, 12 * 16)
    assert _rel(hadamard_transform(x), _exact(x)) < _bound(12 * 16)


def _quarot_matmul_hadU(x, had_k, k):
    """QuaRot's fake_quant/hadamard_utils.matmul_hadU (github.com/spcl/QuaRot), condensed: the
    butterflies pair neighbours and move the finished bit to the back, then H_k mixes the blocks."""
    n = x.shape[-1]
    cur = x.clone().view(-1, n, 1)
    while cur.shape[1] > k:
        cur = cur.view(cur.shape[0], cur.shape[1] // 2, 2, cur.shape[2])
        cur = torch.stack([cur[:, :, 0] + cur[:, :, 1], cur[:, :, 0] - cur[:, :, 1]], dim=2)
        cur = cur.view(cur.shape[0], cur.shape[1], -1)
    if k > 1:
        cur = had_k.view(1, k, k).to(cur) @ cur
    return cur.view(x.shape) / math.sqrt(n)


@pytest.mark.parametrize("n", [64, 12 * 8, 20 * 2, 36 * 16, 52 * 4, 172 * 2])
def test_same_matrix_as_quarot(n):
    # QuaRot's matmul_hadU(x) is x @ H_n^T here (our inverse without signs), and its matmul_hadUt
    # (H_k transposed) our forward: the same matrix and Kronecker layout, so QuaRot rotations carry over.
    x = _data(3, n)
    k = base_order(n)
    h_k = base_hadamard_matrix(k)
    # QuaRot's code run in float64: the op's fp32 error bound separates them
    assert _rel(hadamard_transform(x, inverse=True), _quarot_matmul_hadU(x.double(), h_k.double(), k)) < _bound(n)
    assert _rel(hadamard_transform(x), _quarot_matmul_hadU(x.double(), h_k.T.contiguous().double(), k)) < _bound(n)
