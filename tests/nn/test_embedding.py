"""QuantEmbedding and quantize_embeddings_: row gathers against the reference dequantizer, the tied
head sharing the embedding's packed tensors, checkpoints and torch.compile, on a tiny random Llama."""
import copy
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

import torch_lowbit as tl
from torch_lowbit.layouts import get_layout, layouts
from torch_lowbit.nn import QuantEmbedding, QuantLinear

from conftest import tiny_llama

SCALAR_LAYOUTS = {f: [n for n in layouts() if get_layout(n).supports(tl.get_format(f))]
                  for f in ("q8_0", "q4_0", "int4_g32", "int2_g32")}


def _ids(n=2, t=11, vocab=256):
    return torch.randint(0, vocab, (n, t))


@pytest.mark.parametrize("fmt,layout", [(f, lay) for f, lays in SCALAR_LAYOUTS.items() for lay in lays])
def test_lookup_gathers_the_reference_rows(fmt, layout):
    emb = nn.Embedding(83, 96)  # 83 rows: a ragged last 16-row tile
    q = QuantEmbedding.from_embedding(emb, fmt, layout=layout)
    assert q.layout.name == layout
    table = tl.get_format(fmt).dequantize(tl.get_format(fmt).quantize(emb.weight.detach()))
    assert torch.equal(q.dequantize(), table)
    ids = torch.randint(0, 83, (3, 7))
    ids[0, :3] = torch.tensor([0, 82, 82])  # first and last rows, repeats
    out = q(ids)
    assert out.shape == (3, 7, 96) and out.dtype == torch.float32
    assert torch.equal(out, table[ids])
    assert torch.equal(q(ids.to(torch.int32)), table[ids])


def test_lookup_rejects_bad_ids_and_formats():
    q = QuantEmbedding.from_embedding(nn.Embedding(20, 64), "q8_0")
    with pytest.raises(IndexError, match=r"token ids must be in \[0, 20\)"):
        q(torch.tensor([3, 20]))
    with pytest.raises(TypeError, match="integer tensor"):
        q(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="scalar-codebook group formats"):
        QuantEmbedding.from_embedding(nn.Embedding(20, 64), "nuq4")
    with pytest.raises(ValueError, match="not divisible by the group size"):
        QuantEmbedding.from_embedding(nn.Embedding(20, 40), "q8_0")


def _dequantized_float_model(quantized, tied):
    """The fp32 model with the embedding (and head) replaced by the quantized module's dequantized weights."""
    ref = tiny_llama(tie_word_embeddings=tied)
    ref.load_state_dict(quantized["state"])
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(quantized["emb"])
        if not tied:
            ref.lm_head.weight.copy_(quantized["head"])
    return ref


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_model_embeddings_and_head(tied, fmt):
    model = tiny_llama(tie_word_embeddings=tied)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    tl.quantize_embeddings_(model, fmt)
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(emb, QuantEmbedding) and isinstance(head, QuantLinear)
    assert model.get_input_embeddings() is emb and model.get_output_embeddings() is head
    shared = [getattr(emb, n).data_ptr() == getattr(head, n).data_ptr() for n in emb._buffer_names]
    assert all(shared) if tied else not any(shared)
    ref = _dequantized_float_model({"state": state, "emb": emb.dequantize(), "head": head.dequantize()}, tied)
    ids = _ids()
    with torch.no_grad():
        with tl.use_backend("reference"):  # the head as dequantized weight x fp32 activations
            logits = model(ids).logits
        cpu = model(ids).logits  # the CPU kernel: int8 activations
        expected = ref(ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert ((cpu - expected).norm() / expected.norm()).item() < 2e-2


@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_round_trip_keeps_one_shared_copy(tmp_path, tied):
    model = tiny_llama(tie_word_embeddings=tied)
    tl.quantize_(model, "q4_0", progress=False)
    tl.quantize_embeddings_(model, "q8_0")
    path = tmp_path / "m.safetensors"
    tl.save_quantized(model, path)
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["torch_lowbit"])
        keys = set(f.keys())
    assert meta["modules"]["model.embed_tokens"]["module"] == "embedding"
    assert ("lm_head.qweight" in meta["aliases"]) == tied and ("lm_head.qweight" in keys) != tied
    with torch.device("meta"):
        skeleton = tiny_llama(tie_word_embeddings=tied)
    loaded = tl.load_quantized(skeleton, path)
    emb, head = loaded.model.embed_tokens, loaded.lm_head
    assert isinstance(emb, QuantEmbedding) and isinstance(head, QuantLinear) and head.layout.name == "lut8_i8_n16"
    assert (emb.qweight.data_ptr() == head.qweight.data_ptr()) == tied
    assert (emb.scales.data_ptr() == head.scales.data_ptr()) == tied
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_checkpoint_rejects_wrong_skeleton(tmp_path):
    model = tiny_llama()
    tl.quantize_embeddings_(model, "q8_0")
    path = tmp_path / "m.safetensors"
    tl.save_quantized(model, path)
    with pytest.raises(tl.CheckpointError, match="not an Embedding of 256x128"):
        tl.load_quantized(tiny_llama(vocab_size=320), path)


def test_from_quantized_and_tied_head_share_tensors():
    f = tl.get_format("q8_0")
    w = torch.randn(50, 64)
    q = f.quantize(w)
    emb = QuantEmbedding.from_quantized("q8_0", q, 50, 64)
    head = emb.tied_head()
    assert torch.equal(emb.dequantize(), f.dequantize(q)) and torch.equal(head.dequantize(), f.dequantize(q))
    assert head.qweight.data_ptr() == emb.qweight.data_ptr()
    x = torch.randn(3, 64)
    with tl.use_backend("reference"):
        torch.testing.assert_close(head(x), x @ f.dequantize(q).T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="codes must be torch.uint8 \\[50, 96\\], got torch.uint8 \\[50, 64\\]"):
        QuantEmbedding.from_quantized("q8_0", q, 50, 96)


def test_quantize_embeddings_rejects_twice_and_non_models():
    model = tiny_llama()
    tl.quantize_embeddings_(model, "q8_0")
    with pytest.raises(ValueError, match="already quantized"):
        tl.quantize_embeddings_(model, "q8_0")
    with pytest.raises(TypeError, match="get_input_embeddings"):
        tl.quantize_embeddings_(nn.Sequential(nn.Embedding(4, 32)), "q8_0")


class _TinyLM(nn.Module):
    """Embedding -> norm -> tied head: the embedding/head part of an LM, small enough to compile fast."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 100, bias=False)
        self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def test_plain_module_with_embedding_accessors():
    """Any module with get_input_embeddings / get_output_embeddings, not only transformers models."""
    model = _TinyLM().eval()
    weight = model.embed.weight.detach().clone()
    tl.quantize_embeddings_(model, "q8_0")
    assert model.head.qweight.data_ptr() == model.embed.qweight.data_ptr()
    ids = torch.randint(0, 100, (2, 5))
    table = tl.get_format("q8_0").dequantize(tl.get_format("q8_0").quantize(weight))
    with torch.no_grad(), tl.use_backend("reference"):
        expected = torch.nn.functional.layer_norm(table[ids], (64,), model.norm.weight, model.norm.bias) @ table.T
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_equals_eager():
    model = tiny_llama(num_hidden_layers=1)  # one layer: the compile time is per layer
    tl.quantize_(model, "q4_0", progress=False)
    tl.quantize_embeddings_(model, "q8_0")
    ids = _ids()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # a graph break would raise
    with torch.no_grad():
        eager, comp = model(ids).logits, compiled(ids).logits
    # int8 activations: inductor's fused norms can move an activation across an int8 rounding boundary
    assert ((comp - eager).norm() / eager.norm()).item() < 5e-3
    assert model.generate(ids[:1, :5], max_new_tokens=3, do_sample=False).shape == (1, 8)


@pytest.mark.slow
def test_smollm2_tied_embedding_in_q8_0_is_the_gguf_token_embd(smollm2):
    """SmolLM2's GGUF stores token_embd in Q8_0; its dequantized values (the cached fp32 model) quantize
    back to exactly those blocks, the GGUF tensors build the same module without re-quantizing, and
    the model with the shared q8_0 embedding/head stays close to fp32."""
    import numpy as np
    from gguf import GGUFReader

    from torch_lowbit.eval.assets import smollm2_gguf, wiki_text

    model, tok = copy.deepcopy(smollm2[0]), smollm2[1]  # the session's model, unchanged
    emb_weight = model.model.embed_tokens.weight
    assert model.lm_head.weight is emb_weight
    raw = next(t for t in GGUFReader(str(smollm2_gguf())).tensors if t.name == "token_embd.weight")
    assert raw.tensor_type.name == "Q8_0"
    blocks = np.asarray(raw.data).reshape(49152, 18, 34)
    gguf_q = {"codes": torch.from_numpy((blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
                                        .reshape(49152, 576)),
              "scales": torch.from_numpy(blocks[..., :2].copy().view(np.float16).reshape(49152, 18))}
    q = tl.get_format("q8_0").quantize(emb_weight.detach())
    assert torch.equal(q["codes"], gguf_q["codes"]) and torch.equal(q["scales"], gguf_q["scales"])

    ids = tok(wiki_text(1)[:2000], return_tensors="pt").input_ids[:, :128]
    with torch.no_grad():
        ref = model(ids).logits
    tl.quantize_embeddings_(model, "q8_0")
    emb, head = model.model.embed_tokens, model.lm_head
    assert head.qweight.data_ptr() == emb.qweight.data_ptr()
    assert emb.weight_nbytes() == 49152 * 576 + 49152 * 18 * 2  # 30.1 MB instead of 113 MB
    from_gguf = QuantEmbedding.from_quantized("q8_0", gguf_q, 49152, 576)
    assert all(torch.equal(getattr(from_gguf, n), getattr(emb, n)) for n in emb._buffer_names)
    with torch.no_grad():
        out = model(ids).logits
        with tl.use_backend("reference"):
            exact = model(ids).logits
    # the embedding/head values are the fp32 model's own: only the head's int8 activations differ
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-4)
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2


def _tiny_gemma3(**kw):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = dict(vocab_size=256, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, max_position_embeddings=128, sliding_window=16)
    cfg.update(kw)
    return Gemma3ForCausalLM(Gemma3TextConfig(**cfg)).eval()


def test_scaled_embedding_keeps_its_scale_through_quantization_and_checkpoints(tmp_path):
    model = _tiny_gemma3()
    emb = model.get_input_embeddings()
    assert emb.scalar_embed_scale == pytest.approx(96 ** 0.5)  # Gemma scales rows by sqrt(hidden)
    qemb = QuantEmbedding.from_embedding(emb, "q8_0")
    assert qemb.scale == emb.scalar_embed_scale and "scale=9.79796" in repr(qemb)
    ids = _ids(2, 9)
    with torch.no_grad():
        emb.weight.copy_(qemb.dequantize())  # the float module on the same table: the same rows, same scale
        assert torch.equal(qemb(ids), emb(ids))
        reference = model(ids).logits
    tl.quantize_embeddings_(model, "q8_0")
    assert model.get_input_embeddings().scale == qemb.scale
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=2e-2)  # the int8-activation head
    path = tmp_path / "g.safetensors"
    tl.save_quantized(model, path)
    with torch.device("meta"):
        skeleton = _tiny_gemma3()
    loaded = tl.load_quantized(skeleton, path)
    assert loaded.get_input_embeddings().scale == qemb.scale
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        QuantEmbedding.from_quantized("q8_0", tl.get_format("q8_0").quantize(torch.randn(8, 32)), 8, 32,
                                      scale=float("nan"))
