"""The Triton kernels of the lut4_rowmajor layout (q4_0, iq4_nl, int4_g*) and of palette_packed (nuq,
vq, tcq, half-TCQ): every kernel path (CUDA-core split-K GEMV, tiled tl.dot with and without split-K)
against the reference dequantizer under the interpreter, the launchers' input checks, the autotune
cache, fused projections as one launch, and the fake path a CUDA model compiles through.
`TRITON_INTERPRET=0 pytest -m gpu` runs the comparisons on CUDA at 4096x4096."""
import json
import os

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.layouts import get_layout

from conftest import assert_matches_product, random_linear, tiny_llama, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")

LUT4_FORMATS = [f for f in tl.formats() if get_layout("lut4_rowmajor").supports(tl.get_format(f))]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    from torch_lowbit.triton_kernels import lut4
    return lut4


def _matmul():
    from torch_lowbit.triton_kernels import matmul
    return matmul


def on_cuda(test):
    """The `-m gpu` tests: real kernels on CUDA at real sizes (the suite otherwise defaults to the interpreter)."""
    for mark in (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
                 pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="conftest defaults to the "
                                    "interpreter: run with TRITON_INTERPRET=0 to test the GPU kernels")):
        test = mark(test)
    return test


def _needs_interpreter_on_cpu(monkeypatch, call):
    """Without TRITON_INTERPRET=1 a launcher refuses CPU tensors with an error naming the fix."""
    monkeypatch.setattr(_matmul(), "INTERPRET", False)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        call()


def _quantized(fmt, k, n, bias, gen, device="cpu"):
    lin = random_linear(k, n, bias, gen)
    return tl.QuantLinear.from_linear(lin.to(device), fmt, layout="lut4_rowmajor"), lin


def _run(q, x, config=None):
    return _kernels().lut4_linear(x, q.qweight, q.scales, getattr(q, "mins", None), q.lut, q.fmt.group_size,
                                  q.bias, config=config)


def _check(q, x, y):
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], q.out_features)
    assert_matches_product(y, x, q.dequantize(), q.bias, weights_in=x.dtype)


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
    assert _matmul().kernel_kind(m) == ("gemv" if m <= 4 else "dot")


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
    lut4, matmul = _kernels(), _matmul()
    limit = _SharedMemoryLimit(lut4._lut4_linear_kernel, max_stages=1, max_block_k=128)
    monkeypatch.setattr(lut4, "_lut4_linear_kernel", limit)
    monkeypatch.setattr(matmul, "_fitted", {})
    q, _ = _quantized("q4_0", 32 * 20, 37, True, _gen())
    x = torch.randn(17, 32 * 20, generator=_gen())
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)
    _check(q, x, _run(q, x, cfg))
    assert limit.tried == [(2, 512), (1, 512), (1, 256), (1, 128)]  # BLOCK_K stays a multiple of 128
    limit.tried.clear()
    _check(q, x, _run(q, x, cfg))
    assert limit.tried == [(1, 128)]
    assert matmul.smaller_config(dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=128, num_stages=1), k_unit=128) \
        == dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_stages=1)
    assert matmul.smaller_config(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_stages=1)) is None
    limit.max_block_k = 0  # nothing fits: an error naming the fix, not a silent wrong answer
    monkeypatch.setattr(matmul, "_fitted", {})
    with pytest.raises(RuntimeError, match="no launch config down from .* fits this GPU"):
        _run(q, x, cfg)


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
    _needs_interpreter_on_cpu(monkeypatch, lambda: lut4.lut4_linear(torch.randn(1, 64), *args))


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64", "iq4_nl"])
def test_lut4_gemv_kernel_every_path(fmt):
    """lut4's GEMV kind: the bit-trick values (affine tables, fp16/bf16 activations) and the table
    gathers (iq4_nl, fp32 activations), M = 1..4 rows, K ragged against BLOCK_K (K = 96 / 352: 3 /
    11 runs of 32; 192 / 448 for group 64), split-K slices, odd N, with and without bias."""
    gen = _gen()
    for k, n in ((96, 37), (352, 19)) if tl.get_format(fmt).group_size == 32 else ((192, 37), (448, 19)):
        q, _ = _quantized(fmt, k, n, bool(torch.randint(0, 2, (), generator=gen)), gen)
        assert (_matmul().table_form(q.lut) is None) == (fmt == "iq4_nl")
        for m, dtype in zip((1, 4, 3) if k < 300 else (4, 1, 2), DTYPES):
            x = torch.randn(m, k, generator=gen).to(dtype)
            for cfg in (dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=2),
                        dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=2),
                        dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)):
                _check(q, x, _run(q, x, cfg))


def test_cpu_only_layout_names_the_cuda_layout_for_triton():
    """A CPU-only layout has no fused Triton op: op_call says which layout to repack into."""
    q = tl.QuantLinear.from_linear(torch.nn.Linear(64, 8), "int4_g32", layout="lut4_i8_n16")
    with pytest.raises(ValueError, match='layout="lut4_rowmajor"'):
        q.layout.op_call(q.fmt, q._buffers, torch.randn(1, 64), None)


def test_table_form_detects_affine_tables():
    mm = _matmul()
    assert mm.table_form(tl.get_format("q4_0").code_values().float()) == (1.0, -8.0)
    assert mm.table_form(tl.get_format("int4_g128").code_values().float()) == (1.0, 0.0)
    assert mm.table_form(tl.get_format("iq4_nl").code_values().float()) is None
    t = torch.arange(16, dtype=torch.float32) * 0.5 - 2
    assert mm.table_form(t) == (0.5, -2.0)
    t[7] += 1e-3  # one entry off the line, after the first call: the version check re-reads it
    assert mm.table_form(t) is None


class _CountLaunches:
    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_fused_projections_run_as_one_launch_with_view_outputs(monkeypatch):
    lut4 = _kernels()
    counter = _CountLaunches(lut4._lut4_linear_kernel)
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
    lut4 = _kernels()
    counter = _CountLaunches(lut4._lut4_linear_kernel)
    monkeypatch.setattr(lut4, "_lut4_linear_kernel", counter)
    gen = _gen()
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


def _compiled_on_meta(model):
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


def test_compile_fullgraph_on_the_fake_path():
    """What a CUDA model compiles through: QuantLinear on a non-CPU device calls the custom op, whose
    fake impl gives shapes/dtypes; the meta device runs exactly that path (fullgraph: no break)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    model = tiny_llama()
    tl.quantize_(model, "int4_g64", layout="lut4_rowmajor", progress=False)
    model.to("meta")
    out, code = _compiled_on_meta(model)
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


# -- autotune ------------------------------------------------------------------------------------
def test_autotune_bucket_and_no_timing_without_gpu():
    from torch_lowbit.triton_kernels import autotune
    assert [autotune.m_bucket(m) for m in (1, 2, 3, 5, 17, 33, 512, 5000)] == [1, 2, 4, 8, 32, 64, 512, 1024]

    def run(cfg):
        raise AssertionError("no timing on CPU tensors / under the interpreter")

    default = {"BLOCK_N": 32}
    assert autotune.pick("k", "key", [{"BLOCK_N": 16}], default, run, torch.device("cpu")) is default


def test_autotune_precompiles_candidates_concurrently():
    """precompile calls run(cfg, warmup=True) for every candidate under Triton's AsyncCompileMode
    (where a launch in warmup only submits its compile to the pool) and swallows a candidate's
    failure, leaving it to the timing loop."""
    from triton.runtime import _async_compile

    from torch_lowbit.triton_kernels import autotune
    seen = []

    def run(cfg, warmup=False):
        mode = _async_compile.active_mode.get()
        assert warmup and mode is not None and mode.executor._max_workers == 2
        seen.append(cfg["BLOCK_N"])
        if cfg["BLOCK_N"] == 64:
            raise RuntimeError("out of resources")

    autotune.precompile([{"BLOCK_N": b} for b in (16, 32, 64, 128)], run, workers=2)
    assert seen == [16, 32, 64, 128] and _async_compile.active_mode.get() is None


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
    timed, compiled = [], []

    def run(cfg, warmup=False):
        if cfg["BLOCK_N"] == 128:
            raise RuntimeError("out of resources")  # a config this GPU cannot run is skipped
        if warmup:  # all compiles submitted before any timing
            assert not timed
            compiled.append(cfg["BLOCK_N"])
            return
        timed.append(cfg["BLOCK_N"])
        return {16: 9.0, 32: 3.0, 64: 5.0}[cfg["BLOCK_N"]]

    cuda = torch.device("cuda")
    try:
        monkeypatch.setenv("TORCH_LOWBIT_AUTOTUNE", "0")  # timing off: the default, nothing compiled
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) is cands[0] and not compiled
        monkeypatch.delenv("TORCH_LOWBIT_AUTOTUNE")
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        assert compiled == [16, 32, 64] and timed == [16, 32, 64]
        on_disk = json.loads((tmp_path / "triton_autotune.json").read_text())
        assert on_disk == {"Fake GPU / triton 0": {"lut4_gemv": {"m1_n64_k64": {"BLOCK_N": 32}}}}
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        # under CUDA-graph capture: the tuned config where the warm-up found one, else the default, untimed
        monkeypatch.setattr(autotune, "_capturing", lambda: True)
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        assert autotune.pick("lut4_gemv", "m2_n64_k64", cands, cands[0], run, cuda) is cands[0]
        assert timed == [16, 32, 64]
        monkeypatch.setattr(autotune, "_capturing", lambda: False)
        autotune.reset_cache_for_tests()  # as a new process: read back from the file
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        assert timed == [16, 32, 64] and compiled == [16, 32, 64]  # never compiled or timed again
    finally:
        autotune.reset_cache_for_tests()


# -- GPU -----------------------------------------------------------------------------------------
@on_cuda
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


@on_cuda
@pytest.mark.parametrize("fmt", ["q4_0", "int4_g128", "int4_pc", "iq4_nl"])
@pytest.mark.parametrize("bits,block", [(8, 0), (4, 0), (4, 16), (4, 32), (2, 8)])
@pytest.mark.parametrize("m", [1, 16, 512])
def test_cuda_integer_activation_kernel_at_real_sizes(fmt, bits, block, m):
    """The integer tl.dot kernel on the GPU (IMMA): the rounding kernel's codes and scales equal
    torch's quantize_act_codes on the same CUDA tensor bit for bit (IEEE divisions, no FP fusion), and
    the product equals the rounded activations times the dequantized weight (split K at M = 1)."""
    from torch_lowbit.core.activations import dequantize_act_codes, quantize_act_codes
    from torch_lowbit.triton_kernels.int_act import round_activations
    gen = torch.Generator().manual_seed(m * 10 + bits)
    q, _ = _quantized(fmt, 4096, 4096, True, gen, device="cuda")
    x = (_block_varied(m, 4096, gen) * 0.1).to("cuda", torch.float16)
    xq, xd = round_activations(x, bits, 0.9, block)
    want_q, want_d = quantize_act_codes(x, bits, 0.9, block)
    assert torch.equal(xq, want_q) and torch.equal(xd, want_d.reshape(xd.shape))  # per token: [M] vs [M, 1]
    mins = getattr(q, "mins", None)
    y = torch.ops.torch_lowbit.lut4_int_linear(x, q.qweight, q.scales, mins, q.lut_i8, q.fmt.group_size, q.bias,
                                               bits, 0.9, block)
    ref = dequantize_act_codes(want_q, want_d).double() @ q.dequantize().double().T + q.bias.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5


# -- palette_packed (nuq / vq / tcq / half-TCQ) ---------------------------------------------------
def _palette():
    from torch_lowbit.triton_kernels import palette
    return palette


def _palette_weights(fmt, n, k, gen, device="cpu"):
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


def _palette_linear(f, buffers, x, bias, config=None):
    name, args = get_layout("palette_packed").kernel_call(f, buffers)
    return getattr(_palette(), name)(x, *args, buffers["row_scales"], bias, config=config), name


def _check_palette(x, w, bias, y):
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    assert_matches_product(y, x, w, bias, weights_in=x.dtype)


# Codebook: N odd, K ragged against the 64-column tiles and the 16-stream word period (531 codes per
# row). TCQ: N = 48 (ragged against 32/64-row tiles; TCQ rows come in bands of 16), K = 17 tiles;
# half-TCQ: halves of 9 tiles, so K/2 = 144 falls inside a 64- or 128-column tile.
_PALETTE_CASES = [("nuq1", 37, 531), ("nuq3", 37, 531), ("vq2", 29, 1062), ("vq5", 29, 1062),
                  ("tcq1.5", 48, 272), ("tcq2.5", 48, 272), ("tcq5", 48, 272), ("tcq2.25", 48, 288),
                  ("tcq4.75", 48, 288)]


@pytest.mark.parametrize("m", [1, 3, 17, 33])  # GEMV (M <= 4), tl.dot with ragged M tiles
@pytest.mark.parametrize("fmt,n,k", _PALETTE_CASES, ids=lambda v: str(v))
def test_palette_kernels_match_reference_decoder(fmt, n, k, m):
    gen = _gen()
    f, b, w = _palette_weights(fmt, n, k, gen)
    for i, dtype in enumerate(DTYPES):
        bias = torch.randn(n, generator=gen) if (m + i) % 2 else None
        x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
        y, _ = _palette_linear(f, b, x, bias)
        _check_palette(x, w, bias, y)


# The GEMV kernels' decoders by code width: nuq pairs of 2 / 4-bit codes (fields within a word), vq
# 3- and 6-bit codes (units of 3 words, straddling fields); TCQ windows from word-aligned rows (S = 4,
# 8) and byte-shifted ones (S = 6, 7), half-TCQ mixing both. K ragged against the K step.
_GEMV_CASES = [("nuq2", 37, 531), ("nuq4", 37, 531), ("vq1.5", 29, 1062), ("vq3", 29, 1062), ("tcq2", 48, 272),
               ("tcq4", 48, 272), ("tcq3", 48, 272), ("tcq3.5", 48, 272), ("tcq2.25", 48, 288)]


@pytest.mark.parametrize("fmt,n,k", _GEMV_CASES, ids=lambda v: str(v))
def test_palette_gemv_kernels_every_path(fmt, n, k):
    """The codebook / TCQ kernels' GEMV kind (M <= 4) at M = 1..4, every activation dtype, with and without
    bias, K steps from one unit (BLOCK_K rounded up to it) to several, split-K with empty slices."""
    pal = _palette()
    gen = _gen()
    f, b, w = _palette_weights(fmt, n, k, gen)
    name = "_tcq_linear_kernel" if fmt.startswith("tcq") else "_codebook_linear_kernel"
    counter = _CountLaunches(getattr(pal, name))
    configs = (dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=3, num_warps=4, num_stages=2),
               dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=2),
               dict(BLOCK_N=32, BLOCK_K=512, SPLIT_K=2, num_warps=8, num_stages=2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pal, name, counter)
        for m, dtype, cfg in zip((1, 4, 3, 2), DTYPES + (torch.float16,), configs + (None,)):
            bias = torch.randn(n, generator=gen) if m % 2 else None
            x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
            y, _ = _palette_linear(f, b, x, bias, cfg)
            _check_palette(x, w, bias, y)
    assert len(counter.grids) == 4


def test_codebook_gemv_reads_wide_scalar_codes():
    """nuq-style codes wider than the pair tables take (5 bits, d = 1): one fp32 lookup per code."""
    from torch_lowbit.core.packing import pack_streams
    gen = _gen()
    n, k, bits = 23, 700, 5
    codes = torch.randint(0, 2 ** bits, (n, k), generator=gen)
    table = torch.randn(2 ** bits, 1, generator=gen)
    scales = torch.rand(n, generator=gen).add(0.5).half()
    w = table[codes, 0] * scales.float()[:, None]
    for m, dtype in ((1, torch.float32), (4, torch.bfloat16)):
        x = torch.randn(m, k, generator=gen).to(dtype)
        y = _palette().codebook_linear(x, pack_streams(codes, bits), bits, table, scales,
                                       config=dict(BLOCK_N=32, BLOCK_K=512, SPLIT_K=2, num_warps=4, num_stages=2))
        _check_palette(x, w, None, y)


@pytest.mark.parametrize("fmt,n,k", _PALETTE_CASES, ids=lambda v: str(v))
def test_palette_dequantize_kernels_are_exact(fmt, n, k):
    """Decode and scale in fp32 as the reference decoder does: bit-exact, also vs the C++ ops."""
    pal = _palette()
    f, b, w = _palette_weights(fmt, n, k, _gen())
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
    gen = _gen()
    f, b, w = _palette_weights(fmt, n, k, gen)
    bias = torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, m, k, generator=gen).to(dtype)  # 3-D input: leading dims flatten
        y, _ = _palette_linear(f, b, x, bias, config)
        _check_palette(x, w, bias, y)
    y1, _ = _palette_linear(f, b, x, bias, config)
    assert torch.equal(y, y1)  # deterministic split-K reduction


def test_half_tcq_is_one_launch(monkeypatch):
    pal = _palette()
    counter = _CountLaunches(pal._tcq_linear_kernel)
    monkeypatch.setattr(pal, "_tcq_linear_kernel", counter)
    gen = _gen()
    f, b, w = _palette_weights("tcq3.75", 32, 192, gen)
    for m in (2, 9):
        x = torch.randn(m, 192, generator=gen)
        y, name = _palette_linear(f, b, x, None, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2)
                                  if m <= 4 else dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4,
                                                      num_stages=3))
        assert name == "tcq_half_linear"
        _check_palette(x, w, None, y)
    assert [len(grid) for grid in counter.grids] == [2, 3]  # one launch per call: GEMV, then tl.dot


@pytest.mark.parametrize("fmt", ["nuq3", "vq2", "tcq2", "tcq2.25"])
def test_palette_quantlinear_triton_route_rotates_with_triton(fmt, monkeypatch):
    """QuantLinear on the triton backend: Triton Hadamard for x' (not the C++ op), then the fused kernel."""
    from torch_lowbit.triton_kernels import hadamard
    counter = _CountLaunches(hadamard._hadamard_kernel)
    monkeypatch.setattr(hadamard, "_hadamard_kernel", counter)
    gen = _gen()
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
    out, code = _compiled_on_meta(model)
    assert out.shape == (2, 5, 256)
    assert code.count("torch_lowbit.tcq_half_linear") == 2 * 4 and "torch_lowbit.tcq_linear" not in code
    assert code.count("torch_lowbit.hadamard_transform") == 2 * 4


def test_tcq_half_linear_op_cpu_impl_matches_kernels():
    gen = _gen()
    f, b, w = _palette_weights("tcq2.75", 32, 128, gen)
    name, args = get_layout("palette_packed").kernel_call(f, b)
    x, bias = torch.randn(3, 128, generator=gen), torch.randn(32, generator=gen)
    y = getattr(torch.ops.torch_lowbit, name)(x, *args, b["row_scales"], bias)
    _check_palette(x, w, bias, y)


def test_palette_launchers_reject_bad_input(monkeypatch):
    pal = _palette()
    f, b, _ = _palette_weights("vq2", 8, 64, _gen())
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
    t, tb, tw = _palette_weights("tcq2.25", 16, 64, _gen())
    _, args = get_layout("palette_packed").kernel_call(t, tb)
    with pytest.raises(ValueError, match="x has 48 features, the weight has K=64"):
        pal.tcq_half_linear(torch.randn(1, 48), *args, tb["row_scales"])
    with pytest.raises(ValueError, match="signed table"):
        pal.tcq_linear(torch.randn(1, 32), args[0], args[1][:512], *args[2:4], tb["row_scales"])
    with pytest.raises(ValueError, match=r"codes must be int32 \[N/16, K/16, 16\]"):
        pal.tcq_linear(torch.randn(1, 32), args[4], *args[1:4], tb["row_scales"])
    _needs_interpreter_on_cpu(monkeypatch, lambda: pal.codebook_linear(torch.randn(1, 64), words, 4, table, scales))


@on_cuda
@pytest.mark.parametrize("fmt", ["nuq3", "vq2", "vq5", "tcq2", "tcq5", "tcq2.25"])
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_cuda_palette_kernels_match_reference_at_real_sizes(fmt, m):
    """Random codes (TCQ's Viterbi encoder is CPU-only at this size), through the CUDA ops (autotuned)
    and every config kind; the whole QuantLinear (rotation included) where quantizing is quick."""
    gen = torch.Generator().manual_seed(m)
    f, b, w = _palette_weights(fmt, 4096, 4096, gen, device="cuda")
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
            y, _ = _palette_linear(f, b, x, bias, cfg)
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


# -- stream_rowmajor (int1/2/3) and gcb_rowmajor: triton_kernels/lowbit.py ------------------------
def _lowbit():
    from torch_lowbit.triton_kernels import lowbit
    return lowbit


def _lowbit_module(fmt, k, n, gen, device="cpu"):
    layout = "gcb_rowmajor" if fmt.startswith("gcb") else "stream_rowmajor"
    lin = random_linear(k, n, True, gen)
    return tl.QuantLinear.from_linear(lin, fmt, layout=layout).to(device)


def _lowbit_args(q):
    """(kernel function name, args after x and before bias) of a stream_rowmajor / gcb_rowmajor module."""
    if q.layout.name == "gcb_rowmajor":
        return "gcb", (q.codes, q.fmt.bits, q.sub_groups, q.super_scales, q.codebooks)
    return "lowbit", (q.codes, q.fmt.code_bits, q.scales, getattr(q, "mins", None), q.lut, q.fmt.group_size)


# int3 (codes straddle words), int2 with and without mins, int1, gcb2 / gcb3 with their superblocks
_LOWBIT_CASES = [("int3_g64", 320), ("int2_sym_g32", 320), ("int2_g128", 384), ("int1_g32", 320),
                 ("gcb2_sb64", 320), ("gcb3", 512)]


@pytest.mark.parametrize("fmt,k", _LOWBIT_CASES)
@pytest.mark.parametrize("m,config", [(1, GEMV_CONFIGS[0]), (4, GEMV_CONFIGS[1]), (5, DOT_CONFIGS[0]),
                                      (33, DOT_CONFIGS[1])])
def test_lowbit_forced_configs_match_reference(fmt, k, m, config):
    """Every kernel kind with split-K (empty slices included); int*: affine values (fp16) and table
    gathers (fp32 activations)."""
    gen = _gen()
    q = _lowbit_module(fmt, k, 45, gen)
    kind, args = _lowbit_args(q)
    fn = getattr(_lowbit(), f"{kind}_linear")
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, m, k, generator=gen).to(dtype)  # 3-D input: leading dims flatten
        _check_palette(x, q.dequantize(), q.bias, fn(x, *args, q.bias, config=config))


@pytest.mark.parametrize("fmt,k", _LOWBIT_CASES)
def test_lowbit_dequantize_kernels_are_exact(fmt, k):
    q = _lowbit_module(fmt, k, 37, _gen())
    kind, args = _lowbit_args(q)
    got = getattr(_lowbit(), f"{kind}_dequantize")(*args)
    assert torch.equal(got, q.dequantize())
    assert torch.equal(getattr(torch.ops.torch_lowbit, f"{kind}_dequantize")(*args), got)  # CPU impl


def test_lowbit_layouts_are_the_cuda_defaults_and_ops_run_on_cpu():
    from torch_lowbit.layouts import default_layout
    for fmt in ("int1_g64", "int2_g64", "int2_sym_g32", "int3_g128"):
        assert default_layout(tl.get_format(fmt), "cuda").name == "stream_rowmajor"
        assert default_layout(tl.get_format(fmt), "cpu").name.endswith("_i8_n16")
    assert default_layout(tl.get_format("gcb3"), "cuda").name == "gcb_rowmajor"
    gen = _gen()
    for fmt in ("int3_g32", "gcb2_sb64"):  # the ops' CPU impls (reference decode + matmul)
        q = _lowbit_module(fmt, 128, 21, gen)
        kind, args = _lowbit_args(q)
        x = torch.randn(2, 128, generator=gen)
        _check_palette(x, q.dequantize(), q.bias, getattr(torch.ops.torch_lowbit, f"{kind}_linear")(x, *args, q.bias))


def test_lowbit_model_compiles_fullgraph_through_the_ops():
    for fmt, op in (("int2_g64", "lowbit_linear"), ("gcb2_sb64", "gcb_linear")):
        model = tiny_llama()
        layout = "gcb_rowmajor" if fmt.startswith("gcb") else "stream_rowmajor"
        tl.quantize_(model, fmt, layout=layout, progress=False)
        model.to("meta")
        out, code = _compiled_on_meta(model)
        assert out.shape == (2, 5, 256)
        assert code.count(f"torch_lowbit.{op}") == 2 * 4  # fused q/k/v, gate/up: one op per module


def test_lowbit_launchers_reject_bad_input(monkeypatch):
    lb = _lowbit()
    q = _lowbit_module("int3_g32", 64, 8, _gen())
    _, (codes, bits, scales, mins, lut, group) = _lowbit_args(q)
    x = torch.randn(1, 64)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got torch.float64"):
        lb.lowbit_linear(x.double(), codes, bits, scales, mins, lut, group)
    with pytest.raises(ValueError, match=r"codes must be int32 \[8, 6\]"):
        lb.lowbit_linear(x, codes[:, :5], bits, scales, mins, lut, group)
    with pytest.raises(ValueError, match="lut must be 8 fp32 values"):
        lb.lowbit_linear(x, codes, bits, scales, mins, lut[:4], group)
    with pytest.raises(ValueError, match="mins must be fp16"):
        lb.lowbit_linear(x, codes, bits, scales, mins.float(), lut, group)
    with pytest.raises(ValueError, match="group size 48 must be a positive multiple of 32"):
        lb.lowbit_linear(x, codes, bits, scales, mins, lut, 48)
    with pytest.raises(ValueError, match="x has 48 features, the weight has K=64"):
        lb.lowbit_linear(torch.randn(1, 48), codes, bits, scales, mins, lut, group)
    g = _lowbit_module("gcb3_sb64", 128, 8, _gen())
    _, (gcodes, gbits, sub, sup, cbs) = _lowbit_args(g)
    with pytest.raises(ValueError, match=r"codebooks must be int8 \[1..16, 2\^code_bits\]"):
        lb.gcb_linear(torch.randn(1, 128), gcodes, 2, sub, sup, cbs)
    with pytest.raises(ValueError, match="superblock a multiple of 32 dividing K=128"):
        lb.gcb_linear(torch.randn(1, 128), gcodes, gbits, sub, sup[:, :1].repeat(1, 3), cbs)
    with pytest.raises(ValueError, match="codes is on cpu but x is on meta"):
        lb.gcb_linear(torch.randn(1, 128, device="meta"), gcodes, gbits, sub, sup, cbs)
    with pytest.raises(RuntimeError, match="lowbit: lut must be 8 fp32 values"):  # the op's own check
        torch.ops.torch_lowbit.lowbit_linear(x, codes, bits, scales, mins, lut[:4], group, None)
    _needs_interpreter_on_cpu(monkeypatch, lambda: lb.gcb_linear(torch.randn(1, 128), gcodes, gbits, sub, sup, cbs))


@on_cuda
@pytest.mark.parametrize("fmt", ["int1_g64", "int2_g64", "int2_sym_g64", "int3_g128", "gcb2", "gcb3"])
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_cuda_lowbit_kernels_match_reference_at_real_sizes(fmt, m):
    """The CUDA default layouts of int1/2/3 and gcb through the ops (autotuned) and every config kind."""
    gen = torch.Generator().manual_seed(m)
    q = _lowbit_module(fmt, 4096, 4096, gen)
    w = q.dequantize().double().cuda()
    q = q.cuda()
    kind, args = _lowbit_args(q)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
    for dtype in DTYPES:
        x = torch.randn(m, 4096, device="cuda").to(dtype)
        ref = x.double() @ w.T + q.bias.double()
        y = q(x)
        assert y.dtype == dtype and ((y.double() - ref).norm() / ref.norm()).item() < tol[dtype]
        for cfg in (GEMV_CONFIGS if m <= 4 else DOT_CONFIGS):
            y = getattr(_lowbit(), f"{kind}_linear")(x, *args, q.bias, config=cfg)
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol[dtype]
    assert torch.equal(getattr(_lowbit(), f"{kind}_dequantize")(*args).double(), w)


# -- the dequantize + cuBLAS route (large M) -------------------------------------------------------
def test_config_space_offers_the_dequant_route_from_dequant_min_m():
    mm = _matmul()
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
    mm = _matmul()
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
    gen = _gen()
    route = _matmul().DEQUANT_ROUTE
    k, n, m = 320, 48, 6
    if fmt.startswith(("nuq", "tcq")):
        f, b, w = _palette_weights(fmt, n, k if fmt.startswith("nuq") else 288, gen)
        k = w.shape[1]

        def run(x, bias):
            return _palette_linear(f, b, x, bias, route)[0]
    elif fmt.startswith("int4"):
        q, _ = _quantized(fmt, k, n, False, gen)
        w = q.dequantize()

        def run(x, bias):
            return _run(q, x, route) if bias is None else _kernels().lut4_linear(
                x, q.qweight, q.scales, q.mins, q.lut, q.fmt.group_size, bias, config=route)
    else:
        q = _lowbit_module(fmt, k, n, gen)
        kind, args = _lowbit_args(q)
        w = q.dequantize()

        def run(x, bias):
            return getattr(_lowbit(), f"{kind}_linear")(x, *args, bias, config=route)
    for dtype in (torch.float32, torch.float16):
        for bias in (None, torch.randn(n, generator=gen)):
            x = torch.randn(2, m // 2, k, generator=gen).to(dtype)
            _check_palette(x, w, bias, run(x, bias))


# -- real GPU compile without a GPU -----------------------------------------------------------------
@pytest.mark.slow  # ~2 min: ptxas over every quick-set kernel
def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter accepts code the GPU compiler rejects (a non-constexpr global in a jit function, a
    reassigned constexpr in the Hadamard butterflies both passed it): tools/triton_compile_check runs the real
    launchers with the code generator and ptxas down to sm_90 cubins, outside the interpreter, and
    reads each cubin's registers, stack (spills) and K-loop length. The GEMV kernels (the batch-1
    decode path) must not spill, and the formats' own GEMV kernels must stay near the instruction
    budget of streaming their weights at HBM speed (~5 per weight; the generic decode-then-FMA kernel
    they replaced took 47 for q4_0, 23 for vq2, 43 for tcq2)."""
    import json
    import subprocess
    import sys
    code = ("import json\n"
            "from torch_lowbit.tools import triton_compile_check as c\n"
            "d = c.run(formats=c.QUICK)\n"
            "print(json.dumps({k: [r.shared, r.regs, r.stack, r.per_weight] for k, r in d.items()}))\n")
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("this triton build has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(done) >= 40 and max(v[0] for v in done.values()) <= 227 * 1024
    word_kernels = ("_lut4_linear_kernel ", "_lowbit_linear_kernel ", "_tcq_linear_kernel ", "_codebook_linear_kernel ")
    for kernel in ("_group_dequant_kernel", "_splitk_reduce_kernel", "_hadamard_kernel", "_kv_attention_kernel",
                   "_lut4_int_linear_kernel") \
            + tuple(w.strip() for w in word_kernels):
        assert any(key.startswith(kernel + " ") for key in done), kernel
    gemv = {key: v for key, v in done.items() if "('GEMV', True)" in key}
    assert len(gemv) >= 12
    assert all(v[2] == 0 for v in gemv.values()), {key: v for key, v in gemv.items() if v[2]}
    affine = [v[3] for key, v in gemv.items() if "('AFFINE', True)" in key]
    assert affine and max(affine) < 12, affine
    # the word-wise decoders, both kinds (fp16/bf16 activations); the per-element ones they replaced
    # took 47 / 40 (q4_0 GEMV / tl.dot at M = 16), 62 / 84 (int3), 23 / 15 (vq2), 43 / 19 (tcq2),
    # 34 / 54 (gcb3, whose per-code gathers from up to 16 codebooks now take ~10 / ~12)
    words = {key: v for key, v in done.items() if key.startswith(word_kernels)
             and ("('GEMV', True)" in key or "('BLOCK_M', 16)" in key) and "('DOT_FP32', False)" in key}
    assert len(words) >= 6 and all(v[2] == 0 for v in words.values()), words
    budget = {key: 16 if "('CODEBOOKS', True)" in key else 12 for key in words}
    assert any(b == 16 for b in budget.values()) and all(v[3] < budget[key] for key, v in words.items()), words


def _one_hot_rows(k):
    """nn.Linear whose row r picks feature r (the rest 0); int4_g64 stores it exactly (min 0, scale 1)."""
    lin = torch.nn.Linear(k, k, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(k))
    return lin


def test_integer_activation_kernel_splits_groups_to_fill_the_gpu():
    """split_groups: decode's 64 tiles at N = 4096 get K slices (2 x the SMs, at most 8), prefill's
    many tiles none, and no slice is ever empty (the tests above run 6 slices of one group at M = 1)."""
    from torch_lowbit.triton_kernels.int_act import split_groups
    from torch_lowbit.triton_kernels.matmul import sm_count
    assert sm_count(torch.device("cpu")) == 132 and sm_count(torch.device("meta")) == 132  # sized as an H100
    if torch.cuda.is_available():
        assert sm_count(torch.device("cuda")) == torch.cuda.get_device_properties(0).multi_processor_count
    assert split_groups(64, 448, 132) == (5, 90)  # q4_0 at 4096 x 14336, M = 1: 320 programs
    assert split_groups(8 * 64, 448, 132) == (1, 448)
    assert split_groups(1, 6, 132) == (6, 1) and split_groups(1, 1, 132) == (1, 1)
    for tiles in (1, 3, 64, 100, 263, 264, 265, 4000):
        for groups in (1, 2, 7, 32, 128, 449):
            split, per = split_groups(tiles, groups, 132)
            assert 1 <= split <= 8 and (split - 1) * per < groups <= split * per, (tiles, groups)


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64", "int4_pc", "iq4_nl"])
@pytest.mark.parametrize("bits", [8, 4])
def test_integer_activation_kernel_matches_the_rounded_product(fmt, bits, monkeypatch):
    """QuaRot's W4A8 / W4A4 on the triton backend: ActQuantLinear rounds x per token and the integer
    tl.dot kernel (triton_kernels/int_act.py) multiplies the codes; the result is x_rounded @ W.T within
    fp32 error (odd N, 1..33 tokens, bias, mins), and the op's CPU reference agrees."""
    from torch_lowbit.core.activations import quantize_per_token
    from torch_lowbit.core.activations import fake_quantize_per_token
    from torch_lowbit.triton_kernels import int_act
    lut4_int_linear, calls = int_act.lut4_int_linear, []
    monkeypatch.setattr(int_act, "lut4_int_linear", lambda *a: calls.append(1) or lut4_int_linear(*a))
    gen = _gen()
    q, _ = _quantized(fmt, 192, 37, True, gen)
    layer = tl.ActQuantLinear(q, bits, clip_ratio=0.9)
    w = q.dequantize()
    for m in (1, 5, 33):
        x = torch.randn(m, 192, generator=gen) * torch.rand(m, 1, generator=gen).add(0.1)
        x[:, 3] *= 15
        with tl.use_backend("triton"):
            y = layer(x)
        assert calls, "the layer did not reach the integer-activation kernel"
        calls.clear()
        assert_matches_product(y, fake_quantize_per_token(x, bits, clip_ratio=0.9), w, q.bias, roundings=8,
                               msg=f"{fmt} A{bits} M={m}")
        for dtype in (torch.float32, torch.float16):  # rounded in-kernel exactly as quantize_per_token
            args = (x.to(dtype), q.qweight, q.scales, getattr(q, "mins", None), q.lut_i8, q.fmt.group_size, q.bias,
                    bits, 0.9)
            torch.testing.assert_close(lut4_int_linear(*args), torch.ops.torch_lowbit.lut4_int_linear(*args),
                                       rtol=1e-5, atol=1e-5)
        # the codes themselves: a one-hot weight row k reads back x's code k times its scale
        xq, xd = quantize_per_token(x, bits, 0.9)
        eye = tl.QuantLinear.from_linear(_one_hot_rows(192), "int4_g64", layout="lut4_rowmajor")
        y_eye = lut4_int_linear(x, eye.qweight, eye.scales, eye.mins, eye.lut_i8, 64, None, bits, 0.9)
        # one flipped code would be off by ~1e-2
        torch.testing.assert_close(y_eye, (xq.float() * xd) @ eye.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt, bits, block", [("q4_0", 8, 0), ("int4_g64", 8, 32), ("iq4_nl", 4, 16)])
def test_integer_activation_kernel_every_tuned_config_matches(fmt, bits, block, monkeypatch):
    """Every launch config the autotuner may pick for lut4_int_linear (int_act_configs: M tiles of 16 to
    64, N tiles of 32 to 256, 2 / 3 stages; split K where the tiles are few) gives the op's CPU
    reference result (odd N, ragged M, K of 3-6 groups); and the launcher asks autotune.pick with that
    space and runs what it returns."""
    from torch_lowbit.triton_kernels import int_act
    gen = _gen()
    q, _ = _quantized(fmt, 192, 37, True, gen)
    mins = getattr(q, "mins", None)
    asked = []

    def pick(kernel, key, candidates, default, run, device):
        asked.append((kernel, key, candidates, default))
        return candidates[-1]

    for m in (1, 33):
        x = torch.randn(m, 192, generator=gen) * torch.rand(m, 1, generator=gen).add(0.1)
        args = (x, q.qweight, q.scales, mins, q.lut_i8, q.fmt.group_size, q.bias, bits, 0.9, block)
        want = torch.ops.torch_lowbit.lut4_int_linear(*args)
        cands, default = int_act.int_act_configs(m)
        assert default in cands and all(c["BLOCK_M"] <= max(16, m) * 2 for c in cands)
        for cfg in cands:
            torch.testing.assert_close(int_act.lut4_int_linear(*args, config=cfg), want, rtol=1e-5, atol=1e-5,
                                       msg=lambda e, cfg=cfg: f"{fmt} M={m} {cfg}: {e}")
        monkeypatch.setattr(int_act.autotune, "pick", pick)
        torch.testing.assert_close(int_act.lut4_int_linear(*args), want, rtol=1e-5, atol=1e-5)
        monkeypatch.undo()
        assert asked[-1][0] == "lut4_int_linear" and asked[-1][2] == cands and f"_b{block}" in asked[-1][1]


def _block_varied(m, k, gen):
    """Activations whose 8-feature pieces differ in scale by up to 1000x, a zero 32-block, a zero
    16-feature half and an outlier: every branch of the two-level scale search."""
    x = torch.randn(m, k, generator=gen) * torch.pow(10.0, torch.rand(m, k // 8, 1, generator=gen) * 3 - 2) \
        .expand(m, k // 8, 8).reshape(m, k)
    x[:, 32:64] = 0
    x[:, 64:80] = 0
    x[:, 5] *= 40
    return x


@pytest.mark.parametrize("bits,block", [(4, 16), (4, 8), (3, 16), (2, 8), (4, 32), (8, 32)])
def test_integer_activation_kernel_rounds_blocks_bit_for_bit(bits, block):
    """The Triton rounding of block-scaled activations (per 32 features; 16 / 8: two-level scales)
    gives quantize_act_codes' codes and scales exactly (K = 1088: two programs per token, ragged)."""
    from torch_lowbit.core.activations import quantize_act_codes
    from torch_lowbit.triton_kernels.int_act import round_activations
    gen = _gen()
    for m, k in ((1, 96), (5, 1088)):
        x = _block_varied(m, k, gen)
        for dtype in (torch.float32, torch.float16):
            xq, xd = round_activations(x.to(dtype), bits, 0.9, block)
            want_q, want_d = quantize_act_codes(x.to(dtype), bits, 0.9, block)
            assert torch.equal(xq, want_q) and torch.equal(xd, want_d), (m, k, dtype)


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64", "iq4_nl"])
@pytest.mark.parametrize("bits,block", [(4, 16), (2, 8), (8, 32)])
def test_integer_activation_kernel_takes_activation_blocks(fmt, bits, block, monkeypatch):
    """Block-scaled activations (QuaRot(act_block=...)) on the triton backend reach the integer tl.dot
    kernel, which scales each 32-feature run's int32 product by its block's scale: x_rounded @ W.T
    within fp32 error (ragged M, odd N, bias, mins), equal to the op's CPU reference."""
    from torch_lowbit.core.activations import fake_quantize_per_token
    from torch_lowbit.triton_kernels import int_act
    lut4_int_linear, calls = int_act.lut4_int_linear, []
    monkeypatch.setattr(int_act, "lut4_int_linear", lambda *a: calls.append(a[-1]) or lut4_int_linear(*a))
    gen = _gen()
    q, _ = _quantized(fmt, 192, 37, True, gen)
    layer = tl.ActQuantLinear(q, bits, clip_ratio=0.9, block=block)
    w = q.dequantize()
    for m in (1, 5, 33):
        x = _block_varied(m, 192, gen)
        with tl.use_backend("triton"):
            y = layer(x)
        assert calls == [block], "the layer did not reach the integer-activation kernel with its blocks"
        calls.clear()
        assert_matches_product(y, fake_quantize_per_token(x, bits, clip_ratio=0.9, block=block), w, q.bias,
                               roundings=8, msg=f"{fmt} A{bits} block {block} M={m}")
        args = (x, q.qweight, q.scales, getattr(q, "mins", None), q.lut_i8, q.fmt.group_size, q.bias, bits, 0.9, block)
        torch.testing.assert_close(lut4_int_linear(*args), torch.ops.torch_lowbit.lut4_int_linear(*args),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="act_block must be 0"):
        lut4_int_linear(x, q.qweight, q.scales, getattr(q, "mins", None), q.lut_i8, q.fmt.group_size, None, 8, 0.9, 16)
    with pytest.raises(RuntimeError, match="act_block"):
        torch.ops.torch_lowbit.lut4_int_linear(x, q.qweight, q.scales, getattr(q, "mins", None), q.lut_i8,
                                               q.fmt.group_size, None, 4, 0.9, 64)
