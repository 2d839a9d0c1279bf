"""Model shapes the benchmarks build with random weights (speed only, never quality), defined once
for every bench that uses them (the CUDA e2e model, the CPU e2e GGUF files)."""
from __future__ import annotations

# Llama-3.2-1B: 16 layers, hidden 2048, MLP 8192, 32 query / 8 KV heads of 64, tied embedding.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096,
                rope_theta=500000.0)
LLAMA_1B_VOCAB = 128256


def llama_config(shape: dict, vocab_size: int):
    """A transformers LlamaConfig of a shape dict (LlamaConfig keyword arguments) and vocabulary size."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab_size, **shape)
