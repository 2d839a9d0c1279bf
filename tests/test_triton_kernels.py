"""The Triton kernels of the lut4_rowmajor layout (q4_0, iq4_nl, int4_g*): every kernel path (CUDA-core
split-K GEMV, tiled tl.dot with and without split-K) against the reference dequantizer under the
interpreter, the launcher's input checks, the autotune cache, fused projections as one launch, and
the fake path a CUDA model compiles through. `TRITON_INTERPRET=0 pytest -m gpu` runs the comparisons on
CUDA at 4096x4096."""
import json
import os

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.layouts import get_layout

from conftest import tiny_llama, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")

LUT4_FORMATS = [f for f in tl.formats() if get_layout("lut4_rowmajor").supports(tl.get_format(f))]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# fp32: only summation order differs; fp16/bf16: the output is rounded (and on GPU the weight tile too)
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 6e-3}


def _kernels():
    from torch_lowbit.triton_kernels import lut4
    return lut4


def _quantized(fmt, k, n, bias, gen, device="cpu"):
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1) * 0.05)
        lin.weight[:, ::7] *= 4
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return tl.QuantLinear.from_linear(lin.to(device), fmt, layout="lut4_rowmajor"), lin


def _run(q, x, config=None):
    return _kernels().lut4_linear(x, q.qweight, q.scales, getattr(q, "mins", None), q.lut, q.fmt.group_size,
                                  q.bias, config=config)


def _check(q, x, y):
    ref = x.double() @ q.dequantize().double().T
    if q.bias is not None:
        ref = ref + q.bias.double()
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], q.out_features)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < TOL[x.dtype], f"relative error {rel}"


def _gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


# M = 1, 3: GEMV (M <= GEMV_MAX_M = 4); 17, 33: tl.dot with a ragged M tile. K: 3 groups (not a
# multiple of 64 for g32, of 128 for g64); N odd or ragged against the 32/64-row tiles.
_MS = ((1, 97), (3, 61), (17, 45), (33, 130))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("m,n", _MS)
@pytest.mark.parametrize("fmt", LUT4_FORMATS)
def test_default_paths_match_reference(fmt, m, n, dtype):
    f = tl.get_format(fmt)
    bias = (m + DTYPES.index(dtype)) % 2 == 1  # half the cases with a fused bias, spread over M and dtype
    q, _ = _quantized(fmt, f.group_size * 3, n, bias, _gen())
    x = (torch.randn(m, f.group_size * 3, generator=_gen()) * 2).to(dtype)
    _check(q, x, _run(q, x))
    assert _kernels().kernel_kind(m) == ("gemv" if m <= 4 else "dot")


GEMV_CONFIGS = [dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=2),
                dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=8, num_warps=4, num_stages=2)]  # 8 slices: some empty
DOT_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=3),
               dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3)]


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64"])  # without and with mins
@pytest.mark.parametrize("m,config", [(1, GEMV_CONFIGS[0]), (4, GEMV_CONFIGS[1]), (2, GEMV_CONFIGS[1]),
                                      (5, DOT_CONFIGS[0]), (33, DOT_CONFIGS[1])])
def test_forced_configs_split_k_match_reference(fmt, m, config):
    """Launch configs the autotuner may pick on a GPU: split-K (with empty K slices), wide tiles."""
    k, n = 320, 77
    q, _ = _quantized(fmt, k, n, True, _gen())
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, m, k, generator=_gen()).to(dtype)  # 3-D input: leading dims flatten
        _check(q, x, _run(q, x, config))


def test_split_k_is_deterministic():
    q, _ = _quantized("iq4_nl", 256, 40, True, _gen())
    x = torch.randn(3, 256, generator=_gen())
    cfg = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=2)
    assert torch.equal(_run(q, x, cfg), _run(q, x, cfg))


def test_empty_input_and_quantlinear_route():
    q, lin = _quantized("q4_0", 64, 24, True, _gen())
    assert _run(q, torch.randn(0, 64)).shape == (0, 24)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with tl.use_backend("triton"):
        y = q(x)
    _check(q, x, y)


def test_launcher_rejects_bad_input(monkeypatch):
    lut4 = _kernels()
    q, _ = _quantized("int4_g32", 64, 8, False, _gen())
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
    monkeypatch.setattr(lut4, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        lut4.lut4_linear(torch.randn(1, 64), *args)


class _CountLaunches:
    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_fused_projections_run_as_one_launch_with_view_outputs(monkeypatch):
    lut4 = _kernels()
    counters = {name: _CountLaunches(getattr(lut4, name)) for name in ("_lut4_gemv_kernel", "_lut4_matmul_kernel")}
    for name, c in counters.items():
        monkeypatch.setattr(lut4, name, c)
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
        for c in counters.values():
            c.grids.clear()
        with tl.use_backend("triton"):
            y = model(ids).logits  # last: `seen` holds this pass's outputs
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    assert (y - ref).norm() / ref.norm() < 0.5
    # one matmul launch per QuantLinear: qkv, o, gate_up, down in each of the 2 layers (not 14)
    assert sum(len(c.grids) for c in counters.values()) == 2 * 4
    for fused, parts in (("qkv", "qkv"), ("gate_up", ("gate", "up"))):
        base = seen[fused]
        for p in (("q", "k", "v") if parts == "qkv" else parts):
            assert seen[p]._is_view() and seen[p].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_fused_module_gemv_is_one_launch(monkeypatch):
    lut4 = _kernels()
    counter = _CountLaunches(lut4._lut4_gemv_kernel)
    monkeypatch.setattr(lut4, "_lut4_gemv_kernel", counter)
    gen = _gen()
    lins = [torch.nn.Linear(128, n) for n in (64, 32, 32)]
    fused = tl.QuantLinear.from_linears(lins, "int4_g64", layout="lut4_rowmajor")
    x = torch.randn(1, 2, 128, generator=gen, dtype=torch.float32).to(torch.float16)
    with tl.use_backend("triton"):
        parts = fused(x).split(fused.split_sizes, dim=-1)
    assert len(counter.grids) == 1
    w = fused.dequantize().split(fused.split_sizes)
    b = fused.bias.split(fused.split_sizes)
    for part, wi, bi in zip(parts, w, b):
        ref = x.double() @ wi.double().T + bi.double()
        assert ((part.double() - ref).norm() / ref.norm()).item() < TOL[torch.float16]


def test_compile_fullgraph_on_the_fake_path():
    """What a CUDA model compiles through: QuantLinear on a non-CPU device calls the custom op, whose
    fake impl gives shapes/dtypes; the meta device runs exactly that path (fullgraph: no break)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    model = tiny_llama()
    tl.quantize_(model, "int4_g64", layout="lut4_rowmajor", progress=False)
    model.to("meta")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    ids = torch.randint(0, 256, (2, 5), device="meta")
    with torch.no_grad():
        out = compiled(ids, use_cache=False).logits
    assert out.shape == (2, 5, 256) and out.device.type == "meta"
    code = "".join(g.code for g in graphs)
    assert code.count("torch_lowbit.lut4_linear") == 2 * 4  # fused: one op per fused module
    # the fake impl on (fake) CUDA tensors: output in x's dtype and device
    q = model.model.layers[0].mlp.down_proj
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, q.in_features, dtype=torch.float16, device="cuda")
        b = {n: torch.empty(t.shape, dtype=t.dtype, device="cuda") for n, t in
             (("qweight", q.qweight), ("scales", q.scales), ("mins", q.mins), ("lut", q.lut))}
        y = torch.ops.torch_lowbit.lut4_linear(x, b["qweight"], b["scales"], b["mins"], b["lut"], 64, None)
        assert y.shape == (3, q.out_features) and y.dtype == torch.float16 and y.device.type == "cuda"


# -- autotune ------------------------------------------------------------------------------------
def test_autotune_bucket_and_no_timing_without_gpu():
    from torch_lowbit.triton_kernels import autotune
    assert [autotune.m_bucket(m) for m in (1, 2, 3, 5, 17, 33, 512, 5000)] == [1, 2, 4, 8, 32, 64, 512, 1024]

    def run(cfg):
        raise AssertionError("no timing on CPU tensors / under the interpreter")

    default = {"BLOCK_N": 32}
    assert autotune.pick("k", "key", [{"BLOCK_N": 16}], default, run, torch.device("cpu")) is default


def test_autotune_times_once_and_caches_per_gpu(tmp_path, monkeypatch):
    """The GPU branch with a stand-in timer: the fastest candidate wins, lands in the JSON file under
    the GPU's name, and later calls (and a fresh process) reuse it without timing."""
    from torch_lowbit.triton_kernels import autotune
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "INTERPRET", False)
    monkeypatch.setattr(autotune, "_capturing", lambda: False)
    monkeypatch.setattr(autotune, "_device_key", lambda device: "Fake GPU / triton 0")
    monkeypatch.setattr(autotune, "time_us", lambda fn: fn())
    autotune.reset_cache_for_tests()
    cands = [{"BLOCK_N": 16}, {"BLOCK_N": 32}, {"BLOCK_N": 64}, {"BLOCK_N": 128}]
    timed = []

    def run(cfg):
        timed.append(cfg["BLOCK_N"])
        if cfg["BLOCK_N"] == 128:
            raise RuntimeError("out of resources")  # a config this GPU cannot run is skipped
        return {16: 9.0, 32: 3.0, 64: 5.0}[cfg["BLOCK_N"]]

    cuda = torch.device("cuda")
    try:
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        assert timed == [16, 32, 64, 128]
        on_disk = json.loads((tmp_path / "triton_autotune.json").read_text())
        assert on_disk == {"Fake GPU / triton 0": {"lut4_gemv": {"m1_n64_k64": {"BLOCK_N": 32}}}}
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        autotune.reset_cache_for_tests()  # as a new process: read back from the file
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        assert timed == [16, 32, 64, 128]  # never timed again
    finally:
        autotune.reset_cache_for_tests()


# -- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="conftest defaults to the interpreter: run with TRITON_INTERPRET=0 to test the GPU kernels")
@pytest.mark.parametrize("fmt", ["q4_0", "iq4_nl", "int4_g32", "int4_g64", "int4_g128"])
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_cuda_kernels_match_reference_at_real_sizes(fmt, m):
    q, _ = _quantized(fmt, 4096, 4096, True, torch.Generator().manual_seed(m), device="cuda")
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
            y = _run(q, x, cfg)
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol
