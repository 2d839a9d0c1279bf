"""Modules: QuantLinear, QuantEmbedding (and a tied head), fused projections, the model-level quantize_
and per-layer format allocation."""
from .act_quant import ActQuantLinear, quantize_activations_
from .allocate import MixedBits, allocate_formats, mix_summary, quantized_bpw
from .embedding import QuantEmbedding, quantize_embeddings_
from .fusion import ProjectionSlot
from .ggml_mixes import ggml_mix_plan
from .linear import QuantLinear
from .msq import MSQ, MSQPlan, plan_msq
from .quantize import quantize_
from .select import default_filter

__all__ = ["ActQuantLinear", "quantize_activations_", "QuantLinear", "QuantEmbedding", "quantize_embeddings_", "ProjectionSlot", "quantize_", "default_filter", "allocate_formats", "MixedBits",
           "mix_summary", "quantized_bpw", "ggml_mix_plan", "MSQ", "MSQPlan", "plan_msq"]
