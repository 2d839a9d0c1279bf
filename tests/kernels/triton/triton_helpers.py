"""What the Triton kernel tests share: the lut4 module under test, the matmul skeleton, a lut4_rowmajor
module on random weights, the reference check, the `-m gpu` marker set."""
import os

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.layouts import get_layout

from conftest import assert_matches_product, random_linear

LUT4_FORMATS = [f for f in tl.formats() if get_layout("lut4_rowmajor").supports(tl.get_format(f))]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lut4_kernels():
    from torch_lowbit.triton_kernels import lut4
    return lut4


def matmul_module():
    from torch_lowbit.triton_kernels import matmul
    return matmul


def on_cuda(test):
    """The `-m gpu` tests: real kernels on CUDA at real sizes (the suite otherwise defaults to the interpreter)."""
    for mark in (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
                 pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="conftest defaults to the "
                                    "interpreter: run with TRITON_INTERPRET=0 to test the GPU kernels")):
        test = mark(test)
    return test


def needs_interpreter_on_cpu(monkeypatch, call):
    """Without TRITON_INTERPRET=1 a launcher refuses CPU tensors with an error naming the fix."""
    monkeypatch.setattr(matmul_module(), "INTERPRET", False)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        call()


def quantized_lut4(fmt, k, n, bias, gen, device="cpu"):
    lin = random_linear(k, n, bias, gen)
    return tl.QuantLinear.from_linear(lin.to(device), fmt, layout="lut4_rowmajor"), lin


def run_lut4(q, x, config=None):
    return lut4_kernels().lut4_linear(x, q.qweight, q.scales, getattr(q, "mins", None), q.lut, q.fmt.group_size,
                                  q.bias, config=config)


def check_lut4(q, x, y):
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], q.out_features)
    assert_matches_product(y, x, q.dequantize(), q.bias, weights_in=x.dtype)


def fresh_gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


# -- stream_rowmajor (int1/2/3) and gcb_rowmajor: triton_kernels/lowbit.py ------------------------
def lowbit_kernels():
    from torch_lowbit.triton_kernels import lowbit
    return lowbit



def lowbit_module(fmt, k, n, gen, device="cpu"):
    layout = "gcb_rowmajor" if fmt.startswith("gcb") else "stream_rowmajor"
    lin = random_linear(k, n, True, gen)
    return tl.QuantLinear.from_linear(lin, fmt, layout=layout).to(device)



def lowbit_args(q):
    """(kernel function name, args after x and before bias) of a stream_rowmajor / gcb_rowmajor module."""
    if q.layout.name == "gcb_rowmajor":
        return "gcb", (q.codes, q.fmt.bits, q.sub_groups, q.super_scales, q.codebooks)
    return "lowbit", (q.codes, q.fmt.code_bits, q.scales, getattr(q, "mins", None), q.lut, q.fmt.group_size)


GEMV_CONFIGS = [dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=2),
                dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=8, num_warps=4, num_stages=2)]  # 8 slices: some empty


DOT_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=3),
               dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3)]



class CountLaunches:
    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]



def compiled_on_meta(model):
    """Logits of a fullgraph compile of a meta-device model, and the code of the captured graphs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        out = compiled(torch.randint(0, 256, (2, 5), device="meta"), use_cache=False).logits
    return out, "".join(g.code for g in graphs)


# -- palette_packed (nuq / vq / tcq / half-TCQ) ---------------------------------------------------
def palette_kernels():
    from torch_lowbit.triton_kernels import palette
    return palette



def palette_weights(fmt, n, k, gen, device="cpu"):
    """palette_packed buffers of random codes (every code / state pattern, both halves of TCQ's signed
    table) and the format's own reference decode W' = dequantize_rotated."""
    f = tl.get_format(fmt)
    lay = get_layout("palette_packed")
    q = {}
    for name, (shape, dtype) in f.code_shapes(n, k).items():
        if dtype == torch.int32:  # TCQ words: any bit pattern is a valid tail-biting sequence
            q[name] = torch.randint(-2**31, 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32)
        else:
            q[name] = torch.randint(0, 2 ** f.code_bits, shape, generator=gen).to(dtype)
    q["row_scales"] = torch.rand(n, generator=gen).add(0.5).half()
    buffers = {**lay.pack(f, q), **lay.runtime_buffers(f)}
    return f, {name: t.to(device) for name, t in buffers.items()}, f.dequantize_rotated(q).to(device)



def palette_linear(f, buffers, x, bias, config=None):
    name, args = get_layout("palette_packed").kernel_call(f, buffers)
    return getattr(palette_kernels(), name)(x, *args, buffers["row_scales"], bias, config=config), name



def check_palette(x, w, bias, y):
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    assert_matches_product(y, x, w, bias, weights_in=x.dtype)
