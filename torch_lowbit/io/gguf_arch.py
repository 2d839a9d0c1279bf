"""The architectures GGUF import and export handle, and what differs between them in the file: the
facts llama.cpp's converter applies when it writes a Hugging Face model, which import undoes and
export redoes (one table for both directions)."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    name: str  # GGUF general.architecture
    model_types: tuple[str, ...]  # HF model_types written as this architecture
    permute_qk: bool = False  # q/k rows in llama.cpp's rope order (its LlamaModel.permute)
    norm_offset: float = 0.0  # GGUF norm weight = HF weight + offset (Gemma's (1 + w) RMSNorms store 1 + w)
    hf_model_type: Optional[str] = None  # the model_type transformers builds from it (default: name)

    def is_norm(self, gguf_tensor_name: str) -> bool:
        return gguf_tensor_name.endswith("norm.weight")


ARCHS = {a.name: a for a in (
    GGUFArch("llama", ("llama", "mistral"), permute_qk=True),  # Mistral GGUFs are "llama"
    GGUFArch("qwen2", ("qwen2",)),
    GGUFArch("qwen3", ("qwen3",)),
    GGUFArch("phi3", ("phi3",)),  # fused attn_qkv and ffn_up (gate and up) tensors, as HF's Phi3
    GGUFArch("gemma2", ("gemma2",), norm_offset=1.0),
    GGUFArch("gemma3", ("gemma3_text",), norm_offset=1.0, hf_model_type="gemma3_text"),  # text backbone only
)}


def arch_of_model_type(model_type: Optional[str]) -> Optional[GGUFArch]:
    """The GGUF architecture an HF model_type is written as, or None."""
    return next((a for a in ARCHS.values() if model_type in a.model_types), None)
