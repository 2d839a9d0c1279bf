import os

# The Triton kernels run on CPU only through the interpreter, which must be chosen before any
# kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def stable_seed(nodeid: str) -> int:
    # crc32 of the test id: the same in every process and on every machine (Python's hash() of a
    # str changes with PYTHONHASHSEED), so a failure reproduces with the same data.
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible seed per test: random data, never zeros, never the same for all.
    torch.manual_seed(stable_seed(request.node.nodeid))
    yield


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


def random_linear(k, n, bias, gen):
    """An nn.Linear with heavy-ish tails and a per-row scale spread, like real weights."""
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1) * 0.05)
        lin.weight[:, ::7] *= 4
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return lin
