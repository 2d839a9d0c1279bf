"""`python -m torch_lowbit bench kv`: attention over a quantized KV cache vs the fp32 cache.

One decode step (one query row per head) attending to `tokens` cached positions, per attention
layer (`query_rows` > 1: a prefill block of that many causal rows at the end of the cache, against
torch's SDPA on the fp32 cache): torch_lowbit::gqa_attention on an fp32 cache (the CompiledGenerator's decode op), and
torch_lowbit::kv_attention reading a 4- or 8-bit QuantizedKVLayer in place (plus the reference route the
model uses today: dequantize the whole cache, then gqa_attention). Each contender cycles through
enough layers' caches to exceed `rotate_mib`, so caches come from DRAM as in a real model whose
layers' caches do not fit in L3. Medians of repeated calls.
"""
from __future__ import annotations

import statistics
import time

import torch

KV_BENCH_SHAPES = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}  # query heads, KV heads, head dim


def _median_us(fn, copies: int, min_time: float = 0.5) -> float:
    fn(0)
    times, i, t0 = [], 0, time.perf_counter()
    while i < 5 or time.perf_counter() - t0 < min_time:
        t = time.perf_counter()
        fn(i % copies)
        times.append(time.perf_counter() - t)
        i += 1
    return statistics.median(times) * 1e6


def _attend(device: str, query_rows: int = 1):
    """The baseline attention and its label: our decode op on CPU; at prefill (several query rows) and
    on CUDA, torch's fused SDPA (on CUDA over an fp16 cache: what a CUDA user runs today)."""
    if device == "cpu" and query_rows == 1:
        from ..ops.attention import gqa_attention
        return torch.float32, "fp32 cache, gqa_attention", gqa_attention
    import torch.nn.functional as F

    def sdpa(q, k, v, mask, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if device == "cpu":
        return torch.float32, "fp32 cache, SDPA", sdpa
    return torch.float16, "fp16 cache, SDPA", sdpa


def bench_kv(tokens: int = 4096, threads=(1, 2), bits=(4, 8), group: int = 64, rotate_mib: int = 256,
             shapes=tuple(KV_BENCH_SHAPES), device: str = "cpu", query_rows: int = 1,
             vq=("cq2", "cq4")) -> list[list]:
    """Rows per shape x threads x cache; on CUDA `threads` is ignored (one row set, threads "-"), the
    kv_attention op runs the Triton kernel, the baseline is SDPA on an fp16 cache, and each time cell
    reads "eager (graph device-time)" with the ratios taken from the graph times where captured. `vq`:
    CQ caches (formats/kv_vq.py, codebooks learned on the first layer's random keys and values: speed
    only) read by kv_vq_attention, on the CPU."""
    from ..kv_cache import QuantizedKVLayer
    if not 1 <= query_rows <= tokens:
        raise ValueError(f"bench_kv: query_rows must be 1..tokens ({tokens}), got {query_rows}")
    dtype, base_label, attend = _attend(device, query_rows)
    previous_threads = torch.get_num_threads()  # each row set runs at its --threads; restored at the end
    graph_us = None
    if device != "cpu":
        from .gpu import cuda_event_us, cuda_graph_us
        timer, threads, graph_us = cuda_event_us, ("-",), cuda_graph_us
    else:
        timer = _median_us

    def timed(fn, copies):
        """(µs cell, µs for the ratios): on CUDA eager and, where the calls can be captured, the device
        time from a CUDA-graph replay (which the ratios then use: eager calls there are host-bound)."""
        us = timer(fn, copies)
        graph = graph_us(fn, copies) if graph_us is not None else None
        return (f"{us:.0f} (graph {graph:.0f})", graph) if graph else (f"{us:.0f}", us)
    rows = []
    for shape in shapes:
        h, hkv, d = KV_BENCH_SHAPES[shape]
        base_bytes = 2 * hkv * tokens * d * torch.tensor([], dtype=dtype).element_size()
        copies = max(2, rotate_mib * 2**20 // base_bytes)
        gen = torch.Generator().manual_seed(0)
        caches = [tuple(torch.randn(1, hkv, tokens, d, generator=gen).to(device=device, dtype=dtype)
                        for _ in range(2)) for _ in range(copies)]
        q = torch.randn(1, h, query_rows, d, generator=gen).to(device=device, dtype=dtype)
        last = tokens - query_rows + torch.arange(query_rows)  # causal: row r sees positions <= last[r]
        mask = (torch.arange(tokens)[None, :] <= last[:, None]).expand(1, 1, query_rows, tokens).to(device)
        layers = {}
        for b in bits:
            layers[b] = []
            for k, v in caches:
                layer = QuantizedKVLayer(tokens, bits=b, group=min(group, d), residual_length=0)
                layer.update(k, v)
                layers[b].append(layer)
        vq_caches = {}
        if device == "cpu":
            from ..formats.kv_vq import learn_kv_codebooks, quantize_kv_vq
            for name in vq:
                kp, vp = (learn_kv_codebooks(x, name, iters=4) for x in caches[0])
                vq_caches[name] = (kp, vp, [(quantize_kv_vq(k, kp), quantize_kv_vq(v, vp)) for k, v in caches])
        for t in threads:
            if t != "-":
                torch.set_num_threads(t)
            base_cell, base = timed(lambda i: attend(q, *caches[i], mask, d ** -0.5), copies)
            rows.append([shape, tokens, t, base_label, f"{base_bytes / 2**20:.2f}", base_cell, "1.00x", "1.00x"])
            for b in bits:
                ls = layers[b]
                nbytes = ls[0].nbytes()
                fused_cell, fused = timed(lambda i: ls[i].attention(q, mask, d ** -0.5), copies)
                rows.append([shape, tokens, t, f"int{b} cache, kv_attention", f"{nbytes / 2**20:.2f}", fused_cell,
                             f"{base / fused:.2f}x", f"{nbytes / base_bytes:.2f}x"])
                ref_cell, ref = timed(lambda i: attend(
                    q, ls[i]._read(ls[i].key_store, True), ls[i]._read(ls[i].value_store, False), mask, d ** -0.5),
                    copies)
                rows.append([shape, tokens, t, f"int{b} cache, dequantize + {base_label.split(', ')[1]}",
                             f"{nbytes / 2**20:.2f}", ref_cell, f"{base / ref:.2f}x", f"{nbytes / base_bytes:.2f}x"])
            for name, (kp, vp, codes) in vq_caches.items():
                from ..ops.attention import kv_vq_attention
                nbytes = 2 * codes[0][0].numel() + 2 * kp.numel() * 2  # codes, and both layers' codebooks
                cell, us = timed(lambda i: kv_vq_attention(q, codes[i][0], kp, codes[i][1], vp, mask, d ** -0.5),
                                 copies)
                rows.append([shape, tokens, t, f"{name} cache, kv_vq_attention", f"{nbytes / 2**20:.2f}", cell,
                             f"{base / us:.2f}x", f"{nbytes / base_bytes:.2f}x"])
    torch.set_num_threads(previous_threads)
    return rows


KV_HEADERS = ["model shape", "cached tokens", "threads", "cache / op", "MiB per layer", "µs per layer",
              "speed vs baseline", "memory vs baseline"]
