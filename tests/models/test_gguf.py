"""The GGUF loader: every tensor type decodes to the original weights within its precision, Q8_0 /
Q4_0 / Q4_1 become MLX quantized layers whose values are gguf's own dequantization bit for bit,
whole models compute what transformers' GGUF loading computes, and bad files fail naming the file
and the tensor or type."""

from __future__ import annotations

import json
import shutil

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from safetensors.numpy import load_file
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

from tests.fixtures.tiny_gguf import write_tiny_gguf
from vllm_metal.models.loaders import gguf as gguf_loader
from vllm_metal.models.loaders import safetensors

TOKENS = [5, 17, 301, 42, 9, 600, 128, 77]
# Relative RMS error of a decoded weight (std 0.3) against the float32 original, per type.
PRECISION = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 5e-3,
    "Q8_0": 0.01,
    "Q6_K": 0.03,
    "Q5_K": 0.06,
    "Q4_0": 0.12,
    "Q4_1": 0.12,
    "Q4_K": 0.12,
}


def _model_kwargs(arch: str) -> dict:
    # transformers' GGUF config keeps Qwen3Config's head_dim (128), so the tiny Qwen3 uses it too.
    return {"head_dim": 128} if arch == "qwen3" else {}


@pytest.fixture(scope="module")
def gguf_file(tiny_model_dir, tmp_path_factory):
    """Factory (arch, type, **write_tiny_gguf kwargs) -> path of the tiny checkpoint as GGUF."""
    root = tmp_path_factory.mktemp("gguf")
    built = {}

    def make(arch: str, type_name: str, **kwargs):
        key = (arch, type_name, json.dumps(kwargs, sort_keys=True))
        if key not in built:
            src = tiny_model_dir(arch, **_model_kwargs(arch))
            out = root / f"{arch}-{type_name}-{len(built)}.gguf"
            built[key] = write_tiny_gguf(src, out, type_name, **kwargs)
        return built[key]

    return make


def _dense_weights(model) -> dict[str, np.ndarray]:
    """Every weight of the model as float32, quantized layers dequantized by MLX."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            out[f"{path}.weight"] = np.array(
                mx.dequantize(
                    module.weight,
                    module.scales,
                    module.biases,
                    group_size=module.group_size,
                    bits=module.bits,
                )
            )
    for name, value in tree_flatten(model.parameters()):
        if not name.endswith((".scales", ".biases")) and name not in out:
            out[name] = np.array(value.astype(mx.float32))
    return out


@pytest.mark.parametrize("type_name", list(PRECISION))
def test_each_type_decodes_to_the_original_weights(tiny_model_dir, gguf_file, type_name):
    """Llama, whose q/k rows llama.cpp permutes: every weight lands where it came from."""
    original = load_file(tiny_model_dir("llama") / "model.safetensors")
    model, _ = gguf_loader.load(gguf_file("llama", type_name), mx.float32)
    loaded = _dense_weights(model)
    assert loaded.keys() == original.keys()
    for name, want in original.items():
        got = loaded[name]
        assert got.shape == want.shape, name
        err = np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want**2))
        bound = PRECISION[type_name] if want.ndim == 2 else 0.0  # 1-D tensors stay F32
        assert err <= bound, (name, type_name, err)


@pytest.mark.parametrize("type_name,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_exact_types_are_mlx_quantized_bit_exact(gguf_file, type_name, bits):
    path = gguf_file("llama", type_name)
    model, config = gguf_loader.load(path, mx.float32)
    modules = dict(model.named_modules())
    reader = gguf.GGUFReader(path)
    processor = TENSOR_PROCESSORS["llama"](config=config)
    checked = 0
    for tensor in reader.tensors:
        if tensor.tensor_type.name != type_name:
            continue
        module_path = _param_of(tensor.name).rsplit(".", 1)[0]
        module = modules[module_path]
        assert isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)), module_path
        assert (module.group_size, module.bits, module.mode) == (32, bits, "affine")
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        want = processor.process(weights=want, name=tensor.name).weights  # rotary row order
        got = mx.dequantize(module.weight, module.scales, module.biases, group_size=32, bits=bits)
        assert np.array_equal(np.array(got), want), tensor.name
        checked += 1
    assert checked == 16  # 7 projections x 2 layers, the embedding and the head


def _param_of(gguf_name: str) -> str:
    names = {
        "token_embd": "model.embed_tokens",
        "output": "lm_head",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return f"{names[parts[0]]}.{parts[1]}"


def test_exact_scales_stay_float16_in_float16(gguf_file):
    """In float16 the scales and biases are the file's fp16 numbers themselves."""
    path = gguf_file("llama", "Q4_0")
    model, _ = gguf_loader.load(path, mx.float16)
    reader = gguf.GGUFReader(path)
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight").data
    d = np.ascontiguousarray(raw.reshape(raw.shape[0], -1, 18)[..., :2]).view(np.float16)[..., 0]
    layer = model.model.layers[0].mlp.up_proj
    assert layer.scales.dtype == mx.float16
    assert np.array_equal(np.array(layer.scales), d)
    assert np.array_equal(np.array(layer.biases), -8 * d)


def _hf_gguf_logits(path) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].numpy()


@pytest.mark.parametrize(
    "arch,type_name",
    [("llama", "Q4_0"), ("qwen2", "Q8_0"), ("qwen3", "Q6_K"), ("mistral", "Q4_1"),
     ("qwen2", "Q4_K"), ("qwen3", "BF16"), ("llama", "Q5_K")],
)  # fmt: skip
def test_logits_match_transformers_gguf_loading(gguf_file, arch, type_name):
    """The config from the file's metadata and the weights from its tensors: the same float32
    logits as `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`."""
    path = gguf_file(arch, type_name)
    model, config = gguf_loader.load(path, mx.float32)
    assert config["architectures"][0].endswith("ForCausalLM")
    ours = np.array(model(mx.array([TOKENS]))[0])
    np.testing.assert_allclose(ours, _hf_gguf_logits(path), atol=2e-3, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_with_the_checkpoints_config_equals_safetensors(tiny_model_dir, gguf_file, arch):
    """Gemma's `1 + weight` norms are undone; with the checkpoint's own config (what
    `--hf-config-path` gives) an F32 file is the safetensors model."""
    src = tiny_model_dir(arch)
    config = json.loads((src / "config.json").read_text())
    model, _ = gguf_loader.load(gguf_file(arch, "F32"), mx.float32, config=config)
    ref, _ = safetensors.load(str(src), mx.float32)
    tokens = mx.array([TOKENS])
    np.testing.assert_allclose(np.array(model(tokens)), np.array(ref(tokens)), atol=1e-4, rtol=0)


def test_read_config_fills_what_transformers_leaves_out(gguf_file):
    config = gguf_loader.read_config(gguf_file("qwen3", "Q8_0"))
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["dtype"] == "float16"  # a quantized file: the type of its block scales
    assert config["head_dim"] == 128
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 4, 0)
    assert gguf_loader.read_config(gguf_file("llama", "BF16"))["dtype"] == "bfloat16"


def test_dequantize_serves_exact_types_dense(gguf_file):
    path = gguf_file("qwen2", "Q4_0")
    quantized, _ = gguf_loader.load(path, mx.float32)
    dense, _ = gguf_loader.load(path, mx.float32, dequantize=True)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in dense.named_modules())
    tokens = mx.array([TOKENS])
    np.testing.assert_allclose(
        np.array(dense(tokens)), np.array(quantized(tokens)), atol=1e-4, rtol=0
    )


# ------------------------------------------------------------------------------------ errors


def test_truncated_file_names_the_file_and_tensor(gguf_file, tmp_path):
    path = tmp_path / "cut.gguf"
    whole = gguf_file("llama", "F16")
    shutil.copy(whole, path)
    last = gguf.GGUFReader(whole).tensors[-1]  # 1000 bytes short: only the last tensor is cut
    assert last.n_bytes > 1000
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    with pytest.raises(gguf_loader.GGUFError) as err:
        gguf_loader.load(path, mx.float32)
    assert str(path) in str(err.value)
    assert f"tensor {last.name!r}" in str(err.value) and "truncated" in str(err.value)


def test_corrupt_file_names_the_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(gguf_loader.GGUFError, match="not a readable GGUF file") as err:
        gguf_loader.load(path, mx.float32)
    assert str(path) in str(err.value)


def test_unsupported_tensor_type_names_tensor_and_type(gguf_file):
    path = gguf_file("llama", "Q8_0", overrides={"blk.1.ffn_down.weight": "Q5_0"})
    with pytest.raises(gguf_loader.GGUFError) as err:
        gguf_loader.load(path, mx.float32)
    message = str(err.value)
    assert str(path) in message
    assert "'blk.1.ffn_down.weight'" in message and "Q5_0" in message


def test_unsupported_architecture_names_it(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for load in (lambda: gguf_loader.load(path, mx.float32), lambda: gguf_loader.read_config(path)):
        with pytest.raises(gguf_loader.GGUFError) as err:
            load()
        assert str(path) in str(err.value) and "'phi3'" in str(err.value)


def test_split_file_is_refused(tmp_path):
    path = tmp_path / "model-00001-of-00002.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint16("split.count", 2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(gguf_loader.GGUFError, match="one of 2 split GGUF files; merge them"):
        gguf_loader.load(path, mx.float32)


def test_config_that_does_not_match_the_file_names_the_tensor(tiny_model_dir, gguf_file):
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    config["intermediate_size"] = 1024
    path = gguf_file("llama", "Q4_0")
    with pytest.raises(gguf_loader.GGUFError, match=r"tensor 'blk\.0\.ffn_\w+\.weight' has shape"):
        gguf_loader.load(path, mx.float32, config=config)
