"""`bench latency` (torch_lowbit/bench/latency.py): a model's module shapes and the table, on a small
random Llama with the latency cache in a temporary folder."""
import pytest
import torch

from torch_lowbit.bench.latency import bench_latency, module_shapes
from torch_lowbit.nn import latency

from conftest import tiny_llama


def test_module_shapes_list_fused_groups_and_their_layers_once():
    shapes = module_shapes(tiny_llama())
    # v_proj is k_proj's shape, up_proj gate_proj's and o_proj q_proj's: each shape once
    assert shapes == [("q_proj+k_proj+v_proj", 256, 128), ("q_proj", 128, 128), ("k_proj", 64, 128),
                      ("gate_proj+up_proj", 384, 128), ("gate_proj", 192, 128), ("down_proj", 128, 192)]


def test_table_is_filled_from_measurements_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    header, rows = bench_latency(tiny_llama(), ["int4_g64", "q4_k"], ms=(1, 4), progress=lambda m: None)
    assert header[:3] == ["format", "bits/weight", "M"] and len(header) == 3 + 6
    assert [r[:3] for r in rows] == [["int4_g64", "4.5", "1"], ["int4_g64", "4.5", "4"], ["q4_k", "4.5", "1"],
                                     ["q4_k", "4.5", "4"]]
    assert all(float(c) > 0 for c in rows[0][3:])
    assert all(c == "-" for c in rows[2][3:])  # no K of 128 or 192 holds q4_k's 256-weight super-blocks
    cached = latency.cached_table()
    assert len(cached) == 2 * 6 and float(rows[1][3]) == pytest.approx(cached["int4_g64|256x128|M4"] * 1e6, abs=0.06)
