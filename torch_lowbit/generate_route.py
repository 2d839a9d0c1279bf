"""torch_lowbit.generate: one call that generates on the fast route (a CompiledGenerator cached on
the model: static KV cache, compiled steps, greedy or sampled) when that route can run the model and
the options, and otherwise on transformers' own `model.generate`, saying why in one log line.

    out = torch_lowbit.generate(model, input_ids, max_new_tokens=64)                   # greedy
    out = torch_lowbit.generate(model, input_ids, max_new_tokens=64, do_sample=True, temperature=0.7,
                                top_p=0.9, seed=0, streamer=TextStreamer(tok, skip_prompt=True))
    out = torch_lowbit.generate(model, input_ids, max_new_tokens=64, num_beams=4)     # model.generate

Options mean what they mean to `model.generate` (the model's generation_config, then transformers'
defaults, then the call's options), so both routes give the same tokens for the same options (greedy;
sampled calls draw from the same distribution, from different random streams).
"""
from __future__ import annotations

import inspect
import logging
import numbers
import time
from typing import Optional

import torch
from torch import Tensor, nn

from .generation import CompiledGenerator, GenerationTimes, _device_of, sliding_window_problem
from .sampling import check_sampling

logger = logging.getLogger("torch_lowbit")

DEFAULT_NEW_TOKENS = 20  # transformers' default when neither max_new_tokens nor max_length is set
MIN_CACHE_LEN = 1024  # a cached generator's static cache holds at least this many positions

# generation_config fields the fast route runs whatever their value (others must keep their defaults)
_RUNS = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "bos_token_id", "eos_token_id",
         "pad_token_id", "transformers_version", "_from_model_config", "compile_config", "disable_compile",
         "max_cache_len", "use_cache"}
_CACHES = (None, "static", "dynamic")  # cache_implementation values that do not change the tokens


class _GeneratorSlot:
    """The CompiledGenerators of one model (by compile flag and device) and the fallback reasons
    already logged for it; a copy or pickle of the model starts empty (no compiled graphs inside)."""

    def __init__(self):
        self.generators: dict = {}
        self.latest: Optional[CompiledGenerator] = None  # the one the latest fast-route call ran on
        self.architecture: dict = {}  # compile flag -> why the fast route cannot run the model (None: it can)
        self.logged: set = set()

    def __reduce__(self):
        return _GeneratorSlot, ()


def _slot(model: nn.Module) -> _GeneratorSlot:
    slot = model.__dict__.get("_lowbit_generators")
    if slot is None:
        slot = model.__dict__["_lowbit_generators"] = _GeneratorSlot()
    return slot


def _architecture_refusal(model: nn.Module, compile: bool) -> Optional[str]:
    """Why the fast route cannot run this model (None: it can), from what the model says of itself."""
    from transformers import PreTrainedModel, StaticCache
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        return f"{name} is not a transformers PreTrainedModel"
    if model.config.is_encoder_decoder:
        return f"{name} is an encoder-decoder model (the fast route runs decoder-only causal LMs)"
    if model.get_output_embeddings() is None:
        return f"{name} has no LM head (not a causal LM)"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return f"{name}.forward takes no logits_to_keep (not a transformers causal LM of the current API)"
    if getattr(model, "_is_stateful", False) or not model._supports_default_dynamic_cache():
        return f"{name} keeps its own state instead of a transformers Cache, so no StaticCache can hold it"
    if compile and not getattr(model, "_can_compile_fullgraph", False):
        return f"{name} cannot be compiled in one graph (its _can_compile_fullgraph is False); compile=False runs it"
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return f"{name} is spread over several devices (hf_device_map)"
    try:
        StaticCache(config=model.config, max_cache_len=8)
    except Exception as e:  # any failure means the same: this config has no static cache
        return f"transformers' StaticCache cannot hold {name}'s cache ({type(e).__name__}: {e})"
    return None


def _device_refusal(device: torch.device, input_device: torch.device, compile: bool) -> Optional[str]:
    if input_device != device:
        return f"input_ids are on {input_device}, the model on {device}"
    if compile and device.type not in ("cpu", "cuda"):
        return f"torch.compile (inductor) does not target {device.type}; compile=False runs the fast route eagerly"
    if compile and device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            return "compiling for CUDA needs triton, which is not installed"
    return None


def _option_refusal(config, model_kwargs: dict, defaults: dict) -> Optional[str]:
    """The first option the fast route lacks: a generation_config field off its default (num_beams=4,
    repetition_penalty=1.2, ... from the call or the model's generation_config) or a model input."""
    extra = sorted(k for k in model_kwargs if k != "attention_mask")
    if extra:
        return f"model input {extra[0]}= is not passed by the fast route"
    for key, value in sorted(config.to_dict().items()):
        if key in _RUNS or value == defaults.get(key) or (value in (None, False) and not defaults.get(key)):
            continue
        if key == "cache_implementation" and value in _CACHES:
            continue
        return f"the option {key}={value!r} is not run by the fast route"
    return None


def _resolved_max_new_tokens(model, config, options: dict, max_new_tokens: Optional[int], prompt_len: int) -> int:
    """As model.generate counts them: max_new_tokens, else max_length minus the prompt, else 20."""
    if max_new_tokens is None:
        max_new_tokens = config.max_new_tokens
    if max_new_tokens is None:
        if "max_length" in options or model.generation_config.max_length is not None:
            max_new_tokens = config.max_length - prompt_len
        else:
            max_new_tokens = DEFAULT_NEW_TOKENS
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}; max_length counts the prompt "
                         f"({prompt_len} tokens) too: pass max_new_tokens instead")
    return max_new_tokens


def _cached_generator(model: nn.Module, compile: bool, device: torch.device, needed: int) -> CompiledGenerator:
    """The model's generator for (compile, device), replaced by a larger one when a call needs more
    positions than its static cache holds (cache sizes: powers of two >= MIN_CACHE_LEN)."""
    generators = _slot(model).generators
    gen = generators.get((compile, device))
    if gen is None or gen.max_cache_len < needed:
        size = max(MIN_CACHE_LEN, 1 << (needed - 1).bit_length())
        attn = "torch_lowbit" if getattr(model, "_supports_attention_backend", False) else None
        gen = generators[(compile, device)] = CompiledGenerator(model, max_cache_len=size, compile=compile,
                                                                attn_implementation=attn)
    _slot(model).latest = gen
    return gen


def fast_route(model: nn.Module) -> Optional[str]:
    """How the model's latest fast-route call ran: "native" (the native decoder), "compiled" or "eager";
    None before any."""
    gen = _slot(model).latest
    if gen is None:
        return None
    return "native" if gen._native is not None else "compiled" if gen.compiled else "eager"


class _TimedStreamer:
    """Times model.generate through the streamer calls it makes (the prompt before the prefill, each
    token after its step), passing them on to the caller's streamer."""

    def __init__(self, inner, times: GenerationTimes):
        self.inner, self.times, self.calls = inner, times, 0

    def put(self, value: Tensor) -> None:
        now = time.perf_counter()
        if self.calls == 0:
            self.start = now
        elif self.calls == 1:
            self.times.prefill_s, self.decode_start = now - self.start, now
        else:
            self.times.decode_s = now - self.decode_start
        self.calls += 1
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def timed_transformers_generate(model, input_ids: Tensor, max_new_tokens: int, *, seed: Optional[int] = None,
                                generator: Optional[torch.Generator] = None, streamer=None, beams: int = 1,
                                **options) -> tuple[Tensor, GenerationTimes]:
    """(ids, times) of model.generate(input_ids, max_new_tokens=..., **options): timed through a
    streamer (not with beam search (beams > 1), which takes none: its times stay 0, their rates NaN);
    a seed (or one drawn from `generator`) seeds torch's global generator for this call only
    (model.generate draws from it)."""
    times = GenerationTimes(prompt_tokens=input_ids.numel())
    timed = _TimedStreamer(streamer, times) if streamer is not None or beams == 1 else None
    if generator is not None:
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator, device=generator.device))
    devices = [input_ids.device] if input_ids.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, streamer=timed, **options)
    times.new_tokens = out.shape[1] - input_ids.shape[1]
    return out, times


def generate(model: nn.Module, input_ids: Tensor, max_new_tokens: Optional[int] = None, *, compile: bool = True,
             streamer=None, seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
             return_times: bool = False, **options):
    """[batch, prompt + new] token ids of `model` (a transformers causal LM, quantized or not)
    continuing `input_ids`, as `model.generate(input_ids, max_new_tokens=..., **options)` gives them.

    The fast route: a CompiledGenerator cached on the model (created on the first call: with
    compile=True that call compiles, tens of seconds to minutes on a small CPU; later calls reuse its
    graphs; compile=False runs the same loop eagerly). It runs greedy and sampled decoding
    (do_sample, temperature, top_k, top_p), eos and pad ids, an all-ones attention_mask, a streamer
    (put/end, transformers' TextStreamer). Anything else — an architecture without a static cache, an
    option such as num_beams > 1 or repetition_penalty, a padded attention_mask, a device inductor
    cannot compile for — runs model.generate instead, with one log line (logger "torch_lowbit",
    WARNING, once per model and reason) naming why.

    seed or generator: reproducible sampling (on the fallback route: torch's global generator seeded
    for this call). return_times=True: (ids, GenerationTimes of this call) on either route.
    """
    from transformers import GenerationConfig
    check_sampling(seed=seed, generator=generator)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a [batch, seq] LongTensor (tokenizer(..., return_tensors='pt').input_ids)")
    if not callable(getattr(model, "generate", None)) or not hasattr(model, "generation_config"):
        raise TypeError(f"torch_lowbit.generate needs a transformers causal LM (with generate() and a "
                        f"generation_config), got {type(model).__name__}")
    # what model.generate would run: the model's generation_config, transformers' defaults, the options
    config, model_kwargs = model._prepare_generation_config(None, **options)
    defaults = GenerationConfig._get_default_generation_params()
    if config.do_sample:
        check_sampling(config.temperature, config.top_k, config.top_p)
    elif seed is not None or generator is not None:
        raise ValueError("seed and generator only apply to sampling: pass do_sample=True as well")
    max_new_tokens = _resolved_max_new_tokens(model, config, options, max_new_tokens, input_ids.shape[1])
    mask = model_kwargs.get("attention_mask")
    device = _device_of(model)
    known = _slot(model).architecture
    if compile not in known:  # what the model class says of itself does not change between calls
        known[compile] = _architecture_refusal(model, compile)
    reason = (known[compile] or _device_refusal(device, input_ids.device, compile)
              or _option_refusal(config, model_kwargs, defaults)
              or sliding_window_problem(model.config, input_ids.shape[1] + max_new_tokens)
              or ("attention_mask has zeros (padded rows); the fast route runs unpadded rows"
                  if mask is not None and not bool(mask.bool().all()) else None))
    if reason is not None:
        logged = _slot(model).logged
        if reason not in logged:
            logged.add(reason)
            logger.warning("torch_lowbit.generate: running model.generate instead of the fast route: %s", reason)
        fallback = {k: v for k, v in options.items() if k != "max_length"}  # max_new_tokens carries it
        out, times = timed_transformers_generate(model, input_ids, max_new_tokens, seed=seed, generator=generator,
                                                 streamer=streamer, beams=config.num_beams, **fallback)
        return (out, times) if return_times else out
    gen = _cached_generator(model, compile, device, input_ids.shape[1] + max_new_tokens)
    eos = config.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else (
        eos if isinstance(eos, int) or eos is None else list(eos)[0])  # transformers' rule
    sampling = dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, seed=seed,
                    generator=generator) if config.do_sample else {}
    out = gen.generate(input_ids, max_new_tokens, eos_token_id=eos, pad_token_id=pad, do_sample=bool(config.do_sample),
                       streamer=streamer, **sampling)
    return (out, gen.times) if return_times else out
