"""Images through `vllm serve` on the MLX runner: `/v1/chat/completions` with `image_url` parts,
sent with the official `openai` client to the tiny random Idefics3
(`tests.fixtures.tiny_idefics3`), checked against transformers float32.

One server (`--limit-mm-per-prompt '{"image": 2}'`, `--max-model-len 512`, float32; the
checkpoint's own chat template) answers: one image as a PNG data URL, two images in one message
(either order), a mix of image and text requests one by one and concurrently, and bad image
requests (a video part, more images than the limit, undecodable data URLs), each answered with a
400 naming the problem while the server keeps serving images.

Oracle: `idefics3_generate` (transformers' `Idefics3ForConditionalGeneration`, greedy, float32)
on the prompt the checkpoint's chat template renders for the same messages; the server's
`prompt_token_ids` must equal transformers' processor's expansion of that prompt
(`idefics3_prompt_ids`), so both sides see the same tokens and the same pixels (PNG is lossless).

A text-only model given an image is checked on the main server in `test_bad_input.py`
("image-to-text-model": 400, "... is not a multimodal model"). An `image_url` on an unreachable
http URL is not checked: vLLM 0.32 retries the fetch (1 s and 4 s back-off) and then answers 500
for a refused connection, and what an unroutable address gives depends on the network.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from transformers import AutoTokenizer

from tests.fixtures.tiny_idefics3 import IMAGE_TOKEN_ID, tiny_image
from tests.fixtures.vision_oracles import idefics3_generate, idefics3_prompt_ids

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]

SERVED = "tiny-idefics3"
MAX_TOKENS = 8
QUESTION = "What is this?"

# A request is a list of content parts: ("image", seed, (width, height)) or ("text", str).
ONE_IMAGE = [("image", 0, (64, 64)), ("text", QUESTION)]
TWO_IMAGES = [("image", 2, (64, 64)), ("text", "and"), ("image", 3, (48, 32)), ("text", "Same?")]
MIXED = [
    [("image", 4, (64, 40)), ("text", QUESTION)],
    [("text", "Hello there")],
    TWO_IMAGES,
    [("image", 1, (64, 64)), ("text", QUESTION)],
    [("text", "Tell me a story")],
    ONE_IMAGE,
]


@pytest.fixture
def server(server_slot, tiny_idefics3_dir):
    return server_slot.get(
        ("idefics3", str(tiny_idefics3_dir)),
        tiny_idefics3_dir,
        served_name=SERVED,
        api_key=None,
        extra_args=["--limit-mm-per-prompt", '{"image": 2}', "--max-model-len", "512"],
    )


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_idefics3_dir):
    return AutoTokenizer.from_pretrained(tiny_idefics3_dir)


def _data_url(seed: int, size: tuple[int, int]) -> str:
    buf = io.BytesIO()
    tiny_image(seed, size).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(parts) -> list[dict]:
    if all(kind == "text" for kind, *_ in parts):
        return [{"role": "user", "content": " ".join(text for _, text in parts)}]
    content = [
        {"type": "image_url", "image_url": {"url": _data_url(*rest)}}
        if kind == "image"
        else {"type": "text", "text": rest[0]}
        for kind, *rest in parts
    ]
    return [{"role": "user", "content": content}]


def _images(parts) -> list:
    return [tiny_image(*rest) for kind, *rest in parts if kind == "image"]


def _chat(client, parts):
    """Greedy, exactly MAX_TOKENS tokens, with the prompt and completion token ids."""
    return client.chat.completions.create(
        model=SERVED,
        messages=_messages(parts),
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )


def _oracle(model_dir, tokenizer, parts) -> tuple[list[int], list[int]]:
    """(prompt token ids, greedy new tokens) of transformers for the rendered chat prompt."""
    prompt = tokenizer.apply_chat_template(
        _messages(parts), add_generation_prompt=True, tokenize=False
    )
    images = _images(parts)
    return (
        idefics3_prompt_ids(model_dir, prompt, images),
        idefics3_generate(model_dir, prompt, images, MAX_TOKENS),
    )


def _check_against_oracle(client, model_dir, tokenizer, parts) -> list[int]:
    want_prompt, want = _oracle(model_dir, tokenizer, parts)
    got = _chat(client, parts)
    assert got.prompt_token_ids == want_prompt
    assert got.choices[0].token_ids == want
    assert got.choices[0].finish_reason == "length"
    return want


def test_one_image_as_a_data_url_matches_transformers(client, tiny_idefics3_dir, tokenizer):
    answers = []
    for seed in (0, 1):
        parts = [("image", seed, (64, 64)), ("text", QUESTION)]
        answers.append(_check_against_oracle(client, tiny_idefics3_dir, tokenizer, parts))
    # The image decides the answer.
    assert answers[0] != answers[1]
    # The 64x64 image is 4 tiles and a global view of 4 embeddings each.
    prompt, _ = _oracle(tiny_idefics3_dir, tokenizer, ONE_IMAGE)
    assert prompt.count(IMAGE_TOKEN_ID) == 20


def test_two_images_in_one_message_match_transformers(client, tiny_idefics3_dir, tokenizer):
    forward = _check_against_oracle(client, tiny_idefics3_dir, tokenizer, TWO_IMAGES)
    swapped = [TWO_IMAGES[2], TWO_IMAGES[1], TWO_IMAGES[0], TWO_IMAGES[3]]
    assert _check_against_oracle(client, tiny_idefics3_dir, tokenizer, swapped) != forward


def test_concurrent_image_and_text_requests_equal_their_sequential_answers(
    client, tiny_idefics3_dir, tokenizer
):
    want = [_oracle(tiny_idefics3_dir, tokenizer, parts)[1] for parts in MIXED]
    assert len({tuple(w) for w in want}) == len(MIXED)  # a mix-up between requests would show
    one_by_one = [_chat(client, parts).choices[0].token_ids for parts in MIXED]
    assert one_by_one == want
    with ThreadPoolExecutor(len(MIXED)) as pool:
        concurrent = list(pool.map(lambda parts: _chat(client, parts), MIXED))
    assert [r.choices[0].token_ids for r in concurrent] == one_by_one


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _not_an_image() -> str:
    return "data:image/png;base64," + base64.b64encode(b"this is not a picture").decode()


BAD_REQUESTS = [
    pytest.param(
        lambda: [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXBpc29t"}},
            {"type": "text", "text": QUESTION},
        ],
        "At most 0 video(s) may be provided in one prompt",
        id="video",
    ),
    pytest.param(
        lambda: [
            *(_image_part(_data_url(s, (64, 64))) for s in range(3)),
            {"type": "text", "text": QUESTION},
        ],
        "At most 2 image(s) may be provided in one prompt",
        id="three-images",
    ),
    pytest.param(
        lambda: [_image_part("data:image/png;base64,@@not base64@@")],
        "base64",
        id="garbage-base64",
    ),
    pytest.param(
        lambda: [_image_part(_not_an_image())],
        "Failed to load image",
        id="not-an-image",
    ),
    pytest.param(
        lambda: [_image_part("data:image/png;base64,iVBORw0KGgo=")],  # the PNG signature only
        "Failed to load image",
        id="truncated-png",
    ),
]


@pytest.mark.parametrize(("content", "words"), BAD_REQUESTS)
def test_bad_image_request_is_a_400_and_the_server_keeps_serving(
    client, server, tiny_idefics3_dir, tokenizer, content, words
):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=SERVED,
            messages=[{"role": "user", "content": content()}],
            temperature=0.0,
            max_tokens=MAX_TOKENS,
        )
    assert err.value.status_code == 400
    assert words in err.value.body["message"], err.value.body
    assert server.alive(), server.context()
    assert requests.get(server.url("/health"), timeout=10).status_code == 200
    _check_against_oracle(client, tiny_idefics3_dir, tokenizer, ONE_IMAGE)
