"""GGUF import / export: files are written here with gguf's own GGUFWriter and quantizers (and read back
with its GGUFReader and dequantizer), so every check compares against an independent implementation."""
import logging
import os
import time

import numpy as np
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.io.gguf_blocks import rope_rows

gguf = pytest.importorskip("gguf")
from conftest import tiny_llama  # noqa: E402

Q = gguf.GGMLQuantizationType
EPS = 2.0 ** -20  # an rms_norm_eps that fp32 GGUF metadata holds exactly


def llama(**kw):
    return tiny_llama(rms_norm_eps=EPS, **kw)


def tiny_qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = dict(vocab_size=256, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=EPS, tie_word_embeddings=False)
    cfg.update(kw)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)  # HF initializes biases to zero: make them count
    return model


# ---- an independent GGUF writer (llama.cpp's convert step, in numpy) ------------------------------

def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iq4_nl_blocks(w: np.ndarray) -> np.ndarray:
    """IQ4_NL block bytes (gguf has no IQ4_NL quantizer): torch_lowbit's codes and scales, laid out here
    as ggml's block_iq4_nl (fp16 d, then 16 bytes: low nibbles = codes 0..15, high = 16..31)."""
    q = tl.get_format("iq4_nl").quantize(torch.from_numpy(w))
    n, k = w.shape
    codes = q["codes"].numpy().reshape(n, k // 32, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    d = q["scales"].numpy().reshape(n, k // 32, 1).view(np.uint8)
    return np.concatenate([d, qs.astype(np.uint8)], axis=-1).reshape(n, -1)


def write_gguf(model, path, qtype_of, arch="llama", metadata=None):
    """model's tensors as a GGUF file; qtype_of(gguf_name, ndim) -> GGMLQuantizationType; metadata(writer)
    adds more keys (a tokenizer)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    if metadata is not None:
        metadata(w)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    for hf_name, p in model.named_parameters():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = p.detach().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            data = llamacpp_permute(data, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        qtype = qtype_of(name, data.ndim) if data.ndim == 2 else Q.F32
        if qtype == Q.IQ4_NL:
            w.add_tensor(name, iq4_nl_blocks(data), raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            w.add_tensor(name, gguf.quants.quantize(data, qtype))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def expected_weights(path, config, permuted=True):
    """{gguf name: fp32 HF-ordered weight}: gguf's dequantizer, q/k rows un-permuted by transformers."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    proc = LlamaTensorProcessor({"num_attention_heads": config.num_attention_heads,
                                 "num_key_value_heads": config.num_key_value_heads})
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if permuted:
            w = proc.process(w, t.name).weights
        out[t.name] = torch.from_numpy(np.array(w, dtype=np.float32))
    return out


def module_weights(model):
    """{HF Linear fqn: fp32 weight} of an imported model (QuantLinear dequantized, fused ones split)."""
    fused = {}
    for pfqn, parent in model.named_modules():
        for names, fused_name in getattr(parent, "_lowbit_fusions", []):
            fused[f"{pfqn}.{fused_name}"] = [f"{pfqn}.{n}" for n in names]
    out = {}
    for fqn, m in model.named_modules():
        if isinstance(m, tl.QuantLinear):
            parts = m.dequantize().split(m.split_sizes or [m.out_features])
            out.update(zip(fused.get(fqn, [fqn]), parts))
        elif isinstance(m, torch.nn.Linear):
            out[fqn] = m.weight.detach()
    return out


def hf_reference(model_fn, path, permuted=True):
    """The HF model with exactly the GGUF's dequantized weights (what transformers' loader builds)."""
    ref = model_fn()
    exp = expected_weights(path, ref.config, permuted)
    arch = "llama" if permuted else ref.config.model_type
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     ref.config.num_hidden_layers)
    with torch.no_grad():
        for hf_name, p in ref.named_parameters():
            p.copy_(exp[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))].reshape(p.shape))
    return ref, exp, names


# ---- the q/k row permutation ----------------------------------------------------------------------

@pytest.mark.parametrize("rows,heads", [(128, 4), (64, 2), (96, 3), (40, 5)])
def test_rope_rows_are_llamacpps_permutation_and_transformers_inverse(rows, heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    w = torch.randn(rows, 7)
    to = w[rope_rows(rows, heads, to_gguf=True)]
    assert torch.equal(to, torch.from_numpy(llamacpp_permute(w.numpy(), heads)))
    back = LlamaTensorProcessor()._reverse_permute_weights(to.numpy(), heads, heads)
    assert torch.equal(to[rope_rows(rows, heads, to_gguf=False)], torch.from_numpy(back))
    assert torch.equal(to[rope_rows(rows, heads, to_gguf=False)], w)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_block_codec_round_trips_gguf_bytes(qtype):
    """decode_blocks / encode_blocks against gguf's quantizer and dequantizer, on odd shapes (q8_0
    through a stand-in config: the codec must be right before that format lands)."""
    from types import SimpleNamespace
    from torch_lowbit.formats.scalar import dequantize_groups
    from torch_lowbit.io.gguf_blocks import decode_blocks, encode_blocks
    w = (torch.randn(13, 96) * torch.rand(13, 1)).numpy()
    raw = gguf.quants.quantize(w, qtype)
    q = decode_blocks(raw, qtype.name)
    table = {Q.Q4_0: torch.arange(16.) - 8, Q.Q4_1: torch.arange(16.), Q.Q8_0: torch.arange(256.) - 128}[qtype]
    values = dequantize_groups(table, q["codes"], q["scales"], q.get("mins"), 32)
    assert torch.equal(values, torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    fmt = tl.get_format({Q.Q4_0: "q4_0", Q.Q4_1: "int4_g32"}[qtype]) if qtype != Q.Q8_0 else \
        SimpleNamespace(name="q8_0", kind="q8_0", group_size=32)
    type_name, back = encode_blocks(fmt, q)
    assert type_name == qtype.name and np.array_equal(back, raw)


# ---- from_gguf ---------------------------------------------------------------------------------

IMPORTS = {Q.Q4_0: "q4_0", Q.Q4_1: "int4_g32", Q.IQ4_NL: "iq4_nl", Q.Q8_0: "q8_0"}


@pytest.mark.parametrize("qtype", list(IMPORTS), ids=lambda q: q.name)
def test_from_gguf_keeps_the_blocks_bit_for_bit_and_the_logits(tmp_path, qtype):
    path = write_gguf(llama(), tmp_path / "m.gguf", lambda name, nd: qtype)
    model, tok = tl.from_gguf(path)
    assert tok is None  # no tokenizer metadata in this file
    ref, exp, names = hf_reference(llama, path)
    native = IMPORTS[qtype] in tl.formats()  # q8_0: only once that format is registered
    got = module_weights(model)
    for fqn, w in got.items():
        assert torch.equal(w, exp[names.get_name(fqn + ".weight", try_suffixes=(".weight",))]), fqn
    quant = [m for m in model.modules() if isinstance(m, tl.QuantLinear)]
    assert (len(quant) == 2 * 4 + 1) == native  # qkv, o, gate_up, down per block + the head
    assert all(m.fmt.name == IMPORTS[qtype] for m in quant)
    ids = torch.randint(0, 256, (2, 19))
    with torch.no_grad(), tl.use_backend("reference"):
        got_logits, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got_logits, want, rtol=1e-5, atol=1e-5)


def test_from_gguf_default_cpu_backend_runs_the_kernels_close_to_float(tmp_path):
    path = write_gguf(llama(), tmp_path / "m.gguf", lambda name, nd: Q.Q4_1)
    model, _ = tl.from_gguf(path)
    ref, _, _ = hf_reference(llama, path)
    ids = torch.randint(0, 256, (1, 23))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.02, rel  # the int8-activation kernels: close, not equal


def test_from_gguf_mixed_types_dequantizes_or_requantizes_the_others(tmp_path, caplog):
    types = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.F16, "ffn_gate": Q.IQ4_NL,
             "ffn_up": Q.IQ4_NL, "ffn_down": Q.BF16, "output": Q.Q5_1, "token_embd": Q.Q4_0}
    path = write_gguf(llama(), tmp_path / "m.gguf", lambda name, nd: types[name.split(".")[-2]])
    with caplog.at_level(logging.INFO, logger="torch_lowbit.io.gguf"):
        model, _ = tl.from_gguf(path)
    _, exp, names = hf_reference(llama, path)
    for fqn, w in module_weights(model).items():
        assert torch.equal(w, exp[names.get_name(fqn + ".weight", try_suffixes=(".weight",))]), fqn
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, tl.QuantLinear) and attn.q_proj.fmt.name == "q4_0"  # not fused: formats differ
    assert attn.k_proj.fmt.name == "int4_g32" and attn.v_proj.fmt.name == "q5_0"  # Q5_0: the lut5_i8_n16 tiles
    assert type(attn.o_proj) is torch.nn.Linear and model.lm_head.fmt.name == "q5_1"  # F16 dequantized; Q5_1 kept
    assert model.model.layers[0].mlp.gate_up_proj.fmt.name == "iq4_nl"  # fused: both IQ4_NL
    emb = model.model.embed_tokens  # Q4_0 token_embd: its blocks, not their float values
    assert isinstance(emb, tl.QuantEmbedding) and torch.equal(emb.dequantize(), exp["token_embd.weight"])
    logged = caplog.text
    for name in ("blk.0.attn_output.weight: GGUF F16", "blk.1.ffn_down.weight: GGUF BF16", "token_embd.weight: GGUF Q4_0"):
        assert name in logged, name

    requant, _ = tl.from_gguf(path, requantize="int4_g64", fuse=False)
    o = requant.model.layers[1].self_attn.o_proj
    assert o.fmt.name == "int4_g64"
    float_o = exp["blk.1.attn_output.weight"]
    assert torch.equal(o.dequantize(), tl.get_format("int4_g64").dequantize(tl.get_format("int4_g64").quantize(float_o)))
    assert requant.lm_head.fmt.name == "q5_1"  # the head is never requantized (here its own blocks)
    assert requant.model.layers[0].self_attn.q_proj.fmt.name == "q4_0"  # native blocks stay as they are


def test_from_gguf_qwen2_biases_and_no_permutation(tmp_path):
    path = write_gguf(tiny_qwen2(), tmp_path / "q.gguf", lambda name, nd: Q.Q4_0, arch="qwen2")
    model, _ = tl.from_gguf(path, layout="lut4_rowmajor")
    ref, exp, _ = hf_reference(tiny_qwen2, path, permuted=False)
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.layout.name == "lut4_rowmajor" and qkv.bias is not None
    assert torch.equal(qkv.bias, torch.cat([exp[f"blk.1.attn_{x}.bias"] for x in "qkv"]))
    ids = torch.randint(0, 256, (1, 17))
    with torch.no_grad(), tl.use_backend("reference"):
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_from_gguf_tied_embedding(tmp_path):
    make = lambda: llama(tie_word_embeddings=True)  # noqa: E731
    path = write_gguf(make(), tmp_path / "t.gguf", lambda name, nd: Q.Q4_0)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    model, _ = tl.from_gguf(path)
    _, exp, _ = hf_reference(make, path)
    head, emb = model.lm_head, model.model.embed_tokens  # Q4_0 token_embd: one copy of its blocks, shared
    assert isinstance(head, tl.QuantLinear) and torch.equal(head.dequantize(), exp["token_embd.weight"])
    assert isinstance(emb, tl.QuantEmbedding) and torch.equal(emb.dequantize(), exp["token_embd.weight"])
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(head.packed.values(), emb.packed.values()))
    ids = torch.randint(0, 256, (1, 9))
    ref, _, _ = hf_reference(make, path)
    with torch.no_grad(), tl.use_backend("reference"):
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    out = tl.to_gguf(model, tmp_path / "again.gguf")  # the shared blocks are written once, as token_embd
    names = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert "output.weight" not in names and names["token_embd.weight"].tensor_type == Q.Q4_0
    again, _ = tl.from_gguf(out)
    assert torch.equal(again.model.embed_tokens.dequantize(), exp["token_embd.weight"])
    floats, _ = tl.from_gguf(path, quantized_embedding=False)
    assert type(floats.model.embed_tokens) is torch.nn.Embedding
    assert torch.equal(floats.model.embed_tokens.weight, exp["token_embd.weight"])
    path = write_gguf(make(), tmp_path / "f.gguf", lambda name, nd: Q.F32 if name == "token_embd.weight" else Q.Q4_0)
    model, _ = tl.from_gguf(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # a float head stays tied


def test_from_gguf_rejects_bad_input(tmp_path):
    good = write_gguf(llama(), tmp_path / "m.gguf", lambda name, nd: Q.Q4_0)
    with pytest.raises(ValueError, match="unknown format 'q9_9'"):
        tl.from_gguf(good, requantize="q9_9")
    with pytest.raises(FileNotFoundError):
        tl.from_gguf(tmp_path / "missing.gguf")
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    with pytest.raises(tl.GGUFError, match="not a readable GGUF"):
        tl.from_gguf(not_gguf)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(tl.GGUFError, match="not a readable GGUF"):
        tl.from_gguf(cut)
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(tl.GGUFError, match="'gpt2' model; from_gguf supports the architectures gemma2, gemma3, llama, phi3, qwen2, qwen3"):
        tl.from_gguf(tmp_path / "g.gguf")
    with pytest.raises(ValueError, match="cannot hold format q4_0"):
        tl.from_gguf(good, layout="palette_dense")
    with pytest.raises(TypeError, match="floating"):
        tl.from_gguf(good, dtype=torch.int8)


def test_from_gguf_says_up_front_what_it_keeps_dequantizes_and_the_memory(tmp_path, caplog):
    kept = write_gguf(llama(), tmp_path / "kept.gguf", lambda name, nd: Q.Q8_0 if "token_embd" in name else Q.Q4_0)
    with caplog.at_level(logging.INFO, logger="torch_lowbit.io.gguf"):
        tl.from_gguf(kept, tokenizer=False)
    line = next(r for r in caplog.records if r.getMessage().startswith("from_gguf kept.gguf: kept as blocks"))
    assert line.levelno == logging.INFO, line.getMessage()
    reader = gguf.GGUFReader(kept)
    n_q4 = sum(t.tensor_type == Q.Q4_0 for t in reader.tensors)
    assert f"Q4_0 x{n_q4} -> q4_0" in line.getMessage() and "Q8_0 x1 -> q8_0" in line.getMessage()
    expected_mb = sum(int(t.n_bytes) if t.tensor_type != Q.F32 else int(t.n_elements) * 4 for t in reader.tensors) / 1e6
    assert f"~{expected_mb:.1f} MB in memory" in line.getMessage()
    # weight matrices in a type without a format: said first, as a warning naming the fix
    caplog.clear()
    floated = write_gguf(llama(), tmp_path / "f.gguf", lambda name, nd: Q.MXFP4 if "ffn" in name else Q.Q4_0)
    with caplog.at_level(logging.INFO, logger="torch_lowbit.io.gguf"):
        tl.from_gguf(floated, tokenizer=False)
    first = next(r for r in caplog.records if r.getMessage().startswith("from_gguf f.gguf:"))
    assert first.levelno == logging.WARNING and "(MXFP4) become float" in first.getMessage()
    assert "requantize='q4_0'" in first.getMessage()
    per_tensor = [i for i, r in enumerate(caplog.records) if "MXFP4 dequantized to float" in r.getMessage()]
    assert per_tensor and caplog.records.index(first) < min(per_tensor)  # the summary comes first
    # a tensor type nothing here reads: refused before any weight is read
    odd = write_gguf(llama(), tmp_path / "odd.gguf", lambda name, nd: Q.Q4_0,
                     metadata=lambda w: w.add_tensor("blk.0.odd.weight", np.arange(12, dtype=np.int32).reshape(3, 4)))
    with pytest.raises(tl.GGUFError, match=r"blk.0.odd.weight \(I32\).*llama-quantize"):
        tl.from_gguf(odd, tokenizer=False)


def test_from_gguf_rejects_nan_block_scales(tmp_path):
    path = write_gguf(llama(), tmp_path / "m.gguf", lambda name, nd: Q.Q4_0)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    data = bytearray(path.read_bytes())
    data[t.data_offset + 18 * 5:t.data_offset + 18 * 5 + 2] = np.float16(np.nan).tobytes()  # block 5's d
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="q4_0: scales/mins hold NaN/Inf"):
        tl.from_gguf(path)


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g32", "iq4_nl", "q8_0"])
def test_row_bytes_pack_like_codes_in_every_layout(fmt):
    """QuantLinear.from_quantized of GGUF block bytes (codes_as_row_bytes) holds the same buffers as of
    the decoded codes, in every layout that holds the format (the CPU ones move the bytes)."""
    from torch_lowbit.io.gguf_blocks import block_tensors, decode_blocks
    from torch_lowbit.layouts import get_layout, layouts
    qtype = {v: k for k, v in IMPORTS.items()}[fmt]
    raw = iq4_nl_blocks(np.random.randn(40, 96).astype(np.float32)) if qtype == Q.IQ4_NL else \
        gguf.quants.quantize(np.random.randn(40, 96).astype(np.float32), qtype)
    as_bytes, codes = block_tensors(raw, qtype.name), decode_blocks(raw, qtype.name)
    held = [name for name in layouts() if get_layout(name).supports(tl.get_format(fmt))]
    assert {"lut4_i8_n16", "q4_4x4", "q4_8x8"} <= set(held) if fmt in ("q4_0", "iq4_nl") else len(held) >= 2
    for name in held:
        a = tl.QuantLinear.from_quantized(fmt, as_bytes, 40, 96, layout=name, codes_as_row_bytes=True)
        b = tl.QuantLinear.from_quantized(fmt, codes, 40, 96, layout=name)
        assert a.packed.keys() == b.packed.keys(), name
        assert all(torch.equal(a.packed[k], b.packed[k]) for k in a.packed), name
    if fmt != "q8_0":  # 8-bit codes are their own row bytes
        with pytest.raises(ValueError, match=r"codes must be torch.uint8 \[40, 96\], got torch.uint8 \[40, 48\]"):
            tl.QuantLinear.from_quantized(fmt, as_bytes, 40, 96)
    with pytest.raises(ValueError, match="no row-byte form"):
        tl.QuantLinear.from_quantized("int2_g32", tl.get_format("int2_g32").quantize(torch.randn(8, 64)), 8, 64,
                                      codes_as_row_bytes=True)


# ---- one parse: the config from the reader's fields, the tokenizer cache --------------------------

def byte_level_tokenizer(w):
    """A small GPT-2 style byte-level BPE vocabulary with merges, special tokens and a chat template,
    the keys llama.cpp writes for SmolLM2."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ c", "a p", "Ġc ap"]
    special = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges] + special
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(special)) + [3] * len(special))
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


TOKENIZER_VOCAB = 256 + 10 + 3


def tokenizer_gguf(tmp_path):
    return write_gguf(llama(vocab_size=TOKENIZER_VOCAB), tmp_path / "t.gguf", lambda name, nd: Q.Q4_0,
                      metadata=byte_level_tokenizer)


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        max_position_embeddings=128, rms_norm_eps=EPS)).eval()


@pytest.mark.parametrize("case", ["llama", "llama-tied", "mistral", "qwen2", "qwen3"])
def test_from_gguf_config_is_transformers_own(tmp_path, case):
    """The config built from from_gguf's own reader equals AutoConfig.from_pretrained(gguf_file=)'s."""
    from transformers import AutoConfig
    make, arch = {"llama": (llama, "llama"), "llama-tied": (lambda: llama(tie_word_embeddings=True), "llama"),
                  "mistral": (llama, "llama"), "qwen2": (tiny_qwen2, "qwen2"), "qwen3": (tiny_qwen3, "qwen3")}[case]
    metadata = {"mistral": lambda w: w.add_name("mistral"), "qwen3": lambda w: w.add_key_length(32)}.get(case)
    path = write_gguf(make(), tmp_path / "c.gguf", lambda name, nd: Q.Q8_0, arch=arch, metadata=metadata)
    model, _ = tl.from_gguf(path)
    want = AutoConfig.from_pretrained(str(tmp_path), gguf_file="c.gguf")
    if case == "qwen3":
        want.head_dim = 32  # {arch}.attention.key_length, which from_gguf reads and transformers does not
    assert model.config.model_type == want.model_type == ("mistral" if case == "mistral" else arch)
    # all but dtype, which building the model (from_gguf's dtype=) sets
    assert {k: v for k, v in model.config.to_dict().items() if k != "dtype"} == \
        {k: v for k, v in want.to_dict().items() if k != "dtype"}


def test_from_gguf_parses_the_file_once_and_caches_the_tokenizer(tmp_path, monkeypatch, caplog):
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from transformers import AutoTokenizer
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path / "cache"))
    path = tokenizer_gguf(tmp_path)
    want = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")  # transformers' own conversion
    parses = []
    reader_init = gguf.GGUFReader.__init__

    def counted_init(self, *args, **kwargs):
        parses.append(args)
        reader_init(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted_init)
    _, first = tl.from_gguf(path)  # converts (transformers reads the file again) and writes the entry
    root = tmp_path / "cache" / "tokenizers"
    entries = list(root.iterdir())
    assert len(entries) == 1 and (root.stat().st_mode & 0o777) == 0o700
    assert sorted(p.name for p in entries[0].iterdir()) == ["chat_template.jinja", "tokenizer.json",
                                                           "tokenizer_config.json"]
    parses.clear()
    with monkeypatch.context() as m:
        m.setattr(hf_gguf, "load_gguf_checkpoint", lambda *a, **kw: pytest.fail("transformers parsed the GGUF again"))
        model, tok = tl.from_gguf(path)
    assert len(parses) == 1  # from_gguf's own reader, nothing else
    texts = ["the cap in the hat", "  Ünïcödé\n\tdigits 12345 ", "<|im_start|>user\nhi<|im_end|>", ""]
    for t in (first, tok):
        for text in texts:
            ids = t(text).input_ids
            assert ids == want(text).input_ids, text
            assert t.decode(ids) == want.decode(ids) and t.decode(ids, skip_special_tokens=True) == \
                want.decode(ids, skip_special_tokens=True)
        assert (t.bos_token, t.eos_token, t.pad_token, t.unk_token) == \
            (want.bos_token, want.eos_token, want.pad_token, want.unk_token)
        assert t.all_special_ids == want.all_special_ids
        chat = [{"role": "user", "content": "the cap"}, {"role": "assistant", "content": "in"}]
        assert t.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert model.config.vocab_size == TOKENIZER_VOCAB

    # a corrupt entry (a crash mid-write elsewhere, an edit) is converted again, not an error
    (entries[0] / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with caplog.at_level(logging.WARNING, logger="torch_lowbit.io.tokenizer_cache"):
        _, rebuilt = tl.from_gguf(path)
    assert "unreadable" in caplog.text
    assert rebuilt(texts[0]).input_ids == want(texts[0]).input_ids
    assert [p.name for p in root.iterdir()] == [entries[0].name]  # rebuilt in place, no partial folder left
    json_ok = (entries[0] / "tokenizer.json").read_text()
    assert json_ok.startswith("{") and json_ok.rstrip().endswith("}")


def test_open_gguf_reads_what_ggufs_reader_reads(tmp_path):
    from torch_lowbit.io.gguf import open_gguf
    path = write_gguf(llama(vocab_size=TOKENIZER_VOCAB), tmp_path / "t.gguf", lambda name, nd: Q.Q4_1,
                      metadata=byte_level_tokenizer)
    got, want = open_gguf(path), gguf.GGUFReader(path)
    assert isinstance(got, gguf.GGUFReader) and list(got.fields) == list(want.fields)
    for key, field in want.fields.items():
        assert got.fields[key].contents() == field.contents(), key
        assert got.fields[key].types == field.types and got.fields[key].data == field.data, key
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in got.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in want.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(got.tensors, want.tensors))


def test_tokenizer_cache_refuses_a_folder_others_can_write(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "tokenizers").mkdir(parents=True)
    (tmp_path / "cache" / "tokenizers").chmod(0o777)
    path = tokenizer_gguf(tmp_path)
    with caplog.at_level(logging.WARNING, logger="torch_lowbit.io.tokenizer_cache"):
        _, tok = tl.from_gguf(path)
    assert "writable by others" in caplog.text and tok("the cap").input_ids
    assert not any((tmp_path / "cache" / "tokenizers").iterdir())


def test_tokenizer_cache_keeps_the_most_recent_entries(tmp_path, monkeypatch):
    from torch_lowbit.io import tokenizer_cache
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_cache, "MAX_ENTRIES", 1)
    root = tmp_path / "cache" / "tokenizers"
    first = tokenizer_gguf(tmp_path)
    tl.from_gguf(first)
    crashed = root / ".partial-crashed"  # a writer killed mid-write an hour ago
    crashed.mkdir()
    os.utime(crashed, (time.time() - 7200,) * 2)
    (tmp_path / "b").mkdir()
    _, tok = tl.from_gguf(tokenizer_gguf(tmp_path / "b"))
    assert [p.name for p in root.iterdir()] == [tokenizer_cache.entry_key(tmp_path / "b" / "t.gguf")]
    assert tok("the cap").input_ids


# ---- to_gguf -------------------------------------------------------------------------------------

def quantized(fmt, fuse=True, **kw):
    model = llama(**kw)
    tl.quantize_(model, fmt, fuse=fuse, progress=False)
    return model


PLAN = {f"model.layers.{i}.{n}": f for i in range(2) for n, f in
        (("self_attn.q_proj", "iq4_nl"), ("self_attn.k_proj", "iq4_nl"), ("self_attn.v_proj", "iq4_nl"),
         ("self_attn.o_proj", "q4_0"), ("mlp.gate_proj", "int4_g32"), ("mlp.up_proj", "int4_g32"),
         ("mlp.down_proj", "int4_g64"))}


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g32", "iq4_nl", "q8_0", "mixed"])
def test_to_gguf_writes_the_modules_blocks_and_reads_back_exactly(tmp_path, fmt):
    if fmt not in tl.formats() and fmt != "mixed":
        pytest.skip(f"the {fmt} format is not registered in this torch_lowbit")
    model = quantized(PLAN if fmt == "mixed" else fmt)
    path = tl.to_gguf(model, tmp_path / "o.gguf")
    reader = gguf.GGUFReader(path)
    want_type = {"q4_0": Q.Q4_0, "int4_g32": Q.Q4_1, "iq4_nl": Q.IQ4_NL, "int4_g64": Q.Q4_1, "q8_0": Q.Q8_0}
    _, exp, names = hf_reference(llama, path)
    got = module_weights(model)
    types = {t.name: t.tensor_type for t in reader.tensors}
    for fqn, w in got.items():
        name = names.get_name(fqn + ".weight", try_suffixes=(".weight",))
        assert torch.equal(exp[name], w), fqn
        m_fmt = (PLAN.get(fqn) if fmt == "mixed" else fmt) if fqn != "lm_head" else None
        assert types[name] == (want_type[m_fmt] if m_fmt else Q.F32), fqn
    back, _ = tl.from_gguf(path)
    assert module_weights(back).keys() == got.keys()
    for fqn, w in module_weights(back).items():
        assert torch.equal(w, got[fqn]), fqn
    kept = {f: m for f, m in model.named_modules() if isinstance(m, tl.QuantLinear) and m.fmt.name != "int4_g64"}
    for fqn, m in kept.items():  # same format: the very same packed buffers
        twin = back.get_submodule(fqn)
        assert (twin.fmt, twin.layout, twin.split_sizes) == (m.fmt, m.layout, m.split_sizes), fqn
        assert m.packed.keys() == twin.packed.keys()
        assert all(torch.equal(m.packed[k], twin.packed[k]) for k in m.packed), fqn
    for fqn, m in model.named_modules():  # int4_g64 is written as Q4_1 pairs and comes back as int4_g32
        if isinstance(m, tl.QuantLinear) and m.fmt.name == "int4_g64":
            assert back.get_submodule(fqn).fmt.name == "int4_g32"
    if fmt != "mixed":
        ids = torch.randint(0, 256, (1, 13))
        with torch.no_grad():
            assert torch.equal(back(ids).logits, model(ids).logits)


def test_to_gguf_unfused_bias_and_other_formats(tmp_path):
    model = tiny_qwen2()
    tl.quantize_(model, {**{k: "q4_0" for k in PLAN if "mlp" not in k}, **{k: "int3_g32" for k in PLAN if "mlp" in k}},
                 fuse=False, progress=False)
    with pytest.raises(ValueError, match="int3_g32"):
        tl.to_gguf(model, tmp_path / "o.gguf")
    path = tl.to_gguf(model, tmp_path / "o.gguf", other_formats="f32")
    _, exp, names = hf_reference(tiny_qwen2, path, permuted=False)
    for fqn, w in module_weights(model).items():
        assert torch.equal(exp[names.get_name(fqn + ".weight", try_suffixes=(".weight",))], w), fqn
    assert torch.equal(exp["blk.0.attn_k.bias"], model.model.layers[0].self_attn.k_proj.bias)
    back, _ = tl.from_gguf(path, fuse=False)
    ids = torch.randint(0, 256, (1, 11))
    with torch.no_grad(), tl.use_backend("reference"):
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_qwen3_round_trip(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, max_position_embeddings=128, rms_norm_eps=EPS,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # q_norm / k_norm must land on their own tensors
    tl.quantize_(model, "iq4_nl", progress=False)
    path = tl.to_gguf(model, tmp_path / "q3.gguf")
    assert "blk.1.attn_k_norm.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    back, _ = tl.from_gguf(path)
    assert back.config.head_dim == 64 and back.model.layers[0].self_attn.qkv_proj.split_sizes == [256, 128, 128]
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad(), tl.use_backend("reference"):
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_to_gguf_rejects_bad_input(tmp_path):
    model = quantized("q4_0")
    with pytest.raises(ValueError, match="other_formats"):
        tl.to_gguf(model, tmp_path / "o.gguf", other_formats="q4")
    with pytest.raises(ValueError, match="float_type"):
        tl.to_gguf(model, tmp_path / "o.gguf", float_type="bf8")
    with pytest.raises(ValueError, match="template="):
        tl.to_gguf(model, tmp_path / "o.gguf", tokenizer=object())
    with pytest.raises(ValueError, match="model_type"):
        tl.to_gguf(torch.nn.Linear(4, 4), tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="no tokenizer"):
        tl.to_gguf(model, tmp_path / "o.gguf", template=tl.to_gguf(model, tmp_path / "n.gguf"))
    from torch_lowbit.eval.assets import smollm2_gguf
    with pytest.raises(ValueError, match="template's tokenizer has 49152 tokens, the model's vocab_size is 256"):
        tl.to_gguf(model, tmp_path / "o.gguf", template=smollm2_gguf())
    assert not (tmp_path / "o.gguf").exists()


# ---- SmolLM2's bundled Q4_1 GGUF -----------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_imported():
    from torch_lowbit.eval.assets import smollm2_gguf
    return tl.from_gguf(smollm2_gguf())


@pytest.mark.slow
def test_smollm2_gguf_imports_losslessly(smollm2_imported, smollm2):
    from torch_lowbit.eval import perplexity, wiki_text
    model, tok = smollm2_imported
    ref, ref_tok = smollm2  # transformers' own GGUF load: every tensor dequantized to fp32
    ref_w = ref.state_dict()  # (with the tied head's name too)
    got = module_weights(model)
    assert sum(isinstance(m, tl.QuantLinear) for m in model.modules()) == 30 * 4 + 1  # + the tied head
    assert all(m.fmt.name == "int4_g32" for m in model.modules() if isinstance(m, tl.QuantLinear)
               and m is not model.lm_head)
    emb = model.model.embed_tokens  # the Q8_0 token_embd, shared with the head as llama.cpp runs it
    assert isinstance(emb, tl.QuantEmbedding) and emb.fmt.name == "q8_0" and model.lm_head.fmt.name == "q8_0"
    assert torch.equal(emb.dequantize(), ref_w["model.embed_tokens.weight"])
    for fqn, w in got.items():
        assert torch.equal(w, ref_w[f"{fqn}.weight"]), fqn
    text = wiki_text(40)
    assert tok(text).input_ids == ref_tok(text).input_ids
    with tl.use_backend("reference"):
        ppl = perplexity(model, tok, text, ctx=512, max_tokens=2048, progress=False)
        ppl_ref = perplexity(ref, ref_tok, text, ctx=512, max_tokens=2048, progress=False)
    assert ppl == ppl_ref
    ppl_cpu = perplexity(model, tok, text, ctx=512, max_tokens=2048, progress=False)
    print(f"SmolLM2 Q4_1 GGUF: fp32 {ppl_ref:.4f}, imported (reference) {ppl:.4f}, imported (cpu kernels) {ppl_cpu:.4f}")
    assert abs(ppl_cpu - ppl_ref) < 0.02 * ppl_ref


@pytest.mark.slow
def test_smollm2_to_gguf_writes_the_source_blocks_back(smollm2_imported, tmp_path):
    from torch_lowbit.eval.assets import smollm2_gguf
    from transformers import AutoTokenizer
    model, tok = smollm2_imported
    path = tl.to_gguf(model, tmp_path / "s.gguf", template=smollm2_gguf())
    src = {t.name: t for t in gguf.GGUFReader(smollm2_gguf()).tensors}
    out = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert sorted(src) == sorted(out)
    for name, t in src.items():
        if t.tensor_type == Q.Q4_1:  # every block byte back where llama.cpp put it (q/k rope order included)
            assert out[name].tensor_type == Q.Q4_1 and np.array_equal(out[name].data, t.data), name
        else:  # F32 norms, the Q8_0 embedding: same type, same bytes
            assert out[name].tensor_type == t.tensor_type and np.array_equal(out[name].data, t.data), name
    tok2 = AutoTokenizer.from_pretrained(tmp_path, gguf_file="s.gguf")
    text = "GGUF files carry their tokenizer: Ünïcödé, digits 12345, and <|im_start|> tokens."
    assert tok2(text).input_ids == tok(text).input_ids


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_q5_block_codec_round_trips_gguf_bytes(qtype):
    """Q5_0 / Q5_1 blocks (fp16 d (, m), u32 qh, 16 B nibbles) -> q5_0 / q5_1 codes one per byte and back,
    byte for byte, on odd shapes; their values are gguf's dequantizer's, bit for bit; from_gguf keeps them
    (native_format: the lut5_i8_n16 tiles)."""
    from torch_lowbit.io.gguf_blocks import block_tensors, codes_as_row_bytes, decode_blocks, encode_blocks, \
        format_of, native_format
    seed = int(torch.randint(0, 2 ** 31, ()))
    g = torch.Generator().manual_seed(seed)
    rows = 13 + int(torch.randint(0, 8, (), generator=g))
    w = (torch.randn(rows, 32 * 3, generator=g) * torch.rand(rows, 1, generator=g) + 0.01).numpy()
    raw = gguf.quants.quantize(w, qtype)
    q = decode_blocks(raw, qtype.name)
    assert not codes_as_row_bytes(qtype.name) and torch.equal(block_tensors(raw, qtype.name)["codes"], q["codes"])
    assert q["codes"].shape == (rows, 96) and int(q["codes"].max()) == 31 and int(q["codes"].min()) == 0
    fmt = format_of(qtype.name)
    assert torch.equal(fmt.dequantize(q), torch.from_numpy(gguf.quants.dequantize(raw, qtype))), seed
    type_name, back = encode_blocks(fmt, q)
    assert type_name == qtype.name and np.array_equal(back, raw), seed
    assert native_format(qtype.name) == fmt.name
    with pytest.raises(ValueError, match="multiple of 32"):
        block_tensors(raw[:, :-1], qtype.name)
    with pytest.raises(ValueError, match="row length 80"):
        encode_blocks(fmt, {k: v[:, :80] if k == "codes" else v for k, v in q.items()})


def test_lean_reader_steps_over_long_arrays(tmp_path, monkeypatch):
    """from_gguf's reader leaves the vocabulary, merges and token types unparsed (lengths kept), and
    reads every other field and tensor as gguf's own reader does."""
    from torch_lowbit.io import gguf as io_gguf
    path = tokenizer_gguf(tmp_path)
    monkeypatch.setattr(io_gguf, "LEAN_ARRAY_MIN", 8)  # the test vocabulary is 269 tokens
    full, lean = io_gguf.open_gguf(path), io_gguf.open_gguf(path, lean=True)
    assert list(lean.fields) == list(full.fields)
    stepped = [k for k, f in lean.fields.items() if len(f.types) > 1 and not f.data]
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"} <= set(stepped)
    for key, field in lean.fields.items():
        if key in stepped:
            assert io_gguf.array_length(field) == len(full.fields[key].contents()) >= 8
        else:
            assert field.contents() == full.fields[key].contents(), key
    assert [(t.name, t.data_offset, t.tensor_type) for t in lean.tensors] == \
        [(t.name, t.data_offset, t.tensor_type) for t in full.tensors]
    model, tok = tl.from_gguf(path)
    assert model.config.vocab_size == TOKENIZER_VOCAB and tok("the cap").input_ids
