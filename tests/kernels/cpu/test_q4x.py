"""The interleaved ARM layouts q4_4x4 / q4_4x8 / q4_8x8 (torch_lowbit/layouts/q4x.py, csrc/common/q4x.h): bytes in
llama.cpp's Q4_0_4_4 / 4_8 / 8_8 interleaving, the kernels' results equal to the x86 tiles' bit for bit on every
path here (the ARM paths are checked under qemu in test_arm_kernels.py), the per-CPU choice and the repack of a
checkpoint packed for another CPU."""
import logging

import pytest
import torch

import torch_lowbit as tl
from conftest import random_linear
from torch_lowbit.layouts import base as layout_base
from torch_lowbit.layouts import get_layout
from torch_lowbit.ops import cpu_extension

LAYOUTS = ["q4_4x4", "q4_4x8", "q4_8x8"]
FORMATS = ["q4_0", "iq4_nl", "int4_pc"]


def _gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_follow_ggml_interleaving(layout):
    """qweight[g, b] is ggml's make_block_q4_0x{R}(blocks of rows gR .. gR+R-1, interleave S, xor 0x88).qs,
    written here as ggml's loop (byte i of the output from src_id = (i % (R S)) // S, offset (i // (R S)) S)."""
    gen = _gen()
    lin = random_linear(96, 11, False, gen)
    q = tl.QuantLinear.from_linear(lin, "q4_0", layout=layout)
    ref = tl.get_format("q4_0").quantize(lin.weight)
    rows, chunk = get_layout(layout).rows, get_layout(layout).chunk
    codes = torch.cat([ref["codes"], torch.zeros(rows * q.qweight.shape[0] - 11, 96, dtype=torch.uint8)])
    qs = codes.reshape(-1, 3, 2, 16)  # row, block, half, j: ggml's qs byte j = code j | code j + 16 << 4
    qs = qs[:, :, 0] | (qs[:, :, 1] << 4)
    for g in range(q.qweight.shape[0]):
        for b in range(3):
            expect = [int(qs[g * rows + (i % (rows * chunk)) // chunk, b, (i // (rows * chunk)) * chunk + i % chunk]) ^ 0x88
                      for i in range(16 * rows)]
            assert q.qweight[g, b].tolist() == expect
    assert torch.equal(q.scales.permute(0, 2, 1).reshape(-1, 3)[:11], ref["scales"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_equal_the_x86_tiles_on_every_path(layout, fmt):
    """Same weights in q4_RxS and lut4_i8_n16: identical bytes out (odd N, 1..17 tokens, bias; int8 blocks,
    per-token A8 / A4 and A4 per block of 32), on every CPU path of this machine; dequantize identical."""
    gen = _gen()
    lin = random_linear(256, 37, True, gen)
    tiles = tl.QuantLinear.from_linear(lin, fmt, layout="lut4_i8_n16")
    inter = tl.QuantLinear.from_linear(lin, fmt, layout=layout)
    assert torch.equal(inter.dequantize(), tiles.dequantize())
    for m in (1, 2, 5, 17):
        x = torch.randn(m, 256, generator=gen) * torch.rand(m, 1, generator=gen).add(0.2)
        for path in cpu_extension().available_cpu_paths():
            with tl.use_backend("cpu", path=path):
                assert torch.equal(inter(x), tiles(x)), f"{fmt} {layout} M={m} {path}"
                for bits, block in ((8, 0), (4, 0), (4, 32)):  # per token; per block of 32 features
                    assert torch.equal(tl.ActQuantLinear(inter, bits, clip_ratio=0.9, block=block)(x),
                                       tl.ActQuantLinear(tiles, bits, clip_ratio=0.9, block=block)(x)), \
                        f"A{bits} block {block} {path}"


def test_formats_the_layouts_cannot_hold_are_refused():
    lin = torch.nn.Linear(64, 16)
    for fmt in ("int4_g32", "int2_g64", "nuq4"):
        with pytest.raises(ValueError, match="no mins|q4_0, iq4_nl, int4_pc|cannot|not"):
            tl.QuantLinear.from_linear(lin, fmt, layout="q4_4x8")


def test_compiles_fullgraph():
    gen = _gen()
    q = tl.QuantLinear.from_linear(random_linear(128, 24, True, gen), "q4_0", layout="q4_8x8")
    x = torch.randn(3, 128, generator=gen)
    torch.testing.assert_close(torch.compile(q, fullgraph=True)(x), q(x), rtol=0, atol=0)


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(160, 64), torch.nn.ReLU(), torch.nn.Linear(64, 40))


def test_checkpoints_repack_to_the_loading_cpus_layout(tmp_path, monkeypatch, caplog):
    """A checkpoint packed on an i8mm ARM CPU (q4_4x8) loads here in the x86 tiles, and one packed here loads on
    an i8mm CPU (its preference simulated) in q4_4x8; both with an info line and the same outputs."""
    gen = _gen()
    x = torch.randn(3, 160, generator=gen)
    arm = tl.quantize_(_mlp(), "q4_0", layout="q4_4x8", progress=False)
    tl.save_quantized(arm, tmp_path / "arm.safetensors")
    with caplog.at_level(logging.INFO, logger="torch_lowbit"):
        here = tl.load_quantized(_mlp(), tmp_path / "arm.safetensors")
    expected = "lut4_i8_n16" if "i8mm" not in cpu_extension().available_cpu_paths() else "q4_4x8"
    assert {m.layout.name for m in here.modules() if isinstance(m, tl.QuantLinear)} == {expected}
    assert expected == "q4_4x8" or "repacked 2 layer(s) from q4_4x8 to lut4_i8_n16" in caplog.text
    torch.testing.assert_close(here(x), arm(x), rtol=0, atol=0)
    tl.save_quantized(here, tmp_path / "here.safetensors")
    monkeypatch.setattr(layout_base, "_CPU_PREFERENCES", [lambda fmt: get_layout("q4_4x8")])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torch_lowbit"):
        on_arm = tl.load_quantized(_mlp(), tmp_path / "here.safetensors")
    assert {m.layout.name for m in on_arm.modules() if isinstance(m, tl.QuantLinear)} == {"q4_4x8"}
    torch.testing.assert_close(on_arm(x), arm(x), rtol=0, atol=0)
