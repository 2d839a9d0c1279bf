"""gvq_rowmajor's CPU kernels (gvq_linear / gvq_dequantize: csrc/gvq_linear.cpp, csrc/common/gvq.h):
random codes and codebooks (not a format's) in every code width, scope and stage count, ragged chunks
and tiles, every token count of the table GEMV and the decode route, each ISA path against the
reference decoder; the chunk-major packing; the ops' checks. The formats: tests/formats/test_gvq.py."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.formats.gvq import decode_vectors
from torch_lowbit.layouts.gvq import chunk_fields, chunk_major, from_chunk_major
from torch_lowbit.ops import cpu_extension

from conftest import assert_matches_product

PATHS = ["scalar", "avx2", "avx512"]


def _random_weights(gen, n, k, vec, bits, stages, tile_rows, tile_cols):
    regions = (-(-n // tile_rows) if tile_rows else 1) * (-(-k // tile_cols) if tile_cols else 1)
    codes = torch.randint(0, 2 ** bits, (n, k // vec, stages), generator=gen)
    books = (torch.randn(regions, stages, 2 ** bits, vec, generator=gen)).half()
    scales = (torch.rand(n, generator=gen) + 0.5).half()
    packed = chunk_major(codes.reshape(n, -1), bits, 2 ** bits)
    planes = books.transpose(2, 3).contiguous()
    w = decode_vectors(codes, books, tile_rows, tile_cols) * scales.float()[:, None]
    return packed, planes, scales, w


@pytest.mark.parametrize("bits", [4, 5, 8, 12, 16])
def test_chunk_major_round_trip(bits):
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    fields = 3 * chunk_fields(2 ** bits) + 5  # whole chunks and a ragged one
    codes = torch.randint(0, 2 ** bits, (7, fields), generator=gen)
    packed = chunk_major(codes, bits, 2 ** bits)
    assert packed.shape == (7, -(-fields * bits // 8))  # the row-major size
    assert torch.equal(from_chunk_major(packed, bits, 2 ** bits, fields), codes)
    # chunk 0 holds row 0's first fields, then row 1's: chunk-major
    cf = chunk_fields(2 ** bits)
    first = packed.reshape(-1)[: 2 * cf * bits // 8].reshape(2, -1)
    from torch_lowbit.core.packing import pack_bitfields
    assert torch.equal(first, pack_bitfields(codes[:2, :cf], bits))


@pytest.mark.parametrize("vec,bits,stages,scope", [(4, 8, 1, (0, 0)), (8, 8, 2, (0, 0)), (2, 8, 1, (0, 24)),
                                                   (4, 8, 1, (16, 64)), (8, 16, 1, (0, 0)), (4, 4, 2, (0, 0)),
                                                   (2, 5, 1, (5, 16)), (8, 12, 2, (0, 0))])
@pytest.mark.parametrize("path", PATHS)
def test_gvq_kernel_matches_its_definition(vec, bits, stages, scope, path):
    if path not in cpu_extension().available_cpu_paths():
        pytest.skip(f"CPU path {path} not available")
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    n, k = 37, vec * 77  # ragged chunks and row tiles
    packed, planes, scales, w = _random_weights(gen, n, k, vec, bits, stages, *scope)
    bias = torch.randn(n, generator=gen)
    with tl.use_backend("cpu", path=path):
        deq = torch.ops.torch_lowbit.gvq_dequantize(packed, bits, planes, *scope, scales, k)
        assert torch.equal(deq, w)  # the decode is the reference's arithmetic
        for m in (1, 2, 5, 8, 9, 17):  # table GEMV up to 8 tokens, the decode route beyond
            x = torch.randn(m, k, generator=gen) * 2
            y = torch.ops.torch_lowbit.gvq_linear(x, packed, bits, planes, *scope, scales, bias)
            assert_matches_product(y, x, w, bias, msg=f"{path} m={m}:")


@pytest.mark.parametrize("kernel", ["direct", "decode"])
@pytest.mark.parametrize("vec,bits,stages,scope", [(4, 8, 1, (0, 0)), (8, 8, 2, (0, 0)), (2, 16, 1, (8, 16)),
                                                   (4, 5, 2, (0, 0))])
@pytest.mark.parametrize("path", PATHS)
def test_ablation_kernels_match_the_definition(kernel, vec, bits, stages, scope, path):
    from torch_lowbit.ops.gvq import gvq_kernel
    if path not in cpu_extension().available_cpu_paths():
        pytest.skip(f"CPU path {path} not available")
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    n, k = 21, vec * 45
    packed, planes, scales, w = _random_weights(gen, n, k, vec, bits, stages, *scope)
    x = torch.randn(3, k, generator=gen)
    with tl.use_backend("cpu", path=path), gvq_kernel(kernel):
        y = torch.ops.torch_lowbit.gvq_linear(x, packed, bits, planes, *scope, scales, None)
    assert_matches_product(y, x, w, msg=f"{kernel} {path}:")
    with pytest.raises(ValueError, match="gvq kernel"):
        with gvq_kernel("shared"):
            pass


def test_threads_split_the_chunks_and_sum_the_same():
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    n, k = 64, 4 * 1024
    packed, planes, scales, w = _random_weights(gen, n, k, 4, 8, 1, 0, 0)
    x = torch.randn(1, k, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.torch_lowbit.gvq_linear(x, packed, 8, planes, 0, 0, scales, None)
        torch.set_num_threads(2)
        two = torch.ops.torch_lowbit.gvq_linear(x, packed, 8, planes, 0, 0, scales, None)
    finally:
        torch.set_num_threads(threads)
    assert_matches_product(one, x, w)
    assert_matches_product(two, x, w)


def test_ops_reject_bad_weights():
    gen = torch.Generator().manual_seed(0)
    packed, planes, scales, _ = _random_weights(gen, 8, 64, 4, 8, 1, 0, 0)
    x = torch.randn(1, 64)
    gvq = torch.ops.torch_lowbit.gvq_linear
    with pytest.raises(RuntimeError, match="code_bits"):
        gvq(x, packed, 3, planes, 0, 0, scales, None)
    with pytest.raises(RuntimeError, match="codebooks must be fp16"):
        gvq(x, packed, 8, planes.float(), 0, 0, scales, None)
    with pytest.raises(RuntimeError, match="codes must be uint8"):
        gvq(x, packed[:, :-1], 8, planes, 0, 0, scales, None)
    with pytest.raises(RuntimeError, match="multiple of the vector size"):
        gvq(torch.randn(1, 66), packed, 8, planes, 0, 0, scales, None)
    with pytest.raises(RuntimeError, match="codebook regions"):
        gvq(x, packed, 8, planes, 4, 0, scales, None)
    with pytest.raises(RuntimeError, match="for in_features 32"):
        gvq(torch.randn(1, 32), packed, 8, planes, 0, 0, scales, None)
