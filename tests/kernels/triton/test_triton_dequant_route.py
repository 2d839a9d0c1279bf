"""The dequantize + cuBLAS route of the Triton matmul at large M."""
import pytest
import torch

from conftest import triton_available
from triton_helpers import (
    check_palette, fresh_gen, lowbit_args, lowbit_kernels, lowbit_module, lut4_kernels, matmul_module,
    palette_linear, palette_weights, quantized_lut4, run_lut4)

SEED_FILE = "test_triton_kernels.py"  # split out of tests/test_triton_kernels.py: its seeds (conftest.stable_seed)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


# -- the dequantize + cuBLAS route (large M) -------------------------------------------------------
def test_config_space_offers_the_dequant_route_from_dequant_min_m():
    mm = matmul_module()
    route = mm.DEQUANT_ROUTE
    launch = mm.KernelLaunch(None, (), {})
    cands, default = mm.config_space(mm.DEQUANT_MIN_M, 4096, 4096, launch)
    assert route in cands and default.get("ROUTE") is None
    assert route not in mm.config_space(mm.DEQUANT_MIN_M - 1, 4096, 4096, launch)[0]
    assert route not in mm.config_space(1, 4096, 4096, launch)[0]  # GEMV: never
    assert route in mm.config_space(5, 4096, 4096, launch, torch.float32)[0]  # exact fp32 tl.dot: CUDA cores
    assert route not in mm.config_space(1, 4096, 4096, launch, torch.float32)[0]


def test_kernel_launch_tiles_round_block_k_to_its_unit():
    """A kernel kind's own tiles; BLOCK_K rounds up to the columns of one K step (nuq3: 512), tiles
    that then coincide are tried once, dot tiles may name their pipeline stages."""
    mm = matmul_module()
    gemv = mm.KernelLaunch(None, (), {}, tiles=((32, 256, 4), (32, 512, 4), (64, 1024, 8)), default=(64, 256, 4),
                           k_unit=512)
    cands, default = mm.config_space(1, 4096, 4096, gemv)
    assert default == dict(BLOCK_N=64, BLOCK_K=512, SPLIT_K=4, num_warps=4, num_stages=2)
    assert sorted({(c["BLOCK_N"], c["BLOCK_K"]) for c in cands}) == [(32, 512), (64, 1024)]
    assert len(cands) == len({tuple(sorted(c.items())) for c in cands})
    assert all(c["SPLIT_K"] == 1 or c["BLOCK_K"] * c["SPLIT_K"] <= 4096 for c in cands)
    dot = mm.KernelLaunch(None, (), {}, tiles=((16, 64, 256, 4, 2), (64, 64, 256, 4)), default=(64, 256, 4, 1),
                          k_unit=512)
    cands, default = mm.config_space(17, 4096, 4096, dot)
    assert default == dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=1)
    assert {(c["BLOCK_M"], c["num_stages"]) for c in cands} == {(16, 2)}  # BLOCK_M 64 > M's bucket
    # the untimed default in one stage when 2 stages of its decoded tile pass 96 KiB (64 x 512: 128 KiB
    # overran sm_90 on Triton 3.6); 64 x 256 (64 KiB) keeps 2
    big = mm.KernelLaunch(None, (), {}, tiles=((16, 64, 256, 4, 2),), default=(64, 256, 4, 2), k_unit=512)
    assert mm.config_space(17, 4096, 4096, big)[1]["num_stages"] == 1
    small = mm.KernelLaunch(None, (), {}, tiles=((16, 64, 256, 4, 2),), default=(64, 256, 4, 2))
    assert mm.config_space(17, 4096, 4096, small)[1]["num_stages"] == 2
    # fp32 activations: one stage (two would stage fp32 x tiles and gathers past sm_90's shared memory)
    two = mm.KernelLaunch(None, (), {}, tiles=((16, 64, 256, 4, 2), (64, 64, 256, 4, 1)), default=(64, 256, 4, 2))
    cands, default = mm.config_space(512, 4096, 4096, two, torch.bfloat16)
    assert default["num_stages"] == 2 and {c.get("num_stages") for c in cands} == {1, 2, None}  # None: the route
    cands, default = mm.config_space(512, 4096, 4096, two, torch.float32)
    assert default["num_stages"] == 1 and {c.get("num_stages") for c in cands} == {1, None}


@pytest.mark.parametrize("fmt", ["int4_g64", "nuq3", "tcq2.25", "int3_g64", "gcb2_sb64"])
def test_dequant_route_matches_reference(fmt):
    """The config DEQUANT_ROUTE: the format's dequantize kernel writes W in x's dtype, then torch.mm /
    addmm (cuBLAS on a GPU); with and without bias, 3-D input."""
    gen = fresh_gen()
    route = matmul_module().DEQUANT_ROUTE
    k, n, m = 320, 48, 6
    if fmt.startswith(("nuq", "tcq")):
        f, b, w = palette_weights(fmt, n, k if fmt.startswith("nuq") else 288, gen)
        k = w.shape[1]

        def run(x, bias):
            return palette_linear(f, b, x, bias, route)[0]
    elif fmt.startswith("int4"):
        q, _ = quantized_lut4(fmt, k, n, False, gen)
        w = q.dequantize()

        def run(x, bias):
            return run_lut4(q, x, route) if bias is None else lut4_kernels().lut4_linear(
                x, q.qweight, q.scales, q.mins, q.lut, q.fmt.group_size, bias, config=route)
    else:
        q = lowbit_module(fmt, k, n, gen)
        kind, args = lowbit_args(q)
        w = q.dequantize()

        def run(x, bias):
            return getattr(lowbit_kernels(), f"{kind}_linear")(x, *args, bias, config=route)
    for dtype in (torch.float32, torch.float16):
        for bias in (None, torch.randn(n, generator=gen)):
            x = torch.randn(2, m // 2, k, generator=gen).to(dtype)
            check_palette(x, w, bias, run(x, bias))
