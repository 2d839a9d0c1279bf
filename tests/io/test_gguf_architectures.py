"""GGUF import and export of the architectures beyond Llama/Qwen (io/gguf_arch.py): Gemma 2, Gemma 3 (text)
and Phi-3, each written here as llama.cpp's converter writes it (gguf's own writer; Gemma's norms stored as
1 + w; Phi-3's fused attn_qkv / ffn_up), then imported and compared with the same HF model on the
file's dequantized weights (gguf's dequantizer)."""
import numpy as np
import pytest
import torch

import torch_lowbit as tl

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
EPS = 2.0 ** -20  # an rms_norm_eps fp32 GGUF metadata holds exactly
BASE = dict(vocab_size=256, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=EPS)


def tiny(arch: str):
    """A small random HF model of the architecture, every parameter (norms included) random."""
    import transformers as T
    if arch == "gemma2":
        model = T.Gemma2ForCausalLM(T.Gemma2Config(**BASE, head_dim=24, sliding_window=16))
    elif arch == "gemma3":
        model = T.Gemma3ForCausalLM(T.Gemma3TextConfig(**BASE, head_dim=24, sliding_window=16))
    else:
        model = T.Phi3ForCausalLM(T.Phi3Config(**BASE, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                               tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
    return model.eval()


def write_gguf(model, arch: str, path, qtype=Q.Q8_0):
    """The model as llama.cpp's converter would write it: matrices in qtype blocks, norms F32 (Gemma's
    plus 1), the hyperparameters transformers' GGUF loader reads."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                         and "rope_theta" in cfg.rope_parameters else 10000.0)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in (("pad", cfg.pad_token_id), ("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id)):
        if isinstance(value, int) and value < cfg.vocab_size:  # as real files carry them (Phi-3's default 32000)
            getattr(w, f"add_{key}_token_id")(value)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    for hf_name, p in model.named_parameters():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = p.detach().numpy()
        if data.ndim == 1:
            w.add_tensor(name, data + (1.0 if arch.startswith("gemma") and name.endswith("norm.weight") else 0.0))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference(model, arch: str, path):
    """The HF model with exactly the file's dequantized weights (Gemma's norms minus 1)."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     model.config.num_hidden_layers)
    with torch.no_grad():
        for hf_name, p in model.named_parameters():
            t = tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))]
            w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            if arch.startswith("gemma") and t.name.endswith("norm.weight"):
                w = w - 1.0
            p.copy_(w.reshape(p.shape))
    return model


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_from_gguf_imports_the_architecture_with_the_files_blocks(tmp_path, arch):
    source = tiny(arch)
    path = write_gguf(source, arch, tmp_path / f"{arch}.gguf")
    model, _ = tl.from_gguf(path)
    ref = reference(source, arch, path)
    assert type(model) is type(ref)
    quant = [m for m in model.modules() if isinstance(m, tl.QuantLinear)]
    assert quant and all(m.fmt.name == "q8_0" for m in quant)
    emb = model.get_input_embeddings()
    assert isinstance(emb, tl.QuantEmbedding) and torch.equal(emb.dequantize(), ref.get_input_embeddings().weight)
    if arch == "gemma3":  # its embedding module scales rows by sqrt(hidden): the QuantEmbedding keeps it
        assert emb.scale == ref.get_input_embeddings().scalar_embed_scale
    ids = torch.randint(0, 256, (2, 21))
    with torch.no_grad(), tl.use_backend("reference"):
        got, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the default CPU kernels (int8 activations): close, not equal
        fast = model(ids).logits
    assert ((fast - want).norm() / want.norm()).item() < 0.03


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_to_gguf_writes_the_architecture_back_bit_for_bit(tmp_path, arch):
    source = write_gguf(tiny(arch), arch, tmp_path / "in.gguf")
    model, _ = tl.from_gguf(source)
    out = tl.to_gguf(model, tmp_path / "out.gguf")
    a = {t.name: t for t in gguf.GGUFReader(source).tensors}
    b = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert set(a) == set(b)
    for name, t in a.items():
        assert b[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(b[name].data), np.asarray(t.data)), name
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == arch
    again, _ = tl.from_gguf(out)
    ids = torch.randint(0, 256, (1, 13))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def assert_greedy(model, out, prompt_len: int, atol: float):
    """Each generated token is the argmax of the model's own logits at its position, up to atol (the
    kernels' rounding may flip near-ties, so a token within atol of the maximum is accepted)."""
    with torch.no_grad():
        logits = model(out).logits[0]
    for pos in range(prompt_len - 1, out.shape[1] - 1):
        row, token = logits[pos], int(out[0, pos + 1])
        assert row[token] >= row.max() - atol, (pos, token, int(row.argmax()), float(row.max() - row[token]))


def test_generation_runs_phi3_natively_and_gemma_past_its_window_on_model_generate(tmp_path, caplog):
    import logging

    from torch_lowbit.generation import CompiledGenerator
    phi3, _ = tl.from_gguf(write_gguf(tiny("phi3"), "phi3", tmp_path / "phi3.gguf"))
    ids = torch.randint(3, 256, (1, 7))
    gen = CompiledGenerator(phi3, max_cache_len=32)
    out = gen.generate(ids, 9)
    assert gen.native_reason is None and gen._native is not None  # fused qkv / gate_up, eval dropouts
    assert_greedy(phi3, out, 7, atol=2e-2)
    gemma, _ = tl.from_gguf(write_gguf(tiny("gemma2"), "gemma2", tmp_path / "gemma2.gguf"))
    long = torch.randint(3, 256, (1, 12))  # 12 + 10 tokens > the window of 16
    with caplog.at_level(logging.WARNING, logger="torch_lowbit"):
        got = tl.generate(gemma, long, max_new_tokens=10)
    assert "sliding-window attention (window 16) is shorter than prompt + new tokens (22)" in caplog.text
    assert torch.equal(got, gemma.generate(long, max_new_tokens=10, do_sample=False))
    with pytest.raises(ValueError, match="sliding-window attention"):
        CompiledGenerator(gemma, max_cache_len=32, compile=False).generate(long, 10)
    inside = CompiledGenerator(gemma, max_cache_len=32, compile=False).generate(long[:, :6], 8)  # 14 <= 16
    assert_greedy(gemma, inside, 6, atol=2e-2)
