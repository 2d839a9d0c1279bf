"""Fast generation of a (quantized) Hugging Face causal LM: a static KV cache and torch.compile'd
prefill and decode steps (fullgraph: the torch_lowbit ops run inside the graph; one graph for every
decode step, so nothing recompiles per token), driven by a lean loop: greedy, or sampling on the
last position's logits, tokens handed to a streamer as they come.

    gen = torch_lowbit.CompiledGenerator(model, max_cache_len=512)
    out = gen.generate(input_ids, max_new_tokens=64)        # greedy, same tokens as model.generate
    out = gen.generate(input_ids, 64, do_sample=True, temperature=0.7, top_p=0.9, seed=0, streamer=TextStreamer(tok))

torch_lowbit.generate (generate_route.py) picks this route or model.generate for a model and options.

Why not `model.generate(..., cache_implementation="static")`: on CPU transformers compiles nothing
unless a private flag of CompileConfig is set, and its per-token Python work (logits processors,
stopping criteria, cache bookkeeping) costs as much as a small model's whole forward.
"""
from __future__ import annotations

import contextlib
import logging
import numbers
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .ops.attention import gqa_attention as gqa_attention_op
from .ops.threads import kernels_on_the_pool
from .sampling import Sampler

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _attention(model: nn.Module, implementation: Optional[str]):
    config = model.config
    saved = getattr(config, "_attn_implementation", None)
    if implementation is not None:
        config._attn_implementation = implementation
    try:
        yield
    finally:
        if implementation is not None:
            config._attn_implementation = saved


ATTENTION = "torch_lowbit"  # the transformers attention implementation name CompiledGenerator uses


def gqa_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                  scaling: Optional[float] = None, dropout: float = 0.0, **kwargs):
    """A transformers attention function (AttentionInterface): on a bound quantized KV cache the
    kv_attention kernel on its codes (decode and prefill); on a float cache torch_lowbit::gqa_attention
    at decode (one query row per head, one op) and transformers' eager attention at prefill (several
    rows: inductor fuses its matmuls well). Softcapping, sinks, sliding windows, dropout and
    non-CPU devices go to eager attention."""
    kv_layer = getattr(module, "_lowbit_kv_layer", None)  # a bound QuantizedKVLayer (deferred read)
    unsupported = dropout or kwargs.get("softcap") or kwargs.get("sliding_window") or kwargs.get("s_aux") is not None
    if unsupported or query.device.type != "cpu" or (query.shape[2] != 1 and kv_layer is None):
        # prefill on a float cache: inductor's fused matmuls win
        from transformers.models.llama.modeling_llama import eager_attention_forward
        if kv_layer is not None:  # update() returned only the new rows: attend to the rounded cache
            key, value = kv_layer.read()
        return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                       **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kv_layer is not None:  # decode and prefill on a quantized cache: the kernel reads its codes
        return kv_layer.attention(query, attention_mask, scale), None
    mask = attention_mask[..., :key.shape[-2]] if attention_mask is not None else None
    return gqa_attention_op(query, key, value, mask, scale), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(ATTENTION, gqa_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)  # an explicit causal mask, never "skip it"


def _wait_for(device: torch.device) -> None:
    """Wait for the device's queued work, so a phase's wall time includes it (CUDA runs asynchronously;
    per-token times stay the host's time to enqueue a step)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode_threads(device: torch.device):
    """On CPU, decode steps run torch's small ops on the calling thread and the quantized kernels on the
    work-claiming pool (ops/threads.py): no OpenMP thread waits on, or spins against, a core another
    program keeps busy. (The decode graph is compiled inside it: inductor's kernels get one thread.)"""
    return kernels_on_the_pool() if device.type == "cpu" else contextlib.nullcontext()


def _device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model with neither)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


@contextlib.contextmanager
def _bind_kv_layers(model: nn.Module, cache, enabled: bool):
    """While generating: each attention module of a model with a QuantizedKVCache gets its cache
    layer (`_lowbit_kv_layer`), so gqa_attention runs the kv_attention kernel on the codes (prefill
    and decode) instead of attending to a dequantized copy."""
    from .kv_cache import QuantizedKVLayer
    bound = []
    if enabled and cache is not None:
        for mod in model.modules():
            idx = getattr(mod, "layer_idx", None)
            if idx is None or not hasattr(mod, "o_proj") or idx >= len(cache.layers):
                continue
            layer = cache.layers[idx]
            if isinstance(layer, QuantizedKVLayer):
                mod._lowbit_kv_layer, layer.defer_read = layer, True
                bound.append(mod)
    try:
        yield
    finally:
        for mod in bound:
            mod._lowbit_kv_layer.defer_read = False
            del mod._lowbit_kv_layer


def last_logits(model: nn.Module, input_ids: Tensor, cache_position: Tensor, cache) -> Tensor:
    """One forward over input_ids at cache_position (filling `cache`): [batch, vocab] logits of the last
    position (what sampling draws from)."""
    out = model(input_ids=input_ids, position_ids=cache_position.unsqueeze(0).expand(input_ids.shape[0], -1),
                cache_position=cache_position, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def greedy_step(model: nn.Module, input_ids: Tensor, cache_position: Tensor, cache) -> Tensor:
    """One forward over input_ids at cache_position (filling `cache`): the greedy next token of each row."""
    return last_logits(model, input_ids, cache_position, cache).argmax(-1, keepdim=True)


def _skip_guards(skip: bool):
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip else contextlib.nullcontext()


@dataclass
class GenerationTimes:
    """Wall-clock seconds of the last generate() call, split where users feel them (on CUDA the prefill
    and decode totals include the device's work; per_token_s is the host's time per step)."""
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    per_token_s: list = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens after the first (which the prefill produces) per second of decode steps."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s else float("nan")


def sliding_window_problem(config, total_tokens: int) -> Optional[str]:
    """Why a generation of total_tokens (prompt + new) cannot run on the static cache's steps, or None:
    a sliding-window layer (Gemma 2/3, Mistral) shorter than it would need its window rolled, which the
    compiled and native steps do not do (the cache writes past the window's end)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(cfg, "sliding_window", None)
    if not window or total_tokens <= window:
        return None
    types = getattr(cfg, "layer_types", None)
    sliding = "sliding_attention" in types if types is not None else getattr(cfg, "use_sliding_window", True)
    if not sliding:
        return None
    return (f"its sliding-window attention (window {window}) is shorter than prompt + new tokens ({total_tokens}), "
            "and the static cache's steps do not roll a window")


class CompiledGenerator:
    """Generation for `model` (a transformers causal LM, batch >= 1) with a StaticCache of
    `max_cache_len` positions: greedy, or sampled (generate(do_sample=True, ...)). compile=False runs
    the same loop eagerly (the baseline of `bench e2e`).

    The decode step is compiled with static shapes (batch and cache length fixed), the prefill with a
    dynamic sequence length so prompts of any length share one graph. The first call of each pays the
    compilation (tens of seconds on a small CPU); later calls reuse it. Greedy calls run graphs with
    the argmax inside; the first sampled call compiles a second pair that returns the last position's
    logits (the draw runs eagerly after it), so sampling never slows or recompiles the greedy graphs.

    attn_implementation: the transformers attention used while generating (the model's own setting
    is restored after each call; None keeps it). Default "torch_lowbit": at decode grouped-query
    attention as one op (gqa_attention), at prefill transformers' eager attention, which inductor
    fuses; on CPU both beat the sdpa kernel (SmolLM2, docs/generation.md).

    kv_bits (4 or 8): keep the cache in a QuantizedKVCache instead (kv_group channels per scale,
    the last kv_residual tokens also exact, keys Hadamard-rotated; torch_lowbit/kv_cache.py).
    Default: the model's recorded setting (QuaRot(kv=...) or a loaded checkpoint), else float.

    cuda_graphs: replay the compiled decode step from a CUDA graph (inductor's
    mode="reduce-overhead"; the static cache's buffers keep their addresses, the quantized ops'
    Triton launches are captured inside), so a decode step costs one graph launch of host time
    instead of hundreds of kernel launches and custom-op dispatches. Default: on when compiling a
    model whose parameters are on CUDA. Each step's token is copied out of the graph's output buffer,
    which the next replay overwrites.

    native: run prefill and decode with the native decoder (torch_lowbit/native_decode.py: the whole
    forward step in C++ over the quantized buffers, no compiled graph to build or load) where the model
    allows it: a Llama-family model on the CPU whose projections are lut_i8 QuantLinears or float32
    nn.Linear, a float cache, and logits that match the model's own forward on a probe. Default (None):
    on when compiling on the CPU, else off; a model it cannot run then uses the compiled steps, with
    one log line saying why (`native_reason`). True: required (ValueError naming why not); False: off.

    compile_cache: save the compiled steps to a per-user cache and load them in later processes with
    the same model structure and shapes (a warm start skips compilation; torch_lowbit/compile_cache.py).
    Default on when compiling without CUDA graphs, unless $TORCH_LOWBIT_COMPILE_CACHE is "0";
    compile_cache_dir: its folder (default <$TORCH_LOWBIT_CACHE or ~/.cache/torch_lowbit>/compiled).
    """

    def __init__(self, model: nn.Module, *, max_cache_len: int = 1024, compile: bool = True,
                 attn_implementation: Optional[str] = ATTENTION, kv_bits: Optional[int] = None, kv_group: int = 64,
                 kv_residual: int = 128, cuda_graphs: Optional[bool] = None, compile_cache: Optional[bool] = None,
                 compile_cache_dir: Optional[str] = None, native: Optional[bool] = None):
        from transformers import StaticCache
        if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
            raise TypeError(f"CompiledGenerator needs a transformers causal LM, got {type(model).__name__}")
        if max_cache_len <= 1:
            raise ValueError(f"max_cache_len must be > 1, got {max_cache_len}")
        self.model = model.eval()
        self.max_cache_len = int(max_cache_len)
        self.compiled = bool(compile)
        self.attn_implementation = attn_implementation
        if attn_implementation == ATTENTION:
            _register_attention()
        from .quarot import kv_cache_config
        kv = {"bits": kv_bits, "group": kv_group, "residual_length": kv_residual} if kv_bits is not None \
            else kv_cache_config(model)
        if kv is None:
            self._static_cache = StaticCache
        else:
            from .kv_cache import QuantizedKVCache
            self._static_cache = partial(QuantizedKVCache, bits=kv["bits"], group=kv["group"],
                                         residual_length=kv["residual_length"], rotate_keys=kv.get("rotate_keys", True))
            self._static_cache(config=model.config, max_cache_len=self.max_cache_len)  # errors now, not mid-generate
        self._cache = None
        self._cache_batch = None
        self.times = GenerationTimes()
        if cuda_graphs is None:
            cuda_graphs = compile and _device_of(model).type == "cuda"
        if cuda_graphs and not compile:
            raise ValueError("cuda_graphs=True replays the compiled decode step: it needs compile=True")
        self.cuda_graphs = bool(cuda_graphs)
        if compile_cache is None:
            compile_cache = compile and not cuda_graphs and os.environ.get("TORCH_LOWBIT_COMPILE_CACHE") != "0"
        if compile_cache and not (compile and not cuda_graphs):
            raise ValueError("compile_cache=True saves compiled steps: it needs compile=True and cuda_graphs=False")
        # one function per phase and output, one dynamo cache (or cache file) each: the prefill graph
        # (dynamic length) never evicts the decode one, and the sampling graphs (last-position logits out;
        # compiled on the first sampled call only) leave the greedy ones (argmax inside the graph) as they are
        steps = {"prefill": greedy_step, "decode": greedy_step, "prefill_logits": last_logits, "decode_logits": last_logits}
        self.compiled_steps = {}  # kind -> CachedCompile, where the compile cache is on
        if compile_cache:
            from .compile_cache import CachedCompile
            self.compiled_steps = {kind: CachedCompile(fn, name=kind, dynamic=kind.startswith("prefill"),
                                                       directory=compile_cache_dir) for kind, fn in steps.items()}
            compiled = {kind: partial(step, self.model) for kind, step in self.compiled_steps.items()}
        else:
            compiled = {kind: self._compiled(partial(fn, self.model), decode=kind.startswith("decode"))
                        for kind, fn in steps.items()}
        self._prefill, self._decode = compiled["prefill"], compiled["decode"]
        self._native_required = native is True
        self.native = native if native is not None else (compile and not cuda_graphs and kv is None)
        if self.native and (cuda_graphs or kv is not None):
            raise ValueError("native=True runs its own steps on a float cache: it excludes cuda_graphs and kv_bits")
        self._native = None  # the NativeDecoder, built on the first call
        self.native_reason: Optional[str] = None  # why the native decoder is not used, once decided
        self._prefill_logits, self._decode_logits = compiled["prefill_logits"], compiled["decode_logits"]

    def _native_decoder(self, device: torch.device):
        """The NativeDecoder where it runs this model (built and probed on the first call), else None."""
        if not self.native or self.native_reason is not None:
            return self._native
        if self._native is None:
            from .native_decode import native_decoder
            self._native, self.native_reason = native_decoder(self.model, self.max_cache_len) \
                if device.type == "cpu" else (None, "the model is not on the CPU")
            if self._native is None:
                if self._native_required:
                    raise ValueError(f"native=True, but the native decoder cannot run this model: {self.native_reason}")
                log.warning("torch_lowbit: native decoder off (%s); using the compiled steps", self.native_reason)
        return self._native

    def _compiled(self, step, *, decode: bool):
        if not self.compiled:
            return step
        if not decode:
            return torch.compile(step, fullgraph=True, dynamic=True)
        return torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead" if self.cuda_graphs else None)

    def _decode_once(self, decode, input_ids: Tensor, cache_position: Tensor, cache) -> Tensor:
        """One decode step of `decode` (self._decode or self._decode_logits); from a CUDA graph, its
        output copied out of the graph's buffer (the next replay overwrites it), each replay marked as a
        new step."""
        if not self.cuda_graphs:
            return decode(input_ids, cache_position, cache)
        torch.compiler.cudagraph_mark_step_begin()
        return decode(input_ids, cache_position, cache).clone()


    def _fresh_cache(self, batch: int, device):
        if self._cache is None or self._cache_batch != batch:
            cfg = self.model.config.get_text_config()
            heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            emb = self.model.get_input_embeddings()  # a QuantEmbedding has no weight, an out_dtype
            dtype = getattr(emb, "out_dtype", None) or getattr(getattr(emb, "weight", None), "dtype", torch.float32)
            self._cache = self._static_cache(config=self.model.config, max_cache_len=self.max_cache_len)
            # allocated now, not lazily in the first (compiled) update: a graph traced on an empty
            # cache would be recompiled for the filled one
            self._cache.early_initialization(batch, heads, head_dim, dtype, device)
            self._cache_batch = batch
        else:
            self._cache.reset()  # reuse the buffers (and the compiled graphs that captured them)
        if self._native is not None:
            self._native.bind(self._cache)
        return self._cache

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, *, eos_token_id: Union[int, Sequence[int], None] = None,
                 pad_token_id: Optional[int] = None, do_sample: bool = False, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, seed: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, streamer=None) -> Tensor:
        """[batch, prompt + new] token ids. Greedy unless do_sample: then each token is drawn from the
        last position's logits after temperature, top_k (0: off) and top_p (1: off), transformers'
        warpers and defaults (1.0, 50, 1.0); seed or generator makes the draws reproducible (default:
        torch's global generator). Stops early only when every row produced an eos id (one or a list);
        with pad_token_id, a finished row gets that id from then on (transformers' rule).
        streamer: an object with put(tensor) and end() (transformers' TextStreamer and the like): put
        the prompt ([batch, prompt]), then each new token ([batch]), then end()."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError("input_ids must be a [batch, seq] LongTensor (tokenizer(..., return_tensors='pt').input_ids)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        n = input_ids.shape[1]
        if n + max_new_tokens > self.max_cache_len:
            raise ValueError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceed max_cache_len "
                             f"({self.max_cache_len}); build the CompiledGenerator with a larger max_cache_len")
        window = sliding_window_problem(self.model.config, n + max_new_tokens)
        if window is not None:
            raise ValueError(f"CompiledGenerator: {window}; generate with model.generate (or tl.generate, which "
                             "falls back to it) or keep prompt + new tokens within the window")
        if streamer is not None and not (callable(getattr(streamer, "put", None))
                                         and callable(getattr(streamer, "end", None))):
            raise ValueError(f"streamer must have put(tensor) and end() (transformers' TextStreamer, "
                             f"TextIteratorStreamer), got {type(streamer).__name__}")
        if do_sample:
            sampler = Sampler.build(input_ids.device, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                    generator=generator)
        else:
            given = [k for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                                    ("generator", generator)) if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to sampling: pass do_sample=True as well")
            sampler = None
        stop_ids = None if eos_token_id is None else torch.tensor(
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=input_ids.device)
        self._native_decoder(input_ids.device)
        with _attention(self.model, self.attn_implementation):
            cache = self._fresh_cache(input_ids.shape[0], input_ids.device)
            with _bind_kv_layers(self.model, cache, self.attn_implementation == ATTENTION):
                if streamer is not None:
                    streamer.put(input_ids.cpu())
                out = self._generate(input_ids, max_new_tokens, stop_ids, pad_token_id, sampler, streamer)
                if streamer is not None:
                    streamer.end()
                return out

    def _generate(self, input_ids: Tensor, max_new_tokens: int, stop_ids: Optional[Tensor], pad_token_id: Optional[int],
                  sampler: Optional[Sampler], streamer) -> Tensor:
        n = input_ids.shape[1]
        device = input_ids.device
        cache = self._cache
        # greedy: the argmax inside the graph; sampling: the graph returns the logits, the sampler picks
        prefill, decode = (self._prefill, self._decode) if sampler is None else (self._prefill_logits, self._decode_logits)
        pick = sampler or (lambda token: token)
        native = self._native
        if native is not None:  # one C++ call per step, logits out: greedy picks the argmax here
            prefill = decode = lambda ids, position, _cache: native(ids, int(position[0]))
            pick = sampler or (lambda logits: logits.argmax(-1, keepdim=True))
        times = GenerationTimes(prompt_tokens=n * input_ids.shape[0], new_tokens=max_new_tokens)
        t0 = time.perf_counter()
        # a one-token prompt is a decode step (dynamic shapes specialize sizes 0 and 1: no own graph)
        if n == 1:
            with _decode_threads(device):
                token = pick(self._decode_once(decode, input_ids, torch.arange(n, device=device), cache))
        else:
            token = pick(prefill(input_ids, torch.arange(n, device=device), cache))
        _wait_for(device)
        times.prefill_s = time.perf_counter() - t0
        tokens = [token]
        if streamer is not None:
            streamer.put(token[:, 0].cpu())
        done = torch.isin(token, stop_ids) if stop_ids is not None else None
        t_decode = time.perf_counter()
        with _decode_threads(device):
            for i in range(max_new_tokens - 1):
                if done is not None and bool(done.all()):
                    break
                t = time.perf_counter()
                # after the first step has passed every guard, nothing they check can change until this
                # loop ends (same model, cache, shapes): skip their evaluation (ms per token on small models)
                with _skip_guards(self.compiled and native is None and i > 0):
                    token = pick(self._decode_once(decode, token, torch.tensor([n + i], device=device), cache))
                if done is not None and pad_token_id is not None:
                    token = torch.where(done, pad_token_id, token)  # a finished row: padding from now on
                tokens.append(token)
                times.per_token_s.append(time.perf_counter() - t)
                if streamer is not None:
                    streamer.put(token[:, 0].cpu())
                if done is not None:
                    done |= torch.isin(token, stop_ids)
        _wait_for(device)
        times.decode_s = time.perf_counter() - t_decode
        times.new_tokens = len(tokens)
        self.times = times
        return torch.cat([input_ids, *tokens], dim=1)
