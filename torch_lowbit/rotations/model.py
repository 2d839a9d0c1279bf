"""QuaRot's computational invariance on a whole Llama-like model (Ashkboos et al., 2024, sec. 4).

`rotate_(model, seed)` changes the weights, not the function: without quantization the rotated
model's logits equal the original's up to rounding. Row-vector convention (y = x W^T):

1. Fold each RMSNorm's scale into the linear layers that read it (q/k/v after `input_layernorm`,
   gate/up after `post_attention_layernorm`, the LM head after the final norm); the norms become
   scale-free, so they commute with any orthogonal Q (RMS(x Q) = RMS(x)).
2. Rotate the residual stream by Q = diag(s) H_d (random signs, Hadamard of the hidden size): the
   embedding rows become E Q, every layer reading the stream W Q, every layer writing it (o_proj,
   down_proj) Q^T W (bias b Q). A tied embedding / LM head is untied first (they now differ).
3. Head-wise Hadamard on V / O: v_proj's output is rotated by H_h per head (W_v -> blockdiag(H_h)^T W_v),
   attention mixes whole value rows, so o_proj undoes it (W_o -> W_o blockdiag(H_h)).
4. Online Hadamard before down_proj: down_proj becomes `OnlineHadamardLinear`, computing
   linear(x H_I) with the weight W H_I, so its input (the activation QuaRot quantizes) is incoherent.
5. Online Hadamard before o_proj, across heads: step 3 only mixes channels within a head, so a head
   whose outputs are larger than the others' stays an outlier block in o_proj's input. QuaRot
   applies H_(n_h) across heads online on top of the fused H_(d_h); here one online Hadamard of
   o_proj's whole input (n_h * d_h, e.g. 576 = 36 * 16 for SmolLM2's 9 heads, where no H_9 exists)
   does the same job: o_proj becomes `OnlineHadamardLinear` with the weight W_o blockdiag(H_h) H.

The Hadamard of Q and K after RoPE (for a quantized KV cache) is applied inside attention, so it is
part of the KV-cache work, not of this weight pass.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .hadamard import check_hadamard_size, hadamard_matrix, random_signs

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class OnlineHadamardLinear(nn.Module):
    """linear(x @ H_n): the input rotated by the normalized Hadamard of its size at run time. The
    wrapped layer's weight already carries H_n (W H_n), so the pair computes x W^T."""

    def __init__(self, linear: nn.Module, in_features: int):
        super().__init__()
        check_hadamard_size(in_features)
        self.linear = linear
        self.in_features = in_features

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float64:  # the op computes in fp32; exactness checks run in float64
            return self.linear(x @ hadamard_matrix(self.in_features, torch.float64).to(x.device))
        from .ops import hadamard_transform
        return self.linear(hadamard_transform(x))

    def extra_repr(self) -> str:
        return f"online Hadamard of {self.in_features}"


def _layers(model: nn.Module, who: str = "rotate_"):
    """The decoder of a supported, not yet rotated or quantized model (else a ValueError naming `who`)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{who}: model type {model_type!r} is not supported; QuaRot rotation needs a Llama-like "
                         f"decoder with RMSNorm ({', '.join(SUPPORTED_MODEL_TYPES)})")
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm")
    if inner is None or any(not hasattr(inner, a) for a in needed) or not hasattr(model, "lm_head"):
        raise ValueError(f"{who}: expected a *ForCausalLM with .model.{{embed_tokens, layers, norm}} and .lm_head")
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for owner, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                lin = getattr(owner, name, None)
                if type(lin) is OnlineHadamardLinear:
                    raise ValueError(f"{who}: the model is already rotated ({name} has an online Hadamard)")
                if type(lin) is not nn.Linear:
                    raise ValueError(f"{who}: layer {i} {name} is {type(lin).__name__}, not nn.Linear: rotate "
                                     "before quantizing (quantize_ after rotate_)")
    return inner


def _norm_weight(norm: nn.Module) -> Tensor:
    w = getattr(norm, "weight", None)
    if w is None or w.dim() != 1 or getattr(norm, "bias", None) is not None:
        raise ValueError(f"rotate_: {type(norm).__name__} is not an RMSNorm with a scale vector; cannot fold it")
    return w


@torch.no_grad()
def _fold_norm(norm: nn.Module, readers: list[nn.Linear]) -> None:
    """W <- W diag(gamma) for each reader, gamma <- 1."""
    w = _norm_weight(norm)
    gamma = w.detach().double()
    for lin in readers:
        lin.weight.copy_((lin.weight.double() * gamma).to(lin.weight.dtype))
    w.fill_(1.0)


@torch.no_grad()
def _rotate_input(lin: nn.Module, q: Tensor) -> None:
    """A layer reading the rotated stream: W <- W Q."""
    lin.weight.copy_((lin.weight.double() @ q).to(lin.weight.dtype))


@torch.no_grad()
def _rotate_output(lin: nn.Linear, q: Tensor) -> None:
    """A layer writing the rotated stream: W <- Q^T W, b <- b Q."""
    lin.weight.copy_((q.T @ lin.weight.double()).to(lin.weight.dtype))
    if lin.bias is not None:
        lin.bias.copy_((lin.bias.double() @ q).to(lin.bias.dtype))


def _online_hadamard(lin: nn.Linear) -> OnlineHadamardLinear:
    """W <- W H, and H applied to the input at run time: the pair computes the same x W^T."""
    _rotate_input(lin, hadamard_matrix(lin.in_features, torch.float64).to(lin.weight.device))
    return OnlineHadamardLinear(lin, lin.in_features)


def _block_diag(h: Tensor, heads: int) -> Tensor:
    return torch.block_diag(*([h] * heads))


@torch.no_grad()
def rotate_(model: nn.Module, seed: int = 0, *, online_down_proj: bool = True, rotate_values: bool = True,
            online_o_proj: bool = True) -> nn.Module:
    """Applies QuaRot's rotations (module docstring) in place to a Llama-like HF causal LM; returns it.

    Rotate before quantizing: `rotate_(model); quantize_(model, ...)`. Sizes must be Hadamard sizes
    (k * 2^m, rotations/hadamard.py): hidden, intermediate (when online_down_proj), head_dim (when
    rotate_values) and heads * head_dim (when online_o_proj); an unsupported size raises naming the
    nearest supported ones.
    """
    inner = _layers(model)
    cfg = model.config
    hidden = inner.embed_tokens.weight.shape[1]
    check_hadamard_size(hidden)
    q = random_signs(hidden, seed).double()[:, None] * hadamard_matrix(hidden, torch.float64)
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    if rotate_values:
        check_hadamard_size(head_dim)
        h_head = hadamard_matrix(head_dim, torch.float64)
    if online_down_proj:
        check_hadamard_size(inner.layers[0].mlp.down_proj.in_features)
    if online_o_proj:
        check_hadamard_size(inner.layers[0].self_attn.o_proj.in_features)

    if model.lm_head.weight is inner.embed_tokens.weight:  # tied: the head gets the final norm, the embedding not
        model.lm_head.weight = nn.Parameter(inner.embed_tokens.weight.detach().clone())
        cfg.tie_word_embeddings = False
    device = inner.embed_tokens.weight.device
    q = q.to(device)

    emb = inner.embed_tokens.weight
    emb.copy_((emb.double() @ q).to(emb.dtype))
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _fold_norm(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj])
        _fold_norm(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _rotate_input(lin, q)
        _rotate_output(attn.o_proj, q)
        _rotate_output(mlp.down_proj, q)
        if rotate_values:
            hv = _block_diag(h_head.to(device), attn.v_proj.out_features // head_dim)
            _rotate_output(attn.v_proj, hv)  # v <- v blockdiag(H): W_v <- H^T W_v
            _rotate_input(attn.o_proj, _block_diag(h_head.to(device), attn.o_proj.in_features // head_dim))
        if online_o_proj:
            attn.o_proj = _online_hadamard(attn.o_proj)
        if online_down_proj:
            mlp.down_proj = _online_hadamard(mlp.down_proj)
    _fold_norm(inner.norm, [model.lm_head])
    _rotate_input(model.lm_head, q)
    return model
