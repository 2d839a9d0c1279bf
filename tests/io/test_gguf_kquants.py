"""GGUF K-quant tensors <-> the K-quant formats (io/gguf_kquants.py), through a file written with gguf's
own GGUFWriter and read back with its GGUFReader, against gguf's dequantizer."""
import numpy as np
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.io.gguf_kquants import kquant_blocks, kquant_format, kquant_tensors

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
KQUANT_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def test_kquant_format_names_only_kquant_types():
    assert {t.name: kquant_format(t.name) for t in KQUANT_TYPES} == \
        {"Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
    assert kquant_format("Q4_0") is None and kquant_format("IQ4_XS") is None
    with pytest.raises(ValueError, match="not a K-quant type"):
        kquant_tensors(np.zeros((1, 18), np.uint8), "Q4_0")
    with pytest.raises(ValueError, match="not a K-quant"):
        kquant_blocks("q4_0", {"codes": torch.zeros(1, 32, dtype=torch.uint8)})


@pytest.mark.parametrize("qtype", KQUANT_TYPES, ids=lambda q: q.name)
def test_file_blocks_import_losslessly_and_export_byte_for_byte(tmp_path, qtype):
    """Our quantizer's blocks written to a GGUF file by gguf's writer: read back with gguf's reader they
    convert to the format's tensors (equal to ours), dequantize as gguf does, and encode to the file's bytes."""
    name = kquant_format(qtype.name)
    fmt = tl.get_format(name)
    gen = torch.Generator().manual_seed(9800 + KQUANT_TYPES.index(qtype))
    w = torch.randn(23, 256 * 3, generator=gen) * torch.rand(23, 1, generator=gen).add(0.2) * 0.03
    q = fmt.quantize(w)
    raw = kquant_blocks(fmt, q)
    assert raw.dtype == np.uint8 and raw.shape == (23, 3 * gguf.GGML_QUANT_SIZES[qtype][1])

    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    assert tensor.tensor_type == qtype
    from_file = np.asarray(tensor.data).reshape(23, -1)

    back = kquant_tensors(from_file, qtype.name)
    assert set(back) == set(q) and all(torch.equal(back[k], q[k]) for k in q)
    expected = torch.from_numpy(gguf.quants.dequantize(from_file, qtype)).reshape(23, -1)
    assert torch.equal(fmt.dequantize(back), expected)
    assert np.array_equal(kquant_blocks(name, back), from_file)
    layer = tl.QuantLinear.from_quantized(name, back, 23, 768)
    assert np.array_equal(layer.blocks.numpy(), from_file)  # the layout holds the file's bytes
