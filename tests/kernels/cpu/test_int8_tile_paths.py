"""The int8-activation tile kernels (lut_i8 / gcb / vq / nuq layouts) with per-32 activation blocks: every
SIMD path sums a block's integer products exactly and runs the scalar path's float epilogue, so each
path's output is the scalar path's bytes, at decode token counts (each block decoded per token block)
and at prefill ones (each tile decoded once into a buffer, then every token block reads it)."""
import pytest
import torch

import torch_lowbit as tl
from conftest import random_linear
from torch_lowbit.ops import cpu_extension

# Identity (q4_0, int*), unsigned and signed 16-entry tables (int4_g128's mins, iq4_nl), q8_0's bytes,
# per-row group codebooks (gcb2 / gcb3), pair codebooks (vq2) and the NUQ table (nuq3); groups of 32
# with mins (int4_g32: the AVX-512 kernel's one-block groups add the mins per block).
# The K-quants: integer sub-scales of 16 (q2_k with mins, q3_k, q6_k with offsets) and 32 (q4_k, q5_k)
# features, 5- and 6-bit codes; q5_0 / q5_1: plain 5-bit codes.
FORMATS = ["q4_0", "int4_g128", "int4_g32", "iq4_nl", "int1_g64", "int2_g64", "int3_g64", "q8_0", "gcb2", "gcb3", "vq2", "nuq3",
           "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_path_gives_the_scalar_bytes_at_decode_and_prefill(fmt):
    paths = [p for p in cpu_extension().available_cpu_paths() if p != "scalar"]
    if not paths:
        pytest.skip("this CPU runs only the scalar path")
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    # K = 1280: whole 512-code periods plus a tail for the codebooks; N ragged against 16-row tiles
    layer = tl.QuantLinear.from_linear(random_linear(1280, 77, True, gen), fmt)
    for m in (1, 3, 9, 17, 41):  # one token block, several, and a ragged last one
        x = torch.randn(m, 1280, generator=gen) * torch.rand(m, 1, generator=gen).add(0.1)
        with tl.use_backend("cpu", path="scalar"):
            ref = layer(x)
        for path in paths:
            with tl.use_backend("cpu", path=path):
                assert torch.equal(layer(x), ref), f"{fmt} M={m}: {path} differs from scalar"
