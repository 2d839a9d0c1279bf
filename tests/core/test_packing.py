"""core/packing.py's row streams: chunked over rows for big layers, the same words as in one piece."""
import pytest
import torch

from torch_lowbit.core import packing


def test_streams_pack_in_row_chunks_to_the_same_words(monkeypatch):
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    for bits in (2, 3, 5, 6):
        codes = torch.randint(0, 2 ** bits, (37, 96 + 32 * bits), generator=gen)
        whole = packing.pack_stream(codes, bits)
        monkeypatch.setattr(packing, "_BIT_CHUNK", 3 * codes.shape[1] * bits)  # 3 rows at a time, a ragged last
        chunked = packing.pack_stream(codes, bits)
        assert torch.equal(chunked, whole)
        assert torch.equal(packing.unpack_stream(chunked, bits, codes.shape[1]), codes)
        monkeypatch.undo()


@pytest.mark.parametrize("bits", range(1, 17))
def test_bitfields_round_trip_lsb_first(bits):
    from torch_lowbit.core.packing import bitfield_bytes, pack_bitfields, unpack_bitfields
    codes = torch.randint(0, 2 ** bits, (5, 37))
    packed = pack_bitfields(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, bitfield_bytes(37, bits))
    assert torch.equal(unpack_bitfields(packed, bits, 37), codes)
    # code 0 of row 0 sits in the lowest bits of byte 0
    assert int(packed[0, 0]) & ((1 << min(bits, 8)) - 1) == int(codes[0, 0]) & ((1 << min(bits, 8)) - 1)
