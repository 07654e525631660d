"""Proves the tiny checkpoints are sound oracles: transformers and mlx-lm load each and agree.

Also: varied context-dependent output, working sliding windows, chat template, MLX quantization.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures import oracles
from vllm_metal.testing.tiny_models import (
    ARCHS,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    build_tokenizer_json,
    tiny_config,
    token_id,
    write_tiny_model,
)

FIRST_TEXT_ID = len(SPECIAL_TOKENS)
NEW_TOKENS = 32
# mlx-lm runs Mistral with its Llama class, which applies no window unless the config lists
# per-layer `layer_types`; HF and vLLM window every layer. They can only agree inside the window.
MLX_LM_IGNORES_WINDOW = {"mistral"}


def _prompts(lengths: tuple[int, ...] = (3, 17, 45), seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_TEXT_ID, 760, n).tolist() for n in lengths]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


# ------------------------------------------------------------------------------------------------
# Tokenizer and files
# ------------------------------------------------------------------------------------------------


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    here = hashlib.sha256(build_tokenizer_json().encode()).hexdigest()
    code = (
        "import hashlib; from vllm_metal.testing.tiny_models import build_tokenizer_json as b; "
        "print(hashlib.sha256(b().encode()).hexdigest())"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert here == there


def test_tokenizer_vocab_matches_config_and_keeps_markup_tokens(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    model_dir = tiny_model_dir("qwen3")
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] >= len(tok)
    for text in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert tok.convert_tokens_to_ids(text) == token_id(text)
    text = 'Paris <think>\nsunny\n</think><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    for marker in MARKUP_TOKENS[:4]:
        assert token_id(marker) in ids  # one token each, not split into bytes
    # Reasoning and tool parsers read the decoded text: the markers must survive skipping specials.
    assert tok.decode(ids + [token_id("<|im_end|>")], skip_special_tokens=True) == text
    assert tok.decode(tok.encode("The weather in 1969 was 24.5 degrees!")) == (
        "The weather in 1969 was 24.5 degrees!"
    )


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_checkpoint_is_reproducible_and_honours_dtype(tmp_path: Path, arch: str) -> None:
    from safetensors import safe_open

    a = write_tiny_model(tmp_path / "a", arch, dtype="bfloat16", seed=3)
    b = write_tiny_model(tmp_path / "b", arch, dtype="bfloat16", seed=3)
    c = write_tiny_model(tmp_path / "c", arch, dtype="bfloat16", seed=4)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        dtypes = {str(f.get_tensor(k).dtype) for k in names}
    has_lm_head = "lm_head.weight" in names
    assert dtypes == {"torch.bfloat16"}
    assert has_lm_head == (not ARCHS[arch].config.get("tie_word_embeddings", False))
    config = json.loads((a / "config.json").read_text())
    assert config["head_dim"] >= 64  # vLLM's CPU attention is an oracle only from 64 up


def test_config_rejects_unknown_arch_and_dtype() -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        tiny_config("gpt2")
    with pytest.raises(ValueError, match="unknown dtype"):
        tiny_config("llama", dtype="int8")
    with pytest.raises(ValueError, match="no sliding-window"):
        tiny_config("qwen3", sliding_window=16)


def test_cli_writes_checkpoint_and_prints_path(tmp_path: Path) -> None:
    out = tmp_path / "tiny-qwen3"
    cmd = [sys.executable, "-m", "vllm_metal.testing.tiny_models", "--arch", "qwen3"]
    cmd += ["--dtype", "bfloat16", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(out.resolve())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["dtype"] == "bfloat16"
    assert (out / "model.safetensors").stat().st_size > 0


# ------------------------------------------------------------------------------------------------
# Oracles
# ------------------------------------------------------------------------------------------------


def test_hf_greedy_ignores_eos_and_matches_logprob_argmax(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "m", "qwen3")
    prompt = _prompts((9,))[0]
    tokens = oracles.hf_greedy(model_dir, [prompt], NEW_TOKENS)[0]
    # The cached generate loop and a single uncached forward must pick the same argmax.
    logprobs = oracles.hf_logprobs(model_dir, prompt + tokens)
    assert logprobs.dtype == np.float32 and logprobs.shape == (len(prompt) + NEW_TOKENS, 768)
    np.testing.assert_allclose(np.exp(logprobs).sum(-1), 1.0, rtol=1e-5)
    assert logprobs[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens
    # Declare a token the model emits early as end-of-sequence: it must neither stop generation
    # nor be masked out (vLLM's ignore_eos keeps it in the distribution).
    for name in ("config.json", "generation_config.json"):
        data = json.loads((model_dir / name).read_text())
        data["eos_token_id"] = [tokens[2]]
        (model_dir / name).write_text(json.dumps(data))
    assert oracles.hf_greedy(model_dir, [prompt], NEW_TOKENS)[0] == tokens


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_transformers_and_mlx_lm_agree_greedily_in_float32(tiny_model_dir, arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    prompts = _prompts()
    if arch in MLX_LM_IGNORES_WINDOW:
        prompts = _prompts((3, 12))
    hf = oracles.hf_greedy(model_dir, prompts, NEW_TOKENS)
    mlx = oracles.mlx_lm_greedy(model_dir, prompts, NEW_TOKENS)
    for prompt, hf_tokens, mlx_tokens in zip(prompts, hf, mlx, strict=True):
        n = NEW_TOKENS
        if arch in MLX_LM_IGNORES_WINDOW:
            n = ARCHS[arch].config["sliding_window"] - len(prompt)
        assert hf_tokens[:n] == mlx_tokens[:n], (
            f"{arch}, prompt length {len(prompt)}: first difference at new token "
            f"{_first_difference(hf_tokens[:n], mlx_tokens[:n])}"
        )
        assert len(set(hf_tokens)) >= 8, f"{arch} degenerates: {hf_tokens}"
    # Continuations depend on the whole context: changing the first prompt token changes them.
    changed = [prompts[-1][0] + 1] + prompts[-1][1:]
    assert oracles.hf_greedy(model_dir, [changed], NEW_TOKENS)[0] != hf[-1]
    assert len({tuple(t) for t in hf}) == len(prompts)


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [("qwen3", "bfloat16"), ("gemma3", "bfloat16"), ("gemma2", "bfloat16"), ("llama", "float16")],
)
def test_half_precision_checkpoints(tiny_model_dir, arch: str, dtype: str) -> None:
    import mlx.core as mx
    from mlx_lm import load

    model_dir = tiny_model_dir(arch, dtype)
    model, _ = load(str(model_dir))
    assert model.model.embed_tokens.weight.dtype == getattr(mx, dtype)
    prompts = _prompts((5, 20))
    native = oracles.mlx_lm_greedy(model_dir, prompts, NEW_TOKENS)
    assert all(len(set(t)) >= 8 for t in native)
    # Upcast half weights are exact in float32, so both frameworks must agree again.
    upcast = oracles.mlx_lm_greedy(model_dir, prompts, NEW_TOKENS, dtype="float32")
    assert upcast == oracles.hf_greedy(model_dir, prompts, NEW_TOKENS)


def test_sliding_window_limits_the_receptive_field(tiny_model_dir) -> None:
    # Two layers with window W: position p sees tokens p-2(W-1) … p. Changing token 0 therefore
    # moves the logits up to position 2W-2 and leaves every later position bit-for-bit alone.
    window = ARCHS["mistral"].config["sliding_window"]
    reach = 2 * (window - 1)
    seq = _prompts((reach + 16,))[0]
    changed = [seq[0] + 1] + seq[1:]
    for arch, windowed in (("mistral", True), ("llama", False)):
        model_dir = tiny_model_dir(arch)
        diff = np.abs(oracles.hf_logprobs(model_dir, seq) - oracles.hf_logprobs(model_dir, changed))
        per_position = diff.max(axis=-1)
        assert per_position[:window].min() > 1e-3, arch
        assert per_position[window : reach + 1].max() > 1e-3, arch  # through the second layer
        if windowed:
            assert per_position[reach + 1 :].max() < 1e-5
        else:
            assert per_position[reach + 1 :].max() > 1e-2


def test_gemma3_parity_prompts_reach_past_the_window(tiny_model_dir) -> None:
    # The same weights with a window wider than the context must continue differently, or the
    # Gemma3 parity test above would not exercise sliding-window attention at all.
    prompts = _prompts()[1:]
    windowed = oracles.hf_greedy(tiny_model_dir("gemma3"), prompts, NEW_TOKENS)
    unwindowed = oracles.hf_greedy(
        tiny_model_dir("gemma3", sliding_window=4096), prompts, NEW_TOKENS
    )
    assert all(a != b for a, b in zip(windowed, unwindowed, strict=True))


# ------------------------------------------------------------------------------------------------
# Chat template
# ------------------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_chat_template_renders_tools_thinking_and_history(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    user = [{"role": "user", "content": "Hi"}]
    assert (
        tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        tok.apply_chat_template(user, add_generation_prompt=False, tokenize=False)
        == "<|im_start|>user\nHi<|im_end|>\n"
    )
    no_think = tok.apply_chat_template(
        user, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    think = tok.apply_chat_template(
        user, add_generation_prompt=True, enable_thinking=True, tokenize=False
    )
    assert think.endswith("<|im_start|>assistant\n")

    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny, 24 C"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool said so."},
    ]
    text = tok.apply_chat_template(history, tools=TOOLS, tokenize=False)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
    ) in rest
    assert "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>\n" in rest
    assert rest.endswith(
        "<|im_start|>assistant\n<think>\nThe tool said so.\n</think>\n\nSunny.<|im_end|>\n"
    )


def test_vllm_hermes_parser_reads_tool_calls_in_this_format(tiny_model_dir) -> None:
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    model_dir = tiny_model_dir("qwen3")
    tokenizer = get_tokenizer(str(model_dir))
    output = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    output += "</tool_call>"
    ids = tokenizer.encode(output, add_special_tokens=False)
    decoded = tokenizer.decode(ids + [token_id("<|im_end|>")], skip_special_tokens=True)
    parser = Hermes2ProToolParser(tokenizer)
    info = parser.extract_tool_calls(decoded, request=None)
    assert info.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert info.content == "Checking.\n"


# ------------------------------------------------------------------------------------------------
# MLX-quantized checkpoints
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "bits", "group_size"), [("qwen3", 4, 64), ("llama", 8, 32)])
def test_quantized_checkpoints_load_and_generate(
    tiny_quantized_dir, tiny_model_dir, arch: str, bits: int, group_size: int
) -> None:
    import mlx.core as mx
    from mlx import nn
    from mlx_lm import load

    qdir = tiny_quantized_dir(arch, bits=bits, group_size=group_size)
    config = json.loads((qdir / "config.json").read_text())
    assert config["quantization"] == {"group_size": group_size, "bits": bits, "mode": "affine"}
    model, _ = load(str(qdir))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear)
    assert (q_proj.bits, q_proj.group_size) == (bits, group_size)
    prompts = _prompts((6, 30))
    tokens = oracles.mlx_lm_greedy(qdir, prompts, NEW_TOKENS)
    assert all(len(set(t)) >= 8 for t in tokens)
    # Quantization perturbs, not replaces, the model: its logits stay correlated with the source's
    # (an unrelated model gives ~0; random tiny models are chaotic, so 4-bit drifts visibly).
    seq = prompts[1]
    full, _ = load(str(tiny_model_dir(arch, "bfloat16")))
    ref = np.array(full(mx.array([seq]))[0].astype(mx.float32))
    got = np.array(model(mx.array([seq]))[0].astype(mx.float32))
    corr = np.corrcoef(ref.ravel(), got.ravel())[0, 1]
    assert corr > (0.97 if bits == 8 else 0.7), corr


# ------------------------------------------------------------------------------------------------
# vLLM's own CPU backend as a third opinion
# ------------------------------------------------------------------------------------------------

_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys

    def main():
        from vllm import LLM, SamplingParams

        model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
        llm = LLM(model=model_dir, dtype="float32", kv_cache_memory_bytes=64 * 2**20,
                  enforce_eager=True, max_model_len=512, max_num_seqs=4, seed=0)
        params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.slow
@pytest.mark.full
def test_vllm_cpu_backend_agrees_with_transformers_on_qwen3(tiny_model_dir, tmp_path) -> None:
    model_dir = tiny_model_dir("qwen3")
    prompts = _prompts()
    script = tmp_path / "run_vllm_cpu.py"
    script.write_text(_VLLM_SCRIPT)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")  # vLLM's platform, not this plugin
    result = subprocess.run(
        [sys.executable, str(script), str(model_dir), json.dumps(prompts), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    vllm_tokens = json.loads(lines[-1][len("TOKENS ") :])
    assert vllm_tokens == oracles.hf_greedy(model_dir, prompts, NEW_TOKENS)
