import os

# The Triton kernels run on CPU only through the interpreter, which must be chosen before any
# kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def stable_seed(nodeid: str, seed_file: str | None = None) -> int:
    # crc32 of the test id: the same in every process and on every machine (Python's hash() of a
    # str changes with PYTHONHASHSEED), so a failure reproduces with the same data. The id is taken
    # as "tests/<file name>::<test>" whatever folder the file is in, so moving a file between
    # tests/<area>/ folders keeps its tests' data; a module split out of another file names the file
    # its tests came from in SEED_FILE (their seeds, and so their data, stay those of that file).
    path, _, test = nodeid.partition("::")
    return zlib.crc32(f"tests/{seed_file or path.rsplit('/', 1)[-1]}::{test}".encode())


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible seed per test: random data, never zeros, never the same for all.
    torch.manual_seed(stable_seed(request.node.nodeid, getattr(request.module, "SEED_FILE", None)))
    threads = torch.get_num_threads()
    yield
    # a test (or a benchmark it runs in-process) that changes torch's thread count must not slow the
    # tests after it, whichever order they run in
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, fp32, loaded once per test run: read-only
    (a test that changes the model quantizes or rotates a copy.deepcopy of it)."""
    from torch_lowbit.eval import load_smollm2
    return load_smollm2()


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


def tiny_llama(**overrides):
    """A small random Llama (no download) with the real HF module structure."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def quantized_tiny_llama(fmt: str = "q4_0", seed: int = 0):
    """tiny_llama() with torch's global seed set first (its random weights), its linears in `fmt`."""
    import torch_lowbit as tl
    torch.manual_seed(seed)
    model = tiny_llama()
    tl.quantize_(model, fmt, progress=False)
    return model


def random_linear(k, n, bias, gen):
    """An nn.Linear with heavy-ish tails and a per-row scale spread, like real weights."""
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1) * 0.05)
        lin.weight[:, ::7] *= 4
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return lin


# What each CPU path needs, and what its absence leaves untested on this machine.
_PATH_NEEDS = {
    "avx512": "AVX-512 F/BW/VL (VNNI for the int8 kernels, VBMI for the palette kernels)",
    "avxvnni": "vpdpbusd on ymm (AVX-VNNI: Intel Alder Lake+, Sapphire Rapids+, AMD Zen 5; or AVX512-VNNI + VL)",
    "avx2": "AVX2 + FMA",
}


def cpu_paths_report():
    """Which CPU kernel paths this machine tests and which it skips, and why (printed once per run)."""
    from torch_lowbit.ops import cpu_extension, cpu_model, has_cpu_extension
    if not has_cpu_extension():
        return [f"torch_lowbit: CPU {cpu_model()}; the C++ extension is not loaded (TORCH_LOWBIT_NO_EXTENSION or not "
                "built): CPU ops run the pure-torch references, tests of the CPU kernels skip or fail"]
    ext = cpu_extension()
    paths = ext.available_cpu_paths()
    lines = [f"torch_lowbit: CPU {cpu_model()}; kernel paths tested here: {', '.join(paths)} "
             f"(each against the scalar reference path)"]
    cap = os.environ.get("TORCH_LOWBIT_CPU_MAX_PATH")
    for path, needs in _PATH_NEEDS.items():
        if path not in paths:
            why = f"capped by TORCH_LOWBIT_CPU_MAX_PATH={cap}" if cap else f"this CPU lacks {needs}"
            lines.append(f"torch_lowbit: SKIPPED CPU path {path}: {why}; its tests skip")
    if "avxvnni" in paths and not ext.cpu_has_avx_vnni():
        lines.append("torch_lowbit: CPU has AVX512-VNNI but no AVX-VNNI: the avxvnni path runs its EVEX-encoded "
                     "twin (the same kernel code; the VEX encoding itself is untested here)")
    if "avx512" in paths:
        for feature, has, what in (("VNNI", ext.cpu_has_avx512_vnni(), "int8-activation kernels use AVX2"),
                                   ("VBMI", ext.cpu_has_avx512_vbmi(), "palette kernels use AVX2")):
            if not has:
                lines.append(f"torch_lowbit: CPU has AVX-512 without {feature}: the avx512 path's {what}")
    return lines


# ---- tolerances that follow from the arithmetic, not from one machine's rounding ----

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def assert_matches_product(y, x, w, bias=None, *, weights_in=None, roundings=4, msg=""):
    """Checks a kernel's output y against the exact x @ w.T + bias, element by element, within what
    fp32 arithmetic allows on any CPU, BLAS or summation order.

    A K-term dot product evaluated in fp32 in any order is off by at most (K - 1) u sum_j |x_j w_j|
    (Higham, Accuracy and Stability of Numerical Algorithms, sec. 3.1); the products, the group
    scales and the bias add `roundings` more. A bf16/fp16 output adds one rounding of the result;
    `weights_in=dtype` says the kernel rounds its dequantized weights to that dtype first (tensor-core
    tiles), which adds that dtype's u sum_j |x_j w_j|.
    """
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    exact = x64 @ w64.T
    magnitude = x64.abs() @ w64.abs().T
    if bias is not None:
        exact = exact + bias.double()
        magnitude = magnitude + bias.double().abs()
    k = x.shape[-1]
    bound = (k - 1 + roundings) * UNIT_ROUNDOFF[torch.float32] * magnitude
    if weights_in is not None and weights_in != torch.float32:
        bound = bound + UNIT_ROUNDOFF[weights_in] * magnitude
    if y.dtype != torch.float32:
        bound = bound + UNIT_ROUNDOFF[y.dtype] * (exact.abs() + bound)
    err = (y.double().reshape(exact.shape) - exact).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert bool((err <= bound).all()), f"{msg} error up to {worst:.3g}x the fp32 bound (K = {k}, {y.dtype})"


def pytest_sessionstart(session):
    # written directly (not as a report header, which `pytest -q` hides) so CI logs always show it
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in cpu_paths_report():
            reporter.write_line(line)
