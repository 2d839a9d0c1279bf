"""The palette_packed Triton kernels (nuq, vq, tcq, half-TCQ): GEMV, tl.dot and dequantize against
the reference decoder, forced configs with split-K, launcher checks, the triton route of QuantLinear."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.layouts import get_layout

from conftest import tiny_llama, triton_available
from triton_helpers import (
    CountLaunches, DOT_CONFIGS, DTYPES, GEMV_CONFIGS, check_palette, compiled_on_meta, fresh_gen,
    needs_interpreter_on_cpu, on_cuda, palette_kernels, palette_linear, palette_weights)

SEED_FILE = "test_triton_kernels.py"  # split out of tests/test_triton_kernels.py: its seeds (conftest.stable_seed)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


# Codebook: N odd, K ragged against the 64-column tiles and the 16-stream word period (531 codes per
# row). TCQ: N = 48 (ragged against 32/64-row tiles; TCQ rows come in bands of 16), K = 17 tiles;
# half-TCQ: halves of 9 tiles, so K/2 = 144 falls inside a 64- or 128-column tile.
_PALETTE_CASES = [("nuq1", 37, 531), ("nuq3", 37, 531), ("vq2", 29, 1062), ("vq5", 29, 1062),
                  ("tcq1.5", 48, 272), ("tcq2.5", 48, 272), ("tcq5", 48, 272), ("tcq2.25", 48, 288),
                  ("tcq4.75", 48, 288)]


@pytest.mark.parametrize("m", [1, 3, 17, 33])  # GEMV (M <= 4), tl.dot with ragged M tiles
@pytest.mark.parametrize("fmt,n,k", _PALETTE_CASES, ids=lambda v: str(v))
def test_palette_kernels_match_reference_decoder(fmt, n, k, m):
    gen = fresh_gen()
    f, b, w = palette_weights(fmt, n, k, gen)
    for i, dtype in enumerate(DTYPES):
        bias = torch.randn(n, generator=gen) if (m + i) % 2 else None
        x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
        y, _ = palette_linear(f, b, x, bias)
        check_palette(x, w, bias, y)


# The GEMV kernels' decoders by code width: nuq pairs of 2 / 4-bit codes (fields within a word), vq
# 3- and 6-bit codes (units of 3 words, straddling fields); TCQ windows from word-aligned rows (S = 4,
# 8) and byte-shifted ones (S = 6, 7), half-TCQ mixing both. K ragged against the K step.
_GEMV_CASES = [("nuq2", 37, 531), ("nuq4", 37, 531), ("vq1.5", 29, 1062), ("vq3", 29, 1062), ("tcq2", 48, 272),
               ("tcq4", 48, 272), ("tcq3", 48, 272), ("tcq3.5", 48, 272), ("tcq2.25", 48, 288)]


@pytest.mark.parametrize("fmt,n,k", _GEMV_CASES, ids=lambda v: str(v))
def test_palette_gemv_kernels_every_path(fmt, n, k):
    """The codebook / TCQ kernels' GEMV kind (M <= 4) at M = 1..4, every activation dtype, with and without
    bias, K steps from one unit (BLOCK_K rounded up to it) to several, split-K with empty slices."""
    pal = palette_kernels()
    gen = fresh_gen()
    f, b, w = palette_weights(fmt, n, k, gen)
    # codebook units of up to 16 lookups take the 16-byte-load GEMV; vq1.5's 32 pair lookups the other
    name = "_tcq_linear_kernel" if fmt.startswith("tcq") else \
        "_codebook_linear_kernel" if fmt == "vq1.5" else "_codebook_gemv_kernel"
    counter = CountLaunches(getattr(pal, name))
    configs = (dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=3, num_warps=4, num_stages=2),
               dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=2),
               dict(BLOCK_N=32, BLOCK_K=512, SPLIT_K=2, num_warps=8, num_stages=2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pal, name, counter)
        for m, dtype, cfg in zip((1, 4, 3, 2), DTYPES + (torch.float16,), configs + (None,)):
            bias = torch.randn(n, generator=gen) if m % 2 else None
            x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
            y, _ = palette_linear(f, b, x, bias, cfg)
            check_palette(x, w, bias, y)
    assert len(counter.grids) == 4


def test_codebook_gemv_reads_wide_scalar_codes():
    """nuq-style codes wider than the pair tables take, one fp32 lookup per code, in units of 5 words:
    10 bits (16 lookups a unit: the 16-byte-load GEMV) and 5 bits (32 lookups: _codebook_linear_kernel's
    GEMV, as vq1.5's and vq2.5's)."""
    from torch_lowbit.core.packing import pack_streams
    gen = fresh_gen()
    n, k = 23, 700
    pal = palette_kernels()
    for bits, kernel in ((10, "_codebook_gemv_kernel"), (5, "_codebook_linear_kernel")):
        codes = torch.randint(0, 2 ** bits, (n, k), generator=gen)
        table = torch.randn(2 ** bits, 1, generator=gen)
        scales = torch.rand(n, generator=gen).add(0.5).half()
        w = table[codes, 0] * scales.float()[:, None]
        counter = CountLaunches(getattr(pal, kernel))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pal, kernel, counter)
            for m, dtype in ((1, torch.float32), (4, torch.bfloat16)):
                x = torch.randn(m, k, generator=gen).to(dtype)
                y = pal.codebook_linear(x, pack_streams(codes, bits), bits, table, scales,
                                        config=dict(BLOCK_N=32, BLOCK_K=512, SPLIT_K=2, num_warps=4, num_stages=2))
                check_palette(x, w, None, y)
        assert len(counter.grids) == 2, kernel


@pytest.mark.parametrize("fmt,n,k", _PALETTE_CASES, ids=lambda v: str(v))
def test_palette_dequantize_kernels_are_exact(fmt, n, k):
    """Decode and scale in fp32 as the reference decoder does: bit-exact, also vs the C++ ops."""
    pal = palette_kernels()
    f, b, w = palette_weights(fmt, n, k, fresh_gen())
    name, args = get_layout("palette_packed").kernel_call(f, b)
    if name == "codebook_linear":
        got = pal.codebook_dequantize(*args, b["row_scales"], k)
        cpp = torch.ops.torch_lowbit.codebook_dequantize(*args, b["row_scales"], k)
    elif name == "tcq_linear":
        got = pal.tcq_dequantize(*args, b["row_scales"])
        cpp = torch.ops.torch_lowbit.tcq_dequantize(*args, b["row_scales"])
    else:
        got = pal.tcq_half_dequantize(*args, b["row_scales"])
        cpp = torch.cat([torch.ops.torch_lowbit.tcq_dequantize(*args[:4], b["row_scales"]),
                         torch.ops.torch_lowbit.tcq_dequantize(*args[4:], b["row_scales"])], 1)
    assert torch.equal(got, w) and torch.equal(got, cpp)


@pytest.mark.parametrize("fmt,n,k", [("vq3", 21, 320), ("tcq3", 32, 320), ("tcq3.25", 32, 320)])
@pytest.mark.parametrize("m,config", [(1, GEMV_CONFIGS[0]), (4, GEMV_CONFIGS[1]), (5, DOT_CONFIGS[0]),
                                      (33, DOT_CONFIGS[1])])
def test_palette_forced_configs_split_k(fmt, n, k, m, config):
    """Configs the autotuner may pick: split-K with empty slices, slices and tiles across K/2 (half-TCQ)."""
    gen = fresh_gen()
    f, b, w = palette_weights(fmt, n, k, gen)
    bias = torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, m, k, generator=gen).to(dtype)  # 3-D input: leading dims flatten
        y, _ = palette_linear(f, b, x, bias, config)
        check_palette(x, w, bias, y)
    y1, _ = palette_linear(f, b, x, bias, config)
    assert torch.equal(y, y1)  # deterministic split-K reduction


def test_half_tcq_is_one_launch(monkeypatch):
    pal = palette_kernels()
    counter = CountLaunches(pal._tcq_linear_kernel)
    monkeypatch.setattr(pal, "_tcq_linear_kernel", counter)
    gen = fresh_gen()
    f, b, w = palette_weights("tcq3.75", 32, 192, gen)
    for m in (2, 9):
        x = torch.randn(m, 192, generator=gen)
        y, name = palette_linear(f, b, x, None, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2)
                                  if m <= 4 else dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4,
                                                      num_stages=3))
        assert name == "tcq_half_linear"
        check_palette(x, w, None, y)
    assert [len(grid) for grid in counter.grids] == [2, 3]  # one launch per call: GEMV, then tl.dot


@pytest.mark.parametrize("fmt", ["nuq3", "vq2", "tcq2", "tcq2.25"])
def test_palette_quantlinear_triton_route_rotates_with_triton(fmt, monkeypatch):
    """QuantLinear on the triton backend: Triton Hadamard for x' (not the C++ op), then the fused kernel."""
    from torch_lowbit.triton_kernels import hadamard
    counter = CountLaunches(hadamard._hadamard_kernel)
    monkeypatch.setattr(hadamard, "_hadamard_kernel", counter)
    gen = fresh_gen()
    lin = torch.nn.Linear(192, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 192, generator=gen) * 0.05)
    q = tl.QuantLinear.from_linear(lin, fmt, layout="palette_packed")
    w = q.dequantize()
    for dtype in DTYPES:
        x = torch.randn(3, 5, 192, generator=gen).to(dtype)
        with tl.use_backend("triton"):
            y = q(x)
        ref = x.double() @ w.double().T + lin.bias.double()
        assert y.dtype == dtype
        # x' is rounded to fp16 once on this path (bf16 rotates in fp32 under the interpreter)
        assert ((y.double() - ref).norm() / ref.norm()).item() < {torch.float32: 2e-6, torch.float16: 3e-3,
                                                                  torch.bfloat16: 6e-3}[dtype]
    assert len(counter.grids) == len(DTYPES)
    with tl.use_backend("cpu"):
        torch.testing.assert_close(q(x.float()), y.float(), rtol=1e-2, atol=1e-2)


def test_palette_packed_is_the_cuda_default_layout():
    from torch_lowbit.layouts import default_layout
    for fmt in ("nuq3", "vq2", "tcq2", "tcq2.25"):
        assert default_layout(tl.get_format(fmt), "cuda").name == "palette_packed"
        assert default_layout(tl.get_format(fmt), "xpu").name == "palette_dense"  # the portable fallback
    assert default_layout(tl.get_format("nuq3"), "cpu").name == "nuq_i8_n16"
    assert "triton" in get_layout("palette_packed").backends


def test_palette_fused_model_compiles_fullgraph_through_the_ops():
    """Meta tensors take the CUDA route (custom ops, fake impls): half-TCQ is one tcq_half_linear per
    QuantLinear, after one hadamard_transform per rotation."""
    model = tiny_llama()
    tl.quantize_(model, "tcq2.25", layout="palette_packed", progress=False)
    model.to("meta")
    out, code = compiled_on_meta(model)
    assert out.shape == (2, 5, 256)
    assert code.count("torch_lowbit.tcq_half_linear") == 2 * 4 and "torch_lowbit.tcq_linear" not in code
    assert code.count("torch_lowbit.hadamard_transform") == 2 * 4


def test_tcq_half_linear_op_cpu_impl_matches_kernels():
    gen = fresh_gen()
    f, b, w = palette_weights("tcq2.75", 32, 128, gen)
    name, args = get_layout("palette_packed").kernel_call(f, b)
    x, bias = torch.randn(3, 128, generator=gen), torch.randn(32, generator=gen)
    y = getattr(torch.ops.torch_lowbit, name)(x, *args, b["row_scales"], bias)
    check_palette(x, w, bias, y)


def test_palette_launchers_reject_bad_input(monkeypatch):
    pal = palette_kernels()
    f, b, _ = palette_weights("vq2", 8, 64, fresh_gen())
    words, table, scales = b["codes"], b["table"], b["row_scales"]
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got torch.float64"):
        pal.codebook_linear(torch.randn(1, 64).double(), words, 4, table, scales)
    with pytest.raises(ValueError, match=r"codes must be int32 \[N, 16\]"):
        pal.codebook_linear(torch.randn(1, 64), words[:, :8], 4, table, scales)
    with pytest.raises(ValueError, match=r"table must be fp32 \[2\^code_bits = 32"):
        pal.codebook_linear(torch.randn(1, 64), words, 5, table, scales)
    with pytest.raises(ValueError, match=r"row_scales must be fp16 \[8\]"):
        pal.codebook_linear(torch.randn(1, 64), words, 4, table, scales.float())
    with pytest.raises(ValueError, match="bias must have 8 elements"):
        pal.codebook_linear(torch.randn(1, 64), words, 4, table, scales, torch.zeros(9))
    with pytest.raises(ValueError, match="codes is on cpu but x is on meta"):
        pal.codebook_linear(torch.randn(1, 64, device="meta"), words, 4, table, scales)
    t, tb, tw = palette_weights("tcq2.25", 16, 64, fresh_gen())
    _, args = get_layout("palette_packed").kernel_call(t, tb)
    with pytest.raises(ValueError, match="x has 48 features, the weight has K=64"):
        pal.tcq_half_linear(torch.randn(1, 48), *args, tb["row_scales"])
    with pytest.raises(ValueError, match="signed table"):
        pal.tcq_linear(torch.randn(1, 32), args[0], args[1][:512], *args[2:4], tb["row_scales"])
    with pytest.raises(ValueError, match=r"codes must be int32 \[N/16, K/16, 16\]"):
        pal.tcq_linear(torch.randn(1, 32), args[4], *args[1:4], tb["row_scales"])
    needs_interpreter_on_cpu(monkeypatch, lambda: pal.codebook_linear(torch.randn(1, 64), words, 4, table, scales))


@on_cuda
@pytest.mark.parametrize("fmt", ["nuq3", "vq2", "vq5", "tcq2", "tcq5", "tcq2.25"])
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_cuda_palette_kernels_match_reference_at_real_sizes(fmt, m):
    """Random codes (TCQ's Viterbi encoder is CPU-only at this size), through the CUDA ops (autotuned)
    and every config kind; the whole QuantLinear (rotation included) where quantizing is quick."""
    gen = torch.Generator().manual_seed(m)
    f, b, w = palette_weights(fmt, 4096, 4096, gen, device="cuda")
    w = w.double()
    bias = torch.randn(4096, generator=gen).cuda()
    name, args = get_layout("palette_packed").kernel_call(f, b)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
    for dtype in DTYPES:
        x = torch.randn(m, 4096, device="cuda").to(dtype)
        ref = x.double() @ w.T + bias.double()
        y = getattr(torch.ops.torch_lowbit, name)(x, *args, b["row_scales"], bias)
        assert y.dtype == dtype and ((y.double() - ref).norm() / ref.norm()).item() < tol[dtype]
        for cfg in (GEMV_CONFIGS if m <= 4 else DOT_CONFIGS):
            y, _ = palette_linear(f, b, x, bias, cfg)
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol[dtype]
    if not fmt.startswith("tcq"):
        lin = torch.nn.Linear(4096, 4096)
        q = tl.QuantLinear.from_linear(lin, fmt, layout="palette_packed").cuda()
        assert tl.QuantLinear.from_linear(lin.cuda(), fmt).layout.name == "palette_packed"
        wq = q.dequantize().double()
        for dtype in DTYPES:
            x = torch.randn(m, 4096, device="cuda").to(dtype)
            ref = x.double() @ wq.T + q.bias.double()
            y = q(x)  # Triton Hadamard + fused kernel
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol[dtype] * 2  # x' rounded once
