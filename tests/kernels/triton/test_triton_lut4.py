"""The lut4_rowmajor Triton kernels (q4_0, iq4_nl, int4_g*): every path (CUDA-core split-K GEMV,
tiled tl.dot with and without split-K) against the reference dequantizer under the interpreter, the
launchers' input checks, fused projections as one launch, the fake path a CUDA model compiles through;
`TRITON_INTERPRET=0 pytest -m gpu` runs them on CUDA at 4096x4096."""
import pytest
import torch

import torch_lowbit as tl

from conftest import assert_matches_product, tiny_llama, triton_available
from triton_helpers import (
    CountLaunches, DOT_CONFIGS, DTYPES, GEMV_CONFIGS, LUT4_FORMATS, check_lut4, compiled_on_meta, fresh_gen,
    lut4_kernels, matmul_module, needs_interpreter_on_cpu, on_cuda, quantized_lut4, run_lut4)

SEED_FILE = "test_triton_kernels.py"  # split out of tests/test_triton_kernels.py: its seeds (conftest.stable_seed)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


# M = 1, 3: GEMV (M <= GEMV_MAX_M = 4); 17, 33: tl.dot with a ragged M tile. K: 3 groups (not a
# multiple of 64 for g32, of 128 for g64); N odd or ragged against the 32/64-row tiles.
_MS = ((1, 97), (3, 61), (17, 45), (33, 130))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("m,n", _MS)
@pytest.mark.parametrize("fmt", LUT4_FORMATS)
def test_default_paths_match_reference(fmt, m, n, dtype):
    f = tl.get_format(fmt)
    bias = (m + DTYPES.index(dtype)) % 2 == 1  # half the cases with a fused bias, spread over M and dtype
    q, _ = quantized_lut4(fmt, f.group_size * 3, n, bias, fresh_gen())
    x = (torch.randn(m, f.group_size * 3, generator=fresh_gen()) * 2).to(dtype)
    check_lut4(q, x, run_lut4(q, x))
    assert matmul_module().kernel_kind(m) == ("gemv" if m <= 4 else "dot")


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64"])  # without and with mins
@pytest.mark.parametrize("m,config", [(1, GEMV_CONFIGS[0]), (4, GEMV_CONFIGS[1]), (2, GEMV_CONFIGS[1]),
                                      (5, DOT_CONFIGS[0]), (33, DOT_CONFIGS[1])])
def test_forced_configs_split_k_match_reference(fmt, m, config):
    """Launch configs the autotuner may pick on a GPU: split-K (with empty K slices), wide tiles."""
    k, n = 320, 77
    q, _ = quantized_lut4(fmt, k, n, True, fresh_gen())
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, m, k, generator=fresh_gen()).to(dtype)  # 3-D input: leading dims flatten
        check_lut4(q, x, run_lut4(q, x, config))


def test_split_k_is_deterministic():
    q, _ = quantized_lut4("iq4_nl", 256, 40, True, fresh_gen())
    x = torch.randn(3, 256, generator=fresh_gen())
    cfg = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=2)
    assert torch.equal(run_lut4(q, x, cfg), run_lut4(q, x, cfg))


class _SharedMemoryLimit:
    """A kernel whose launch raises Triton's OutOfResources, as a real GPU does, above a tile budget."""

    def __init__(self, kernel, max_stages, max_block_k):
        self.kernel, self.max_stages, self.max_block_k, self.tried = kernel, max_stages, max_block_k, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tried.append((kwargs["num_stages"], kwargs["BLOCK_K"]))
            if kwargs["num_stages"] > self.max_stages or kwargs["BLOCK_K"] > self.max_block_k:
                from triton.runtime.errors import OutOfResources
                raise OutOfResources(300_000, 232_448, "shared memory")
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_configs_that_do_not_fit_the_gpu_step_down(monkeypatch):
    """A config (forced, tuned or default) the GPU rejects for shared memory runs smaller — one stage,
    then half BLOCK_K in whole k_units — and the fitting config is remembered for the next call."""
    lut4, matmul = lut4_kernels(), matmul_module()
    limit = _SharedMemoryLimit(lut4._lut4_linear_kernel, max_stages=1, max_block_k=128)
    monkeypatch.setattr(lut4, "_lut4_linear_kernel", limit)
    monkeypatch.setattr(matmul, "_fitted", {})
    q, _ = quantized_lut4("q4_0", 32 * 20, 37, True, fresh_gen())
    x = torch.randn(17, 32 * 20, generator=fresh_gen())
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)
    check_lut4(q, x, run_lut4(q, x, cfg))
    assert limit.tried == [(2, 512), (1, 512), (1, 256), (1, 128)]  # BLOCK_K stays a multiple of 128
    limit.tried.clear()
    check_lut4(q, x, run_lut4(q, x, cfg))
    assert limit.tried == [(1, 128)]
    assert matmul.smaller_config(dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=128, num_stages=1), k_unit=128) \
        == dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_stages=1)
    assert matmul.smaller_config(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_stages=1)) is None
    limit.max_block_k = 0  # nothing fits: an error naming the fix, not a silent wrong answer
    monkeypatch.setattr(matmul, "_fitted", {})
    with pytest.raises(RuntimeError, match="no launch config down from .* fits this GPU"):
        run_lut4(q, x, cfg)


def test_empty_input_and_quantlinear_route():
    q, lin = quantized_lut4("q4_0", 64, 24, True, fresh_gen())
    assert run_lut4(q, torch.randn(0, 64)).shape == (0, 24)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with tl.use_backend("triton"):
        y = q(x)
    check_lut4(q, x, y)


def test_launcher_rejects_bad_input(monkeypatch):
    lut4 = lut4_kernels()
    q, _ = quantized_lut4("int4_g32", 64, 8, False, fresh_gen())
    args = (q.qweight, q.scales, q.mins, q.lut, 32)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got torch.float64"):
        lut4.lut4_linear(torch.randn(1, 64).double(), *args)
    with pytest.raises(ValueError, match="x has 32 features, the weight has K=64"):
        lut4.lut4_linear(torch.randn(1, 32), *args)
    with pytest.raises(ValueError, match="group size 48 must be a multiple of 32 dividing K=64"):
        lut4.lut4_linear(torch.randn(1, 64), q.qweight, q.scales, q.mins, q.lut, 48)
    with pytest.raises(ValueError, match=r"scales must be fp16 \[8, 2\]"):
        lut4.lut4_linear(torch.randn(1, 64), q.qweight, q.scales.float(), q.mins, q.lut, 32)
    with pytest.raises(ValueError, match="lut must be 16 fp32 values"):
        lut4.lut4_linear(torch.randn(1, 64), q.qweight, q.scales, q.mins, q.lut.double(), 32)
    with pytest.raises(ValueError, match="bias must have 8 elements"):
        lut4.lut4_linear(torch.randn(1, 64), *args, torch.zeros(9))
    with pytest.raises(ValueError, match="qweight is on cpu but x is on meta"):
        lut4.lut4_linear(torch.randn(1, 64, device="meta"), *args)
    needs_interpreter_on_cpu(monkeypatch, lambda: lut4.lut4_linear(torch.randn(1, 64), *args))


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64", "iq4_nl"])
def test_lut4_gemv_kernel_every_path(fmt):
    """lut4's GEMV kind: the bit-trick values (affine tables, fp16/bf16 activations) and the table
    gathers (iq4_nl, fp32 activations), M = 1..4 rows, K ragged against BLOCK_K (K = 96 / 352: 3 /
    11 runs of 32; 192 / 448 for group 64), split-K slices, odd N, with and without bias."""
    gen = fresh_gen()
    for k, n in ((96, 37), (352, 19)) if tl.get_format(fmt).group_size == 32 else ((192, 37), (448, 19)):
        q, _ = quantized_lut4(fmt, k, n, bool(torch.randint(0, 2, (), generator=gen)), gen)
        assert (matmul_module().table_form(q.lut) is None) == (fmt == "iq4_nl")
        for m, dtype in zip((1, 4, 3) if k < 300 else (4, 1, 2), DTYPES):
            x = torch.randn(m, k, generator=gen).to(dtype)
            for cfg in (dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=2),
                        dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=2),
                        dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)):
                check_lut4(q, x, run_lut4(q, x, cfg))


def test_cpu_only_layout_names_the_cuda_layout_for_triton():
    """A CPU-only layout has no fused Triton op: op_call says which layout to repack into."""
    q = tl.QuantLinear.from_linear(torch.nn.Linear(64, 8), "int4_g32", layout="lut4_i8_n16")
    with pytest.raises(ValueError, match='layout="lut4_rowmajor"'):
        q.layout.op_call(q.fmt, q._buffers, torch.randn(1, 64), None)


def test_table_form_detects_affine_tables():
    mm = matmul_module()
    assert mm.table_form(tl.get_format("q4_0").code_values().float()) == (1.0, -8.0)
    assert mm.table_form(tl.get_format("int4_g128").code_values().float()) == (1.0, 0.0)
    assert mm.table_form(tl.get_format("iq4_nl").code_values().float()) is None
    t = torch.arange(16, dtype=torch.float32) * 0.5 - 2
    assert mm.table_form(t) == (0.5, -2.0)
    t[7] += 1e-3  # one entry off the line, after the first call: the version check re-reads it
    assert mm.table_form(t) is None


def test_fused_projections_run_as_one_launch_with_view_outputs(monkeypatch):
    lut4 = lut4_kernels()
    counter = CountLaunches(lut4._lut4_linear_kernel)
    monkeypatch.setattr(lut4, "_lut4_linear_kernel", counter)
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits
    tl.quantize_(model, "q4_0", layout="lut4_rowmajor", progress=False)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    seen = {}
    for name, mod in (("qkv", attn.qkv_proj), ("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj),
                      ("gate_up", mlp.gate_up_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj)):
        mod.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out))
    with torch.no_grad():
        with tl.use_backend("reference"):
            y_ref = model(ids).logits
        counter.grids.clear()
        with tl.use_backend("triton"):
            y = model(ids).logits  # last: `seen` holds this pass's outputs
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    assert (y - ref).norm() / ref.norm() < 0.5
    # one matmul launch per QuantLinear: qkv, o, gate_up, down in each of the 2 layers (not 14)
    assert len(counter.grids) == 2 * 4
    for fused, parts in (("qkv", "qkv"), ("gate_up", ("gate", "up"))):
        base = seen[fused]
        for p in (("q", "k", "v") if parts == "qkv" else parts):
            assert seen[p]._is_view() and seen[p].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_fused_module_gemv_is_one_launch(monkeypatch):
    lut4 = lut4_kernels()
    counter = CountLaunches(lut4._lut4_gemv_kernel)
    monkeypatch.setattr(lut4, "_lut4_gemv_kernel", counter)
    gen = fresh_gen()
    lins = [torch.nn.Linear(128, n) for n in (64, 32, 32)]
    fused = tl.QuantLinear.from_linears(lins, "int4_g64", layout="lut4_rowmajor")
    x = torch.randn(1, 2, 128, generator=gen, dtype=torch.float32).to(torch.float16)
    with tl.use_backend("triton"):
        parts = fused(x).split(fused.split_sizes, dim=-1)
    assert [len(grid) for grid in counter.grids] == [2]  # one GEMV launch (M = 2)
    w = fused.dequantize().split(fused.split_sizes)
    b = fused.bias.split(fused.split_sizes)
    for part, wi, bi in zip(parts, w, b):
        assert_matches_product(part, x, wi, bi, weights_in=torch.float16)


def test_compile_fullgraph_on_the_fake_path():
    """What a CUDA model compiles through: QuantLinear on a non-CPU device calls the custom op, whose
    fake impl gives shapes/dtypes; the meta device runs exactly that path (fullgraph: no break)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    model = tiny_llama()
    tl.quantize_(model, "int4_g64", layout="lut4_rowmajor", progress=False)
    model.to("meta")
    out, code = compiled_on_meta(model)
    assert out.shape == (2, 5, 256) and out.device.type == "meta"
    assert code.count("torch_lowbit.lut4_linear") == 2 * 4  # fused: one op per fused module
    # the fake impl on (fake) CUDA tensors: output in x's dtype and device
    q = model.model.layers[0].mlp.down_proj
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, q.in_features, dtype=torch.float16, device="cuda")
        b = {n: torch.empty(t.shape, dtype=t.dtype, device="cuda") for n, t in
             (("qweight", q.qweight), ("scales", q.scales), ("mins", q.mins), ("lut", q.lut))}
        y = torch.ops.torch_lowbit.lut4_linear(x, b["qweight"], b["scales"], b["mins"], b["lut"], 64, None)
        assert y.shape == (3, q.out_features) and y.dtype == torch.float16 and y.device.type == "cuda"


# -- GPU -----------------------------------------------------------------------------------------
@on_cuda
@pytest.mark.parametrize("fmt", ["q4_0", "iq4_nl", "int4_g32", "int4_g64", "int4_g128"])
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_cuda_kernels_match_reference_at_real_sizes(fmt, m):
    q, _ = quantized_lut4(fmt, 4096, 4096, True, torch.Generator().manual_seed(m), device="cuda")
    w = q.dequantize().double()
    for dtype in DTYPES:
        x = torch.randn(m, 4096, device="cuda").to(dtype)
        ref = x.double() @ w.T + q.bias.double()
        with tl.use_backend("auto"):
            y = q(x)  # through the CUDA custom op, autotuned config
        assert y.dtype == dtype
        # fp32: tl.dot in ieee fp32; fp16/bf16: weight tile rounded to x's dtype on the tensor cores
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
        assert ((y.double() - ref).norm() / ref.norm()).item() < tol
        configs = GEMV_CONFIGS if m <= 4 else DOT_CONFIGS  # the split-K variants too
        for cfg in configs:
            y = run_lut4(q, x, cfg)
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol
