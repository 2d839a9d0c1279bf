"""A format's relative error and its cached Gaussian distortion (torch_lowbit/formats/distortion.py)."""
import json

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.formats import distortion


def _seed():
    return torch.randint(0, 2**31, ()).item()


def test_relative_error_is_the_normalized_squared_error():
    gen = torch.Generator().manual_seed(_seed())
    w = torch.randn(37, 96, generator=gen) * torch.rand(37, 1, generator=gen).add(0.1)
    fmt = tl.get_format("q4_0")
    expect = float(((fmt.dequantize(fmt.quantize(w)) - w) ** 2).sum() / (w ** 2).sum())
    assert distortion.relative_error(fmt, w) == pytest.approx(expect, rel=1e-6)
    assert distortion.relative_error(fmt, w * 1000) == pytest.approx(expect, rel=1e-3)  # scale-free
    with pytest.raises(ValueError, match="all zeros"):
        distortion.relative_error(fmt, torch.zeros(4, 32))


def test_gaussian_distortion_respects_the_rate_distortion_bound_and_falls_with_bits(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path))
    monkeypatch.setattr(distortion, "_memo", {})
    shape = (32, 1024)
    values = {}
    for name in ("nuq2", "nuq3", "vq2", "tcq2_1mad", "tcq3_1mad"):
        fmt = tl.get_format(name)
        values[name] = distortion.gaussian_distortion(fmt, shape)
        bound = 2.0 ** (-2 * fmt.bits_per_weight())  # Shannon's D(R) of a unit Gaussian
        assert bound < values[name] < 2.5 * bound, name
    assert values["nuq3"] < values["nuq2"] and values["tcq3_1mad"] < values["tcq2_1mad"] < values["vq2"]


def test_gaussian_distortion_is_cached_on_disk_and_survives_a_corrupt_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path))
    monkeypatch.setattr(distortion, "_memo", {})
    fmt, shape = tl.get_format("nuq2"), (16, 512)
    first = distortion.gaussian_distortion(fmt, shape)
    table = json.loads((tmp_path / "gaussian_distortion.json").read_text())
    assert list(table.values()) == [first]
    monkeypatch.setattr(distortion, "_memo", {})

    def no_quantizing(*a, **k):
        raise AssertionError("read from the cache, not measured again")
    monkeypatch.setattr(distortion, "relative_error", no_quantizing)
    assert distortion.gaussian_distortion(fmt, shape) == first
    (tmp_path / "gaussian_distortion.json").write_text("{not json")
    monkeypatch.setattr(distortion, "_memo", {})
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path))
    monkeypatch.setattr(distortion, "_memo", {})
    assert distortion.gaussian_distortion(fmt, shape) == pytest.approx(first, rel=1e-6)  # re-measured, same seed


def test_gaussian_distortion_names_a_shape_the_format_cannot_hold(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="cannot hold a 8x48 matrix"):
        distortion.gaussian_distortion(tl.get_format("q4_k"), (8, 48))
