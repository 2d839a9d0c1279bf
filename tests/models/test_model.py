"""Model-level API on a small random Llama (real HF modules, no download): quantize_, fusion,
torch.compile, checkpoints."""
import json
import logging
import struct

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.nn import ProjectionSlot, QuantLinear

from conftest import tiny_llama


def _ids(n=2, t=13, vocab=256):
    return torch.randint(0, vocab, (n, t))


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64"])
def test_quantize_fused_equals_unfused(fmt):
    base = tiny_llama()
    fused, plain = tiny_llama(), tiny_llama()
    fused.load_state_dict(base.state_dict())
    plain.load_state_dict(base.state_dict())
    tl.quantize_(fused, fmt, progress=False)
    tl.quantize_(plain, fmt, fuse=False, progress=False)
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(attn.q_proj, ProjectionSlot)
    assert isinstance(fused.model.layers[1].mlp.gate_up_proj, QuantLinear)
    assert not isinstance(fused.lm_head, QuantLinear)  # the head stays float by default
    ids = _ids()
    with torch.no_grad():
        ref, a, b = base(ids).logits, fused(ids).logits, plain(ids).logits
        one = fused(ids[:, :1]).logits  # M = 2 tokens: the GEMV path
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (a - ref).abs().max() < 0.5 * ref.abs().max()
    assert torch.isfinite(one).all()
    n_fused = sum(isinstance(m, QuantLinear) for m in fused.modules())
    assert n_fused == 2 * 4  # per layer: qkv, o, gate_up, down


@pytest.mark.parametrize("fmt,layout", [("q4_0", "lut4_rowmajor"), ("q4_0", "lut4_i8_n16"), ("gcb2_sb64", "gcb_i8_n16")])
def test_compile_fullgraph_equals_eager(fmt, layout):
    model = tiny_llama()
    tl.quantize_(model, fmt, layout=layout, progress=False)
    ids = _ids()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: any graph break is an error
    with torch.no_grad():
        eager = model(ids).logits
        comp = compiled(ids).logits
        comp2 = compiled(ids).logits
    if layout == "lut4_rowmajor":  # fp32 activations: equal up to float reassociation
        torch.testing.assert_close(comp, eager, rtol=1e-4, atol=1e-4)
    else:
        # int8 activations: inductor's fused norms differ in the last bits, which can move an
        # activation across an int8 rounding boundary; stay within the int8 error itself
        assert ((comp - eager).norm() / eager.norm()).item() < 5e-3
    torch.testing.assert_close(comp2, comp, rtol=0, atol=0)


def test_backends_agree_on_model():
    model = tiny_llama()
    tl.quantize_(model, "int4_g32", layout="lut4_rowmajor", progress=False)  # float-activation kernels
    ids = _ids(1, 9)
    with torch.no_grad():
        cpu = model(ids).logits
        with tl.use_backend("reference"):
            ref = model(ids).logits
        with tl.use_backend("triton"):
            tri = model(ids).logits
    torch.testing.assert_close(cpu, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)
    # the default CPU layout (int8 activations) stays close to the float reference
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.repack("lut4_i8_n16")
    with torch.no_grad():
        i8 = model(ids).logits
    assert ((i8 - ref).norm() / ref.norm()).item() < 2e-2
    with pytest.raises(RuntimeError, match="CPU backend only"), tl.use_backend("triton"), torch.no_grad():
        model(ids)


def test_save_load_roundtrip_float_and_meta_skeletons(tmp_path):
    model = tiny_llama(tie_word_embeddings=True)
    tl.quantize_(model, "q4_0", progress=False)
    path = tmp_path / "m.safetensors"
    tl.save_quantized(model, path)
    ids = _ids()
    with torch.no_grad():
        expect = model(ids).logits

    fresh = tiny_llama(tie_word_embeddings=True)  # different random weights
    tl.load_quantized(fresh, path)
    with torch.device("meta"):
        meta = tiny_llama(tie_word_embeddings=True)
    tl.load_quantized(meta, path)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, expect)
        assert torch.equal(meta(ids).logits, expect)
    assert isinstance(fresh.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_checkpoint_errors(tmp_path):
    model = tiny_llama()
    tl.quantize_(model, "int4_g64", progress=False)
    path = tmp_path / "m.safetensors"
    tl.save_quantized(model, path)
    data = path.read_bytes()

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(tl.CheckpointError, match="corrupt or truncated"):
        tl.load_quantized(tiny_llama(), truncated)

    flipped = tmp_path / "flipped.safetensors"
    b = bytearray(data)
    b[-100] ^= 0x5A
    flipped.write_bytes(bytes(b))
    with pytest.raises(tl.CheckpointError, match="checksum"):
        tl.load_quantized(tiny_llama(), flipped)

    # another checkpoint version: rewrite the JSON header
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = json.loads(header["__metadata__"]["torch_lowbit"])
    meta["checkpoint_version"] = 99
    header["__metadata__"]["torch_lowbit"] = json.dumps(meta)
    hb = json.dumps(header).encode()
    other = tmp_path / "v99.safetensors"
    other.write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + n:])
    with pytest.raises(tl.CheckpointError, match="version 99.*reads version 1"):
        tl.load_quantized(tiny_llama(), other)

    with pytest.raises(tl.CheckpointError, match="does not exist"):
        tl.load_quantized(tiny_llama(), tmp_path / "nope.safetensors")
    with pytest.raises(tl.CheckpointError, match="wrong skeleton|does not match|no module"):
        tl.load_quantized(tiny_llama(hidden_size=64, intermediate_size=96), path)

    from safetensors.torch import save_file
    plain = tmp_path / "plain.safetensors"
    save_file({"a": torch.ones(2)}, str(plain))
    with pytest.raises(tl.CheckpointError, match="not a torch_lowbit checkpoint"):
        tl.load_quantized(tiny_llama(), plain)


def test_quantize_rejects_incompatible_layers_or_skips_them(caplog):
    model = tiny_llama(hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ValueError, match="not divisible by the group size.*skip_incompatible"):
        tl.quantize_(model, "int4_g64", progress=False)
    tl.quantize_(model, "int4_g32", progress=False)  # 96 and 160 are multiples of 32
    model2 = tiny_llama(hidden_size=96, intermediate_size=128, num_attention_heads=3, num_key_value_heads=1)
    with caplog.at_level(logging.INFO, logger="torch_lowbit"):
        tl.quantize_(model2, "int4_g64", skip_incompatible=True, progress=False)
    left = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # per layer q, k, v, o, gate, up read the 96-wide hidden state: 2 x 6 layers stay float, each named
    assert len(left) == 12 and all(m.startswith("left in float:") and "in_features=96" in m for m in left), left
    assert any(r.levelno == logging.INFO and "layout" in r.getMessage() for r in caplog.records)
    mlp = model2.model.layers[0].mlp
    assert isinstance(mlp.down_proj, QuantLinear)  # in=128
    assert isinstance(mlp.gate_proj, torch.nn.Linear)  # in=96 stays float
    with torch.no_grad():
        assert torch.isfinite(model2(_ids(1, 5)).logits).all()


@pytest.mark.parametrize("rounding", ["imatrix", "gptq", "mixed"])
def test_calibrated_quantize_runs_and_helps(rounding):
    model = tiny_llama()
    ids = [_ids(1, 64) for _ in range(4)]
    with torch.no_grad():
        ref = torch.cat([model(i).logits for i in ids])
    rtn, cal = tiny_llama(), tiny_llama()
    rtn.load_state_dict(model.state_dict())
    cal.load_state_dict(model.state_dict())
    tl.quantize_(rtn, "q4_0", progress=False)
    tl.quantize_(cal, "q4_0", calibration=ids, rounding=rounding, progress=False)
    with torch.no_grad():
        e_rtn = (torch.cat([rtn(i).logits for i in ids]) - ref).pow(2).mean()
        e_cal = (torch.cat([cal(i).logits for i in ids]) - ref).pow(2).mean()
    assert e_cal < e_rtn * 1.05  # calibrated rounding is at least as good on its own data
    with pytest.raises(ValueError, match="needs calibration"):
        tl.quantize_(tiny_llama(), "q4_0", rounding=rounding, progress=False)


def test_include_lm_head_unties_and_quantizes_the_head(tmp_path):
    model = tiny_llama(tie_word_embeddings=True)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    tl.quantize_(model, "q4_0", include_lm_head=True, progress=False)
    assert isinstance(model.lm_head, QuantLinear)
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)  # the embedding stays float
    with torch.no_grad():
        out = model(ids).logits
    assert ((out - ref).norm() / ref.norm()).item() < 0.2
    path = tmp_path / "head.safetensors"
    tl.save_quantized(model, path)
    fresh = tl.load_quantized(tiny_llama(tie_word_embeddings=True), path)
    assert isinstance(fresh.lm_head, QuantLinear)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, out)
