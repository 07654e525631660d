"""vLLM builds its config for a `.gguf` model path on this platform: the Hugging Face config from
the file's metadata (or `--hf-config-path`), the tokenizer from `--tokenizer` or from the file,
no vLLM quantization method, and unreadable files refused at startup naming the file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.fixtures.tiny_gguf import write_tiny_gguf


def _engine_config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=256, **kwargs).create_engine_config()


@pytest.fixture(scope="module")
def files(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-frontend")
    llama = tiny_model_dir("llama")
    qwen3 = tiny_model_dir("qwen3", head_dim=128)
    return {
        "llama_dir": llama,
        "llama_q4_0": write_tiny_gguf(llama, root / "llama-q4_0.gguf", "Q4_0"),
        "llama_f16": write_tiny_gguf(llama, root / "llama-f16.gguf", "F16"),
        "qwen3_dir": qwen3,
        "qwen3_bare": write_tiny_gguf(qwen3, root / "qwen3-bare.gguf", "F16", tokenizer=False),
    }


def test_config_comes_from_the_file(files):
    config = _engine_config(files["llama_q4_0"], tokenizer=str(files["llama_dir"]))
    model = config.model_config
    assert model.model == str(files["llama_q4_0"])  # what the runner loads
    assert model.tokenizer == str(files["llama_dir"])
    assert model.hf_config.model_type == "llama"
    assert model.architectures == ["LlamaForCausalLM"]
    assert model.runner_type == "generate"
    assert model.quantization is None  # the MLX runner reads the blocks itself
    assert model.dtype == torch.float16  # a quantized file: the type of its block scales
    assert (model.get_num_layers(config.parallel_config), model.get_head_size()) == (2, 64)


def test_hf_config_path_overrides_the_metadata(files, tiny_quantized_dir):
    """The config (and tokenizer) of another directory, here an MLX-quantized checkpoint."""
    mlx_dir = tiny_quantized_dir("llama", bits=4, group_size=64)
    config = _engine_config(
        files["llama_q4_0"], hf_config_path=str(mlx_dir), tokenizer=str(mlx_dir)
    )
    model = config.model_config
    assert model.dtype == torch.bfloat16  # the directory's config, not the file's float16
    assert model.quantization is None
    assert model.hf_config.model_type == "llama"


def test_tokenizer_from_the_file_without_tokenizer_option(files, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    """transformers rebuilds it from the metadata (a llama-architecture file with a "gpt2"
    tokenizer model: the tiny BPE exactly; for Qwen architectures transformers applies Qwen's own
    pre-tokenizer, which the tiny tokenizer does not have)."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    model = _engine_config(files["llama_f16"]).model_config
    assert model.dtype == torch.float16  # an F16 file
    assert str(tmp_path) in model.tokenizer
    ours = AutoTokenizer.from_pretrained(model.tokenizer)
    original = AutoTokenizer.from_pretrained(files["llama_dir"])
    text = "The old lighthouse stood at the edge of the cliff. <|im_start|>user 2 + 2 = 4 don't"
    assert ours(text).input_ids == original(text).input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(
        messages, tokenize=False
    )
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|bos|>", "<|im_end|>", "<|pad|>")
    ids = np.random.default_rng(0).integers(0, len(original), size=200).tolist()
    assert ours.decode(ids) == original.decode(ids)


def test_file_without_tokenizer_asks_for_the_option(files, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    with pytest.raises(ValueError, match="has no tokenizer; pass --tokenizer"):
        _engine_config(files["qwen3_bare"])
    config = _engine_config(files["qwen3_bare"], tokenizer=str(files["qwen3_dir"]))
    assert config.model_config.tokenizer == str(files["qwen3_dir"])


def test_unsupported_architecture_is_refused_at_startup(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(Exception) as err:
        _engine_config(path, tokenizer=str(tmp_path))
    chain = []
    exc: BaseException | None = err.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any(str(path) in m and "'phi3'" in m for m in chain), chain
