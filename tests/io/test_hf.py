"""The Hugging Face route: LowbitConfig / the "torch_lowbit" quantizer in from_pretrained (quantize
while loading), save_pretrained folders and their loading, load_quantized_model.

The reference everywhere is the in-memory route: a float model loaded from the same folder and
torch_lowbit.quantize_ with the same arguments; results must be equal, not close."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from transformers import AutoModelForCausalLM

import torch_lowbit as tl
from torch_lowbit.hf import HF_FORMAT_VERSION, LowbitConfig, load_quantized_model, save_pretrained

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def float_dir(tmp_path):
    """A random tiny Llama saved as a normal fp32 HF folder (fresh weights per test: the test seed)."""
    path = tmp_path / "float"
    tiny_llama().save_pretrained(path)
    return path


def _float(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _quant_modules(model) -> dict:
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, tl.QuantLinear)}


def _assert_same_quantized(a, b, ids):
    qa, qb = _quant_modules(a), _quant_modules(b)
    assert qa and list(qa) == list(qb)
    for fqn in qa:
        assert (qa[fqn].fmt, qa[fqn].layout, qa[fqn].split_sizes) == (qb[fqn].fmt, qb[fqn].layout, qb[fqn].split_sizes)
        assert torch.equal(qa[fqn].dequantize(), qb[fqn].dequantize()), fqn
        for name, t in qa[fqn].packed.items():
            assert torch.equal(t, qb[fqn].packed[name]), f"{fqn}.{name}"
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)  # the CPU kernels are deterministic: bitwise


def _ids(vocab=256):
    return torch.randint(0, vocab, (2, 11))


@pytest.mark.parametrize("fmt,fuse", [("q4_0", True), ("q4_0", False), ("nuq3", True)])
def test_quantize_on_load_equals_quantize_(float_dir, fmt, fuse):
    ref = tl.quantize_(_float(float_dir), fmt, fuse=fuse, progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32,
                                                  quantization_config=LowbitConfig(fmt, fuse=fuse))
    assert not any(isinstance(m, torch.nn.Linear) and m is not loaded.lm_head for m in loaded.modules())
    assert isinstance(loaded.lm_head, torch.nn.Linear)  # the LM head stays float by default, as in quantize_
    assert hasattr(loaded.model.layers[0].self_attn, "qkv_proj") == fuse
    _assert_same_quantized(ref, loaded, _ids())


def test_quantize_on_load_options_equal_quantize_(float_dir):
    # a per-layer plan, a layout, modules_to_not_convert, include_lm_head: the same choices as quantize_
    names = [f for f, m in _float(float_dir).named_modules() if isinstance(m, torch.nn.Linear)]
    plan = {f: ("int3_g32" if "mlp" in f else "q4_0") for f in names if "layers.1.self_attn.o_proj" not in f}
    ref = tl.quantize_(_float(float_dir), plan, progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32,
                                                  quantization_config=LowbitConfig(plan))
    _assert_same_quantized(ref, loaded, _ids())
    assert "model.layers.1.self_attn.o_proj" not in _quant_modules(loaded)

    skip = ["model.layers.0.mlp", "model.layers.1.self_attn.q_proj"]
    ref = tl.quantize_(_float(float_dir), "q4_0", include_lm_head=True, layout="lut4_rowmajor", progress=False,
                       filter_fn=lambda m, f: isinstance(m, torch.nn.Linear) and not any(f.startswith(s) for s in skip))
    cfg = LowbitConfig("q4_0", include_lm_head=True, modules_to_not_convert=skip, layout="lut4_rowmajor")
    loaded = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32, quantization_config=cfg)
    _assert_same_quantized(ref, loaded, _ids())
    assert isinstance(loaded.lm_head, tl.QuantLinear) and isinstance(loaded.model.layers[0].mlp.up_proj, torch.nn.Linear)
    assert not hasattr(loaded.model.layers[1].self_attn, "qkv_proj")  # a group with a float member is not fused
    assert {m.layout.name for m in _quant_modules(loaded).values()} == {"lut4_rowmajor"}


def test_tied_lm_head_quantized_and_round_trips(tmp_path):
    # a tied head is not in the checkpoint: it is quantized after transformers ties it; the embedding stays float
    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path / "float")
    ref = tl.quantize_(_float(tmp_path / "float"), "q4_0", include_lm_head=True, progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32,
                                                  quantization_config=LowbitConfig("q4_0", include_lm_head=True))
    ids = _ids()
    _assert_same_quantized(ref, loaded, ids)
    loaded.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    _assert_same_quantized(loaded, again, ids)
    assert torch.equal(again.model.embed_tokens.weight, ref.model.embed_tokens.weight)


def test_save_load_round_trip_sharded(float_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32,
                                                 quantization_config=LowbitConfig("q4_0"))
    out = tmp_path / "q"
    model.save_pretrained(out, max_shard_size="60KB")
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl"))]  # no pickle anywhere
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "torch_lowbit" and saved["format_version"] == HF_FORMAT_VERSION
    assert saved["torch_lowbit_version"] == tl.__version__
    entry = saved["modules"]["model.layers.0.self_attn.qkv_proj"]
    assert entry["fused_from"] == ["q_proj", "k_proj", "v_proj"] and entry["format"]["kind"] == "q4_0"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.self_attn.qkv_proj.qweight" in index or any(".qkv_proj." in k for k in index)
    assert not any(k.endswith("q_proj.weight") for k in index)  # packed buffers, no float weights

    loaded = AutoModelForCausalLM.from_pretrained(out)
    _assert_same_quantized(model, loaded, _ids())
    for m in _quant_modules(loaded).values():  # rebuilt, not re-quantized: its runtime tables are real
        assert all(getattr(m, n).device.type == "cpu" for n in m._kernel_buffer_names)
    ids = torch.randint(0, 256, (1, 5))
    out_a = model.generate(ids, max_new_tokens=6, do_sample=False)
    out_b = loaded.generate(ids, max_new_tokens=6, do_sample=False)
    assert out_b.shape == (1, 11) and torch.equal(out_a, out_b)

    # a loaded folder saves again to the same thing
    loaded.save_pretrained(tmp_path / "q2")
    assert json.loads((tmp_path / "q2" / "config.json").read_text())["quantization_config"]["modules"] == saved["modules"]


def test_save_pretrained_of_a_quantize_model(float_dir, tmp_path):
    # calibrated roundings run in memory (quantize_), then save as an HF folder
    model = _float(float_dir)
    calibration = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    tl.quantize_(model, "int4_g32", calibration=calibration, rounding="gptq", progress=False)
    save_pretrained(model, tmp_path / "q", rounding="gptq")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["rounding"] == "gptq" and tl.format_from_json(cfg["format"]) == tl.get_format("int4_g32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    _assert_same_quantized(model, loaded, _ids())


def test_config_json_round_trip():
    plan = {"model.layers.0.mlp.up_proj": "int3_g32", "model.layers.0.self_attn.q_proj": tl.get_format("q4_0")}
    for cfg in (LowbitConfig(), LowbitConfig(tl.get_format("nuq3"), fuse=False, layout="palette_dense"),
                LowbitConfig(plan, modules_to_not_convert=["model.layers.1"], include_lm_head=True)):
        text = json.dumps(cfg.to_dict())
        back = LowbitConfig.from_dict(json.loads(text))
        assert back == cfg and back.to_dict() == cfg.to_dict()
        assert back.format == cfg.format
    assert LowbitConfig.from_dict(json.loads(json.dumps(LowbitConfig(plan).to_dict()))).format == \
        {k: tl.get_format(v) for k, v in plan.items()}


def test_bad_configs_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="quantize_.*calibration"):
        LowbitConfig("q4_0", rounding="gptq")
    with pytest.raises(ValueError, match="allocate_formats"):
        LowbitConfig(tl.MixedBits(["int2_g32", "q4_0"], 3.0))
    with pytest.raises(ValueError, match="unknown format 'q9_9'"):
        LowbitConfig("q9_9")
    with pytest.raises(ValueError, match="unknown layout"):
        LowbitConfig("q4_0", layout="no_such_layout")
    with pytest.raises(TypeError, match="modules_to_not_convert"):
        LowbitConfig("q4_0", modules_to_not_convert="lm_head")
    with pytest.raises(TypeError, match="unknown argument"):
        LowbitConfig("q4_0", group_size=64)


def test_from_pretrained_rejects_bad_loading_requests(float_dir):
    with pytest.raises(ValueError, match="offloaded to disk"):
        AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=LowbitConfig("q4_0"),
                                             device_map={"": "disk"}, offload_folder=str(float_dir))
    described = LowbitConfig("q4_0", modules={"model.layers.0.mlp.up_proj": {}})
    with pytest.raises(ValueError, match="already quantized model"):
        AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=described)
    with pytest.raises(ValueError, match="selects no Linear layer"):
        AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=LowbitConfig(
            "q4_0", modules_to_not_convert=["model"]))
    with pytest.raises(ValueError, match="the format plan lists 'model.layers.0.mlp'.*nn.Linear"):
        AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=LowbitConfig({"model.layers.0.mlp": "q4_0"}))


def _edit_saved_config(folder, edit):
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg["quantization_config"])
    path.write_text(json.dumps(cfg))


def test_bad_saved_folders_are_rejected(float_dir, tmp_path):
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=LowbitConfig("q4_0")).save_pretrained(
        tmp_path / "q")
    first = "model.layers.0.mlp.down_proj"

    def unknown_kind(q):
        q["modules"][first]["format"]["kind"] = "q9_9"

    def other_version(q):
        q["format_version"] = HF_FORMAT_VERSION + 1
        q["torch_lowbit_version"] = "99.0"

    def other_layout_version(q):
        q["modules"][first]["layout_version"] += 1

    def no_modules(q):
        q["modules"] = None

    cases = [(unknown_kind, r"down_proj.*format kind 'q9_9'.*upgrade"),
             (other_version, r"torch_lowbit 99\.0.*version 2.*reads version 1"),
             (other_layout_version, r"down_proj uses layout .* re-quantize"),
             (no_modules, "without 'modules'")]
    for i, (edit, message) in enumerate(cases):
        folder = tmp_path / f"bad{i}"
        os.makedirs(folder)
        for f in os.listdir(tmp_path / "q"):
            (folder / f).write_bytes((tmp_path / "q" / f).read_bytes())
        _edit_saved_config(folder, edit)
        with pytest.raises(tl.CheckpointError, match=message):
            AutoModelForCausalLM.from_pretrained(folder)


def test_load_quantized_model_folder_and_single_file(float_dir, tmp_path):
    model = tl.quantize_(_float(float_dir), "q4_0", progress=False)
    save_pretrained(model, tmp_path / "q")
    from_folder, tok = load_quantized_model(tmp_path / "q")
    assert tok is None  # saved without a tokenizer
    ids = _ids()
    _assert_same_quantized(model, from_folder, ids)

    tl.save_quantized(model, tmp_path / "m.safetensors")
    from_file, _ = load_quantized_model(tmp_path / "m.safetensors", base_model=float_dir)
    _assert_same_quantized(model, from_file, ids)

    with pytest.raises(ValueError, match="base_model"):
        load_quantized_model(tmp_path / "m.safetensors")
    with pytest.raises(tl.CheckpointError, match="not a torch_lowbit model folder.*LowbitConfig"):
        load_quantized_model(float_dir)
    with pytest.raises(tl.CheckpointError, match="does not exist"):
        load_quantized_model(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no QuantLinear"):
        save_pretrained(_float(float_dir), tmp_path / "f")


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_import_torch_lowbit_without_transformers():
    r = _python("import sys; sys.modules['transformers'] = None\n"  # makes `import transformers` fail
                "import torch_lowbit as tl\n"
                "assert 'torch_lowbit.hf.config' not in sys.modules and tl.quantize_\n"
                "try:\n    from torch_lowbit.hf import LowbitConfig\nexcept ImportError: print('no transformers')\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "no transformers"


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: ~10 s
def test_plain_import_registers_the_method_when_transformers_loads(float_dir, tmp_path):
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=LowbitConfig("q4_0")).save_pretrained(
        tmp_path / "q")
    r = _python("import sys, torch_lowbit\n"
                "assert 'transformers.quantizers' not in sys.modules  # import torch_lowbit stays light\n"
                "from transformers import AutoModelForCausalLM\n"
                f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'q')!r})\n"
                "print(type(m.model.layers[0].mlp.down_proj).__name__)\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "QuantLinear"


@pytest.mark.slow
def test_smollm2_peak_memory_of_the_hf_routes():
    # each route in a fresh interpreter, ending with one forward (tools/hf_load_memory.py; numbers in docs/hf.md)
    from torch_lowbit.eval.assets import smollm2_dir
    from torch_lowbit.tools.hf_load_memory import run
    result = run(str(smollm2_dir()), "q4_0", routes=("baseline", "fp32", "fp32+quantize_", "quantize-on-load",
                                                     "load-folder"))
    peak = {r["route"]: r["peak_rss_mb"] for r in result["routes"]}
    quantized_mb = result["sizes"]["quantized_folder_mb"]
    assert peak["quantize-on-load"] < peak["fp32+quantize_"] - 0.5 * result["sizes"]["fp32_checkpoint_mb"], peak
    assert peak["load-folder"] < peak["fp32"], peak
    assert peak["load-folder"] <= 1.5 * quantized_mb + peak["baseline"], (peak, quantized_mb)


@pytest.mark.slow
def test_cli_and_lm_eval_load_a_saved_folder(tmp_path):
    # the one loader (load_quantized_model) behind `eval --checkpoint` and lm-eval's `lowbit` model
    from transformers import AutoTokenizer

    from torch_lowbit.eval.assets import smollm2_dir
    from torch_lowbit.eval.lm_eval_model import run_lm_eval
    src, out = str(smollm2_dir()), tmp_path / "q4_0"
    AutoModelForCausalLM.from_pretrained(src, quantization_config=LowbitConfig("q4_0")).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "eval", "--checkpoint", str(out), "--tokens", "1024"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 10 < float(r.stdout.strip().split()[-1]) < 40
    res = run_lm_eval(f"pretrained={out}", n_docs=8, limit=2)
    assert 1 < res["word_perplexity,none"] < 1e4


def test_quantize_streaming_rtn_equals_quantize_(tmp_path):
    from torch_lowbit.hf import quantize_streaming
    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path / "float", max_shard_size="100KB")  # sharded source
    ref = tl.quantize_(_float(tmp_path / "float"), "q4_0", include_lm_head=True, progress=False)
    quantize_streaming(tmp_path / "float", "q4_0", tmp_path / "q", include_lm_head=True, max_shard_size="60KB",
                       progress=False)
    assert len([f for f in os.listdir(tmp_path / "q") if f.endswith(".safetensors")]) > 1
    _assert_same_quantized(ref, AutoModelForCausalLM.from_pretrained(tmp_path / "q"), _ids())


def test_quantize_streaming_gptq_is_sequential_gptq(float_dir, tmp_path):
    # reference: quantize_(sequential=True) in memory, each stage's statistics from a model whose layers
    # and stages before it are already quantized (GPTQ's sequential mode; tests/nn/test_sequential_calibration.py
    # checks that against full forwards)
    from torch_lowbit.hf import quantize_streaming
    calibration = [torch.randint(0, 256, (2, 16)) for _ in range(3)]
    ref = tl.quantize_(_float(float_dir), "int4_g32", calibration=calibration, rounding="gptq", sequential=True,
                       progress=False)
    quantize_streaming(float_dir, "int4_g32", tmp_path / "q", rounding="gptq", calibration=calibration,
                       progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    _assert_same_quantized(ref, loaded, _ids())
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["rounding"] == "gptq"


def test_quantize_streaming_rejects_bad_input(float_dir, tmp_path):
    from torch_lowbit.hf import quantize_streaming
    with pytest.raises(ValueError, match="needs calibration"):
        quantize_streaming(float_dir, "q4_0", tmp_path / "q", rounding="gptq")
    with pytest.raises(ValueError, match="allocate_formats"):
        quantize_streaming(float_dir, tl.MixedBits(["q4_0", "int2_g32"], 3.0), tmp_path / "q")
    with pytest.raises(ValueError, match="outside the decoder blocks"):
        quantize_streaming(float_dir, "q4_0", tmp_path / "q", include_lm_head=True, rounding="imatrix",
                           calibration=[torch.randint(0, 256, (1, 8))])
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        quantize_streaming(tmp_path, "q4_0", tmp_path / "q")
    assert not (tmp_path / "q").exists()
