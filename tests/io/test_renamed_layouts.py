"""Names stored in checkpoints and HF folders keep loading after a rename: files written by the code of
before the layout lowbit_rowmajor became stream_rowmajor (layouts/base.py RENAMED_LAYOUTS) load into the
new layout and give the logits they gave when written."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import torch_lowbit as tl
from torch_lowbit.layouts import get_layout
from torch_lowbit.layouts.base import RENAMED_LAYOUTS

pytest.importorskip("transformers")
DATA = Path(__file__).resolve().parent / "data" / "renamed_layouts"


def _skeleton():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig.from_pretrained(DATA / "config")).eval()


def _layouts(model) -> set[str]:
    return {m.layout.name for m in model.modules() if isinstance(m, tl.QuantLinear)}


def test_every_old_name_resolves_to_a_registered_layout():
    for old, new in RENAMED_LAYOUTS.items():
        assert get_layout(old) is get_layout(new)
        assert old not in tl.layouts.layouts()  # an old name is never registered again


def test_a_checkpoint_written_with_the_old_layout_name_loads():
    expected = load_file(DATA / "expected_logits.safetensors")
    model = tl.load_quantized(_skeleton(), DATA / "q8_0_lowbit_rowmajor.safetensors")
    assert _layouts(model) == {"stream_rowmajor"}
    with torch.no_grad():
        logits = model(expected["ids"]).logits
    torch.testing.assert_close(logits, expected["checkpoint_logits"], rtol=1e-5, atol=1e-5)


def test_a_hf_folder_written_with_the_old_layout_name_loads():
    from transformers import AutoModelForCausalLM
    expected = load_file(DATA / "expected_logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(DATA / "int2_g64_lowbit_rowmajor_hf").eval()
    assert _layouts(model) == {"stream_rowmajor"}
    with torch.no_grad():
        logits = model(expected["ids"]).logits
    torch.testing.assert_close(logits, expected["hf_logits"], rtol=1e-5, atol=1e-5)
