"""Pooling models through `vllm serve` on the MLX runner, checked against transformers float32.

Two servers, each shared by its tests:

- the tiny Qwen3 decoder with `--runner pooling` (vLLM's default for a CausalLM: LAST pooling,
  normalised) and matryoshka sizes [64, 128] given through `--hf-overrides`: `/v1/embeddings`
  through the official `openai` client (float and base64), matryoshka `dimensions`, bad requests
  answered with 4xx, and `/v1/chat/completions`, which vLLM does not mount on a pooling model;
- the tiny `xlmr-rerank` cross-encoder (`XLMRobertaForSequenceClassification`, one label; vLLM
  picks the pooling runner itself): `/v1/rerank`, `/score` and `/classify`, and bad requests.

Oracles: the decoder embedding is transformers' `AutoModel` last hidden state at the last prompt
token, L2-normalised; a cross-encoder score is the sigmoid of `AutoModelForSequenceClassification`'s
logit on the tokenizer's pair encoding `tokenizer(query, doc)`. Every request is followed by a
check that the server survived.
"""

from __future__ import annotations

import base64
import functools
import json

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from tests.fixtures.tiny_encoders import write_tiny_encoder

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]

MATRYOSHKA = [64, 128]
TEXTS = [
    "hi",
    (
        "The old lighthouse stood at the edge of the cliff, and every night its lamp turned slowly "
        "over the dark water."
    ),
    "Music travels through the air.",
]
QUERY = "What is the capital of Japan?"
DOCS = [
    "The capital of Japan is Tokyo.",
    "Music travels through the air.",
    "The old lighthouse stood at the edge of the cliff.",
    "hi",
]


# --------------------------------------------------------------------------------------------------
# Servers and oracles
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def embed_server(server_slot, tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    overrides = json.dumps({"matryoshka_dimensions": MATRYOSHKA})
    return server_slot.get(
        ("pooling-embed", str(model_dir)),
        model_dir,
        served_name="tiny-qwen3-embed",
        api_key=None,
        extra_args=["--runner", "pooling", "--hf-overrides", overrides],
    )


@pytest.fixture(scope="module")
def rerank_dir(tmp_path_factory):
    return write_tiny_encoder(tmp_path_factory.mktemp("serving-pooling") / "xlmr", "xlmr-rerank")


@pytest.fixture
def rerank_server(server_slot, rerank_dir):
    # XLM-R has 512 positions; the later --max-model-len wins over the slot's default.
    return server_slot.get(
        ("pooling-rerank", str(rerank_dir)),
        rerank_dir,
        served_name="tiny-xlmr-rerank",
        api_key=None,
        extra_args=["--max-model-len", "512"],
    )


@pytest.fixture
def embed_client(embed_server):
    import openai

    return openai.OpenAI(
        base_url=embed_server.url("/v1"), api_key="unused", timeout=120, max_retries=0
    )


@functools.cache
def _tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@functools.cache
def _hf_model(model_dir, head):
    auto = AutoModelForSequenceClassification if head else AutoModel
    return auto.from_pretrained(model_dir, dtype=torch.float32).eval()


def _token_ids(model_dir, text, pair=None):
    return _tokenizer(model_dir)(text, pair)["input_ids"]


def _unit(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def _oracle_embedding(model_dir, text):
    """transformers float32: the last prompt token's final hidden state, L2-normalised."""
    inputs = _tokenizer(model_dir)(text, return_tensors="pt")
    with torch.no_grad():
        hidden = _hf_model(model_dir, head=False)(**inputs).last_hidden_state[0, -1]
    return _unit(hidden.numpy())


def _oracle_score(model_dir, text, pair=None):
    """sigmoid of the cross-encoder's single logit on `tokenizer(text[, pair])` (with the token
    type ids the tokenizer returns, if any)."""
    inputs = _tokenizer(model_dir)(text, pair, return_tensors="pt")
    with torch.no_grad():
        logits = _hf_model(model_dir, head=True)(**inputs).logits[0]
    assert logits.shape == (1,)
    return float(torch.sigmoid(logits[0]))


def _assert_close(got, want, server):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, f"{got.shape} != {want.shape}"
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    err = float(np.abs(got - want).max())
    assert cosine >= 0.9999 and err <= 1e-4, (
        f"cosine {cosine}, max abs diff {err}{server.context()}"
    )


def _expect(response, status, server):
    assert response.status_code == status, (
        f"{response.request.method} {response.url} -> {response.status_code}, wanted {status}: "
        f"{response.text[:1000]}{server.context()}"
    )
    return response.json()


def _still_serving_embeddings(client, server):
    assert server.alive(), server.context()
    out = client.embeddings.create(model=server.model, input=TEXTS[0])
    _assert_close(out.data[0].embedding, _oracle_embedding(server.model_dir, TEXTS[0]), server)


def _still_serving_scores(server):
    assert server.alive(), server.context()
    body = _expect(server.post("/classify", {"model": server.model, "input": DOCS[0]}), 200, server)
    assert body["data"][0]["probs"] == pytest.approx(
        [_oracle_score(server.model_dir, DOCS[0])], abs=1e-4
    )


# --------------------------------------------------------------------------------------------------
# Server 1: decoder embeddings
# --------------------------------------------------------------------------------------------------


def test_embeddings_equal_transformers(embed_server, embed_client):
    out = embed_client.embeddings.create(model=embed_server.model, input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2]
    vectors = [np.asarray(d.embedding) for d in out.data]
    for text, got in zip(TEXTS, vectors, strict=True):
        assert len(got) == 256  # the hidden size: no matryoshka truncation unless asked
        _assert_close(got, _oracle_embedding(embed_server.model_dir, text), embed_server)
    # Different inputs give different vectors (a pooler reading a fixed row would not).
    for i in range(len(vectors)):
        for j in range(i + 1, len(vectors)):
            assert float(_unit(vectors[i]) @ _unit(vectors[j])) < 0.9, (i, j)
    expected_tokens = sum(len(_token_ids(embed_server.model_dir, t)) for t in TEXTS)
    assert out.usage.prompt_tokens == expected_tokens
    assert out.usage.total_tokens == expected_tokens


def test_matryoshka_dimensions(embed_server, embed_client):
    out = embed_client.embeddings.create(model=embed_server.model, input=TEXTS[1], dimensions=64)
    got = np.asarray(out.data[0].embedding)
    full = _oracle_embedding(embed_server.model_dir, TEXTS[1])
    _assert_close(got, _unit(full[:64]), embed_server)  # truncated, then re-normalised
    assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-5)

    r = embed_server.post(
        "/v1/embeddings", {"model": embed_server.model, "input": TEXTS[1], "dimensions": 7}
    )
    error = _expect(r, 400, embed_server)["error"]
    assert "dimensions" in error["message"], error
    _still_serving_embeddings(embed_client, embed_server)


def test_base64_encoding_decodes_to_the_same_floats(embed_server, embed_client):
    floats = embed_client.embeddings.create(model=embed_server.model, input=TEXTS[2])
    packed = embed_client.embeddings.create(
        model=embed_server.model, input=TEXTS[2], encoding_format="base64"
    )
    encoded = packed.data[0].embedding
    assert isinstance(encoded, str)  # the client hands back base64 when asked for it explicitly
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert decoded.shape == (256,)
    np.testing.assert_allclose(decoded, floats.data[0].embedding, rtol=0, atol=1e-7)
    _assert_close(decoded, _oracle_embedding(embed_server.model_dir, TEXTS[2]), embed_server)


def test_bad_embedding_requests_get_4xx(embed_server, embed_client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        embed_client.embeddings.create(model=embed_server.model, input=[])
    assert err.value.status_code == 400
    vocab = len(_tokenizer(embed_server.model_dir))
    for ids in ([1, 2, vocab + 1000], [[5, 6], [1, vocab]]):
        r = embed_server.post("/v1/embeddings", {"model": embed_server.model, "input": ids})
        error = _expect(r, 400, embed_server)["error"]
        assert "out of vocabulary" in error["message"], error
    _still_serving_embeddings(embed_client, embed_server)


def test_chat_completions_on_a_pooling_model_is_not_found(embed_server, embed_client):
    import openai

    # vLLM 0.32 mounts no generation routes for a pooling model: the client sees a 404.
    with pytest.raises(openai.NotFoundError) as err:
        embed_client.chat.completions.create(
            model=embed_server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert err.value.status_code == 404
    _still_serving_embeddings(embed_client, embed_server)


# --------------------------------------------------------------------------------------------------
# Server 2: a cross-encoder
# --------------------------------------------------------------------------------------------------


def test_rerank_equals_transformers(rerank_server):
    want = [_oracle_score(rerank_server.model_dir, QUERY, doc) for doc in DOCS]
    assert max(want) - min(want) > 0.1  # the scores tell the documents apart
    body = {"model": rerank_server.model, "query": QUERY, "documents": DOCS, "top_n": 3}
    out = _expect(rerank_server.post("/v1/rerank", body), 200, rerank_server)
    results = out["results"]
    assert len(results) == 3
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4), r
        assert r["document"]["text"] == DOCS[r["index"]]
    pairs = [_token_ids(rerank_server.model_dir, QUERY, doc) for doc in DOCS]
    assert out["usage"]["prompt_tokens"] == sum(map(len, pairs))


def test_score_equals_transformers(rerank_server):
    want = [_oracle_score(rerank_server.model_dir, QUERY, doc) for doc in DOCS]
    body = {"model": rerank_server.model, "text_1": QUERY, "text_2": DOCS}
    out = _expect(rerank_server.post("/score", body), 200, rerank_server)
    assert [d["index"] for d in out["data"]] == list(range(len(DOCS)))
    assert [d["score"] for d in out["data"]] == pytest.approx(want, abs=1e-4)


def test_classify_equals_transformers(rerank_server):
    out = _expect(
        rerank_server.post("/classify", {"model": rerank_server.model, "input": DOCS[2]}),
        200,
        rerank_server,
    )
    (row,) = out["data"]
    assert row["num_classes"] == 1 and len(row["probs"]) == 1
    assert row["probs"][0] == pytest.approx(
        _oracle_score(rerank_server.model_dir, DOCS[2]), abs=1e-4
    )


def test_bad_rerank_requests_get_400(rerank_server):
    for body, field in (
        ({"model": rerank_server.model, "query": QUERY}, "documents"),
        ({"model": rerank_server.model, "query": 5, "documents": DOCS}, "query"),
    ):
        error = _expect(rerank_server.post("/v1/rerank", body), 400, rerank_server)["error"]
        assert field in error["message"], error
    _still_serving_scores(rerank_server)
