"""Every registered format x every backend on this machine against the reference dequantizer
(ggml's test-backend-ops idea). A new format joins by registering; nothing here names a format."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.layouts import get_layout, layouts
from torch_lowbit.ops import cpu_extension

from conftest import assert_matches_product, random_linear, triton_available


def _backends():
    """(backend, CPU path, layout) triples: every layout with every backend that reads it."""
    out = []
    for name in layouts():
        lay = get_layout(name)
        if "cpu" in lay.backends:
            paths = cpu_extension().available_cpu_paths() if lay.isa_paths else [None]
            out += [("cpu", p, name) for p in paths]
        if "triton" in lay.backends and triton_available():
            out.append(("triton", None, name))
    return out


def _accepts(f, n, k):
    try:
        f.check_weight(torch.ones(n, k))
        return True
    except ValueError:
        return False


# Shapes for formats with more constraints (Hadamard-size K, out_features in tiles of 16): K of
# base orders 12, 20, 36 and a power of two, N ragged against 32- and 64-row kernel tiles; K = 1280
# gives the codebook kernels whole 512-code periods plus a tail.
_CONSTRAINED_SHAPES = [(1, 96, 48), (3, 1280, 32), (8, 576, 80), (33, 64, 16)]


def _shapes(f):
    # (M, K, N): K a multiple of the group (required) but not of 64 where the group allows it;
    # N odd so every kernel meets a ragged edge; M in {1, 3, 8, 33} covers GEMV and GEMM paths.
    group = f.group_size
    k_odd = group * 3 if group % 64 else group * 2 + group  # 96 for g32, 192 for g64, 384 for g128
    shapes = [(1, k_odd, 97), (3, group * 5, 61), (8, k_odd, 130), (33, group * 2, 45)]
    if all(_accepts(f, n, k) for _, k, n in shapes):
        return shapes
    assert all(_accepts(f, n, k) for _, k, n in _CONSTRAINED_SHAPES), f.name
    return _CONSTRAINED_SHAPES


CASES = [(fmt, backend, path, layout, shape_idx, bias, dtype)
         for fmt in tl.formats()
         for backend, path, layout in _backends()
         if get_layout(layout).supports(tl.get_format(fmt))
         for shape_idx in range(4)
         if get_layout(layout).holds_width(tl.get_format(fmt), _shapes(tl.get_format(fmt))[shape_idx][1])
         for bias in (False, True)
         for dtype in (torch.float32, torch.bfloat16)
         if backend != "triton" or (shape_idx % 2 == 0 or bias)  # interpreter is slow: thin it a little
         # 27 palette formats (nuq/vq/tcq/half-TCQ) share two Triton kernels that differ only in
         # constexprs, ~1 s a case under the interpreter: one dtype per bias setting (fp32 and bf16 both
         # still meet GEMV and tl.dot); tests/kernels/triton/ covers their dtypes x paths
         if backend != "triton" or layout != "palette_packed" or bias == (dtype == torch.bfloat16)
         # plain-torch layouts (one code path for all dtypes): bias and bf16 together suffice
         if get_layout(layout).isa_paths or bias == (dtype == torch.bfloat16)
         # one Triton kernel per sub-4-bit family whatever the group size: g64 and the gcb defaults there
         # (tests/kernels/triton/ forces every kernel path for g32/g128 and other superblocks)
         if backend != "triton" or layout not in ("stream_rowmajor", "gcb_rowmajor") or fmt.endswith("_g64")
         or fmt in ("gcb2", "gcb3", "q8_0")
         # the K-quants' kernels: GEMV (M = 1) and tl.dot (M = 33) here, every kind x dtype in
         # tests/kernels/triton/test_triton_kquant.py
         if backend != "triton" or layout != "kquant_stream" or shape_idx in (0, 3)
         # gvq: the avxvnni path runs the avx2 kernel; one dtype per bias setting (tests/kernels/cpu/
         # test_gvq_kernels.py covers every code width, scope and token count per path)
         if layout != "gvq_rowmajor" or (path != "avxvnni" and bias == (dtype == torch.bfloat16))]


@pytest.mark.parametrize("fmt,backend,path,layout,shape_idx,bias,dtype", CASES,
                         ids=lambda v: str(v).replace("torch.", "") if v is not None else "-")
def test_kernel_matches_reference(fmt, backend, path, layout, shape_idx, bias, dtype):
    f = tl.get_format(fmt)
    m, k, n = _shapes(f)[shape_idx]
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    lin = random_linear(k, n, bias, gen)
    q = tl.QuantLinear.from_linear(lin, fmt, layout=layout)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)

    # Expected: the reference dequantized weight times the activations the kernel multiplies with
    # (x itself for float kernels, the int8 round trip of x for int8-activation kernels).
    w = q.dequantize()
    b = lin.bias if bias else None
    with tl.use_backend(backend, path=path):
        y = q(x)
    assert y.dtype == dtype and y.shape == (m, n)
    # only fp32 rounding (and bf16's output rounding) may separate the kernel from the exact product
    assert_matches_product(y, q.reference_activations(x), w, b, msg=f"{backend}/{path}/{layout}:")
    # and whatever the activation handling, close to the float product (int8 blocks: ~0.5%)
    full = x.double() @ w.double().T + (b.double() if bias else 0)
    assert ((y.double() - full).norm() / full.norm()).item() < 2e-2

    with tl.use_backend("reference"):
        y_ref = q(x)
    # the reference backend multiplies in x's dtype: bf16 rounds the dequantized weight first
    assert_matches_product(y_ref, x, w, b, weights_in=dtype, msg="reference backend:")


@pytest.mark.parametrize("fmt,layout", [(f, "lut4_i8_n16") for f in tl.formats()
                                        if get_layout("lut4_i8_n16").supports(tl.get_format(f))]
                         + [(f, "gcb_i8_n16") for f in ("gcb2", "gcb3", "gcb3_sb64")] + [("q8_0", "lut8_i8_n16")]
                         + [("nuq3", "nuq_i8_n16"), ("vq2", "vq_i8_n16"), ("vq1.5", "vq_i8_n16")])
def test_int8_paths_are_bit_exact_with_scalar_path(fmt, layout):
    """The integer kernels perform the same operations in the same order on every ISA path."""
    group = tl.get_format(fmt).group_size
    lin = random_linear(group * 4 if group >= 32 else 192, 53, True, torch.Generator().manual_seed(5))
    q = tl.QuantLinear.from_linear(lin, fmt, layout=layout)
    for m in (1, 3, 6, 11):  # two-tile passes (M <= 4), one-tile 8-token blocks, prepared tiles (AVX2 M > 4)
        x = torch.randn(m, lin.in_features)
        with tl.use_backend("cpu", path="scalar"):
            base = q(x)
        for path in cpu_extension().available_cpu_paths():
            with tl.use_backend("cpu", path=path):
                assert torch.equal(q(x), base), (path, m)


def test_activation_quantizer_matches_kernel_integer_math():
    """The pure-torch q8 activation reference is the kernel's: a weight of one-hot rows reads back
    each activation block's q * d exactly."""
    from torch_lowbit.core.activations import fake_quantize_q8_blocks
    k = 64
    lin = torch.nn.Linear(k, k, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(k) * 7.0)  # q4_0 stores 7 as code 15 (+7 = (15-8) * d, d = 1)
    q = tl.QuantLinear.from_linear(lin, "int4_g32", layout="lut4_i8_n16")
    x = torch.randn(3, k) * 5
    torch.testing.assert_close(q(x), fake_quantize_q8_blocks(x) @ q.dequantize().T, rtol=1e-6, atol=1e-6)


def test_layouts_hold_the_same_codes():
    for fmt in tl.formats():
        _, k, n = _shapes(tl.get_format(fmt))[2]
        lin = random_linear(k, n, False, torch.Generator().manual_seed(9))
        deq = [tl.QuantLinear.from_linear(lin, fmt, layout=name).dequantize() for name in layouts()
               if get_layout(name).supports(tl.get_format(fmt))]
        assert all(torch.equal(d, deq[0]) for d in deq)
        q = tl.QuantLinear.from_linear(lin, fmt)
        before = q.dequantize()
        for name in layouts():
            if get_layout(name).supports(tl.get_format(fmt)):
                assert torch.equal(q.repack(name).dequantize(), before)


LUT4_FORMATS = [f for f in tl.formats() if get_layout("lut4_rowmajor").supports(tl.get_format(f))]


@pytest.mark.parametrize("fmt", LUT4_FORMATS)
@pytest.mark.parametrize("path", cpu_extension().available_cpu_paths())
def test_dequantize_op_matches_format(fmt, path):
    f = tl.get_format(fmt)
    lin = random_linear(f.group_size * 3, 37, False, torch.Generator().manual_seed(7))
    q = tl.QuantLinear.from_linear(lin, fmt, layout="lut4_rowmajor")
    b = {k: getattr(q, k) for k in q._kernel_buffer_names}
    with tl.use_backend("cpu", path=path):
        w = torch.ops.torch_lowbit.lut4_dequantize(b["qweight"], b["scales"], b.get("mins"), b["lut"], q.fmt.group_size)
    torch.testing.assert_close(w, q.dequantize(), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("fmt", LUT4_FORMATS)
def test_triton_dequantize_matches_format(fmt):
    from torch_lowbit.triton_kernels.lut4 import lut4_dequantize
    f = tl.get_format(fmt)
    lin = random_linear(f.group_size * 3, 37, False, torch.Generator().manual_seed(11))
    q = tl.QuantLinear.from_linear(lin, fmt, layout="lut4_rowmajor")
    for dtype in (torch.float32, torch.float16):  # bit for bit, the 4-run tiles ragged in K and N
        w = lut4_dequantize(q.qweight, q.scales, getattr(q, "mins", None), q.lut, q.fmt.group_size, dtype=dtype)
        assert torch.equal(w, q.dequantize().to(dtype)), (fmt, dtype)


def test_cpu_paths_agree_with_scalar_path():
    """Each ISA path against the portable scalar path on the same packed weight (3-D input)."""
    lin = random_linear(320, 77, True, torch.Generator().manual_seed(3))
    q = tl.QuantLinear.from_linear(lin, "int4_g32", layout="lut4_rowmajor")
    x = torch.randn(2, 5, 320)
    with tl.use_backend("cpu", path="scalar"):
        base = q(x)
    for path in cpu_extension().available_cpu_paths():
        with tl.use_backend("cpu", path=path):
            torch.testing.assert_close(q(x), base, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", tl.formats())
def test_cuda_matches_reference_at_real_sizes(fmt):
    """Every format's CUDA default layout at K = 4096 (4224 = 22 x 192 for 192-wide groups), M = 1
    (GEMV) to 512 (tiles), quantized once. TCQ quantizes with the reference Viterbi on the GPU:
    512 rows keep its 15 cases inside a GPU lease."""
    n = 512 if fmt.startswith("tcq") else 4096
    k = 4096 if 4096 % tl.get_format(fmt).group_size == 0 else 4224
    lin = random_linear(k, n, True, torch.Generator().manual_seed(n)).cuda()
    q = tl.QuantLinear.from_linear(lin, fmt)
    w = q.dequantize().float()
    errors = {}
    for m in (1, 8, 64, 512):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ref = x.float() @ w.T + lin.bias.float()
        errors[m] = ((q(x).float() - ref).norm() / ref.norm()).item()
    assert max(errors.values()) < 5e-3, errors
