"""GGUF K-quant tensors <-> the K-quant formats (io/gguf_kquants.py), through a file written with gguf's
own GGUFWriter and read back with its GGUFReader, against gguf's dequantizer."""
import numpy as np
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.io.gguf_kquants import kquant_blocks, kquant_format, kquant_tensors

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
KQUANT_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def test_kquant_format_names_only_kquant_types():
    assert {t.name: kquant_format(t.name) for t in KQUANT_TYPES} == \
        {"Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
    assert kquant_format("Q4_0") is None and kquant_format("IQ4_XS") is None
    with pytest.raises(ValueError, match="not a K-quant type"):
        kquant_tensors(np.zeros((1, 18), np.uint8), "Q4_0")
    with pytest.raises(ValueError, match="not a K-quant"):
        kquant_blocks("q4_0", {"codes": torch.zeros(1, 32, dtype=torch.uint8)})


@pytest.mark.parametrize("qtype", KQUANT_TYPES, ids=lambda q: q.name)
def test_file_blocks_import_losslessly_and_export_byte_for_byte(tmp_path, qtype):
    """Our quantizer's blocks written to a GGUF file by gguf's writer: read back with gguf's reader they
    convert to the format's tensors (equal to ours), dequantize as gguf does, and encode to the file's bytes."""
    name = kquant_format(qtype.name)
    fmt = tl.get_format(name)
    gen = torch.Generator().manual_seed(9800 + KQUANT_TYPES.index(qtype))
    w = torch.randn(23, 256 * 3, generator=gen) * torch.rand(23, 1, generator=gen).add(0.2) * 0.03
    q = fmt.quantize(w)
    raw = kquant_blocks(fmt, q)
    assert raw.dtype == np.uint8 and raw.shape == (23, 3 * gguf.GGML_QUANT_SIZES[qtype][1])

    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    assert tensor.tensor_type == qtype
    from_file = np.asarray(tensor.data).reshape(23, -1)

    back = kquant_tensors(from_file, qtype.name)
    assert set(back) == set(q) and all(torch.equal(back[k], q[k]) for k in q)
    expected = torch.from_numpy(gguf.quants.dequantize(from_file, qtype)).reshape(23, -1)
    assert torch.equal(fmt.dequantize(back), expected)
    assert np.array_equal(kquant_blocks(name, back), from_file)
    layer = tl.QuantLinear.from_quantized(name, back, 23, 768, layout="ggml_k_blocks")
    assert np.array_equal(layer.blocks.numpy(), from_file)  # the layout holds the file's bytes
    tiles = tl.QuantLinear.from_quantized(name, back, 23, 768)  # the CPU kernels' tiles keep every field
    assert tiles.layout.name == "kquant_i8_n16"
    assert np.array_equal(kquant_blocks(name, tiles.layout.unpack(tiles.fmt, tiles.packed, 23, 768)), from_file)


def _kquant_llama_gguf(path, types, tied=True):
    """A 2-layer llama (hidden 256: whole super-blocks) as a GGUF file: linear tensors in types[name]
    (our quantizer's blocks), the token embedding Q8_0, norms F32."""
    from conftest import tiny_llama
    model = tiny_llama(hidden_size=256, intermediate_size=512, tie_word_embeddings=tied)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
                       ("block_count", cfg.num_hidden_layers), ("feed_forward_length", cfg.intermediate_size),
                       ("head_count", cfg.num_attention_heads), ("head_count_kv", cfg.num_key_value_heads),
                       ("vocab_size", cfg.vocab_size)):
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(2.0 ** -20)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    from torch_lowbit.io.gguf_blocks import rope_rows
    for hf_name, p in model.named_parameters():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = p.detach()
        if ".attn_q." in name or ".attn_k." in name:  # llama.cpp's rope row order
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            data = data[rope_rows(data.shape[0], heads, to_gguf=True)]
        qtype = types(name) if data.dim() == 2 else Q.F32
        if qtype in KQUANT_TYPES:
            writer.add_tensor(name, kquant_blocks(kquant_format(qtype.name), tl.get_format(kquant_format(qtype.name))
                                                  .quantize(data)), raw_dtype=qtype)
        elif qtype == Q.F32:
            writer.add_tensor(name, data.numpy())
        else:
            writer.add_tensor(name, gguf.quants.quantize(data.numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_from_gguf_keeps_k_quant_blocks_and_to_gguf_writes_them_back(tmp_path, caplog):
    import logging
    kinds = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K, "ffn_gate": Q.Q3_K,
             "ffn_up": Q.Q3_K, "ffn_down": Q.Q2_K, "token_embd": Q.Q8_0}
    path = _kquant_llama_gguf(tmp_path / "k.gguf", lambda name: kinds[name.split(".")[-2]])
    with caplog.at_level(logging.INFO, logger="torch_lowbit.io.gguf"):
        model, _ = tl.from_gguf(path)
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("from_gguf k.gguf: kept"))
    assert "Q4_K x4 -> q4_k" in summary and "Q2_K x2 -> q2_k" in summary and "dequantized 5 (F32 x5" in summary
    layer = model.model.layers[1]
    assert layer.self_attn.v_proj.fmt.name == "q6_k" and layer.self_attn.v_proj.layout.name == "kquant_i8_n16"
    assert layer.mlp.gate_up_proj.fmt.name == "q3_k"  # fused: both Q3_K
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    from torch_lowbit.io.gguf_blocks import rope_rows
    t = tensors["blk.1.ffn_down.weight"]
    assert torch.equal(layer.mlp.down_proj.dequantize(), torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))
    q_proj = layer.self_attn.q_proj  # q/k/v not fused: v is Q6_K
    t = tensors["blk.1.attn_q.weight"]
    expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
    expected = expected[rope_rows(expected.shape[0], model.config.num_attention_heads, to_gguf=False)]
    assert torch.equal(q_proj.dequantize().split(q_proj.split_sizes or [q_proj.out_features])[0], expected)
    out = tl.to_gguf(model, tmp_path / "out.gguf")
    written = {t.name: t for t in gguf.GGUFReader(out).tensors}
    for name, t in tensors.items():
        assert written[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(written[name].data), np.asarray(t.data)), name
    # requantize= trades the K-quant blocks for another format
    fast, _ = tl.from_gguf(path, requantize="q4_0")
    assert fast.model.layers[0].mlp.down_proj.fmt.name == "q4_0"


def test_llama_cpp_reads_our_q4_k_m_export_as_we_do(tmp_path):
    """A q4_k_m-mixed model written by to_gguf loads in llama.cpp itself, whose perplexity over the same
    windows equals ours: it decodes our K-quant blocks as we do (random weights: a check of the
    numbers, not of quality)."""
    pytest.importorskip("llama_cpp")  # the optional [peers] extra
    from transformers import LlamaConfig, LlamaForCausalLM

    from torch_lowbit.bench.e2e import llama_cpp_perplexity
    from torch_lowbit.eval.assets import smollm2_gguf, wiki_text
    from torch_lowbit.eval.perplexity import perplexity
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    tl.quantize_(model, "q4_k_m", progress=False)
    path = tl.to_gguf(model, tmp_path / "q4_k_m.gguf", template=smollm2_gguf())
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"Q4_K", "Q6_K"} <= types
    imported, tokenizer = tl.from_gguf(path)
    ids = tokenizer(wiki_text(400), return_tensors="pt").input_ids[0][:512]
    theirs = llama_cpp_perplexity(path, ids, 256, 2)
    ours = perplexity(imported, tokenizer, wiki_text(400), ctx=256, max_tokens=512, progress=False)
    assert abs(ours / theirs - 1) < 0.005, (ours, theirs)
