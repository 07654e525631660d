"""Pooling models on the MLX runner (`--runner pooling`) against transformers float32 and vLLM's
own CPU backend: decoder embeddings (chunked prefill, prefix hits, matryoshka, token embeddings),
a decoder classifier, a reranker made from the LM head, and encoder-only BERT models (mean-pooled
sentence-transformers embeddings, a cross-encoder reading the pair's token types).

One engine per model runs every job of its tests (module fixtures); vLLM's CPU backend runs the
same jobs once for the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import random_prompts, run_engine_job
from tests.fixtures.oracles import hf_classifier_logits, hf_hidden_states, hf_logits
from tests.fixtures.tiny_encoders import write_tiny_encoder
from tests.fixtures.tiny_pooling import write_matryoshka, write_seq_classifier

pytestmark = pytest.mark.slow

# Mixed lengths submitted together; with a 16-token step budget the longer ones are chunked.
MIXED = random_prompts(11, [1, 5, 17, 40, 75])
SHARED_PREFIX = random_prompts(12, [48])[0]
PREFIX_HITS = [SHARED_PREFIX + tail for tail in random_prompts(13, [3, 9])]
DECODER_ENGINE = {"runner": "pooling", "max_num_batched_tokens": 16, "enable_prefix_caching": True}
MATRYOSHKA = [64, 128]
TOL = 1e-4


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _close(got, want, tol: float = TOL) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.abs(got - want).max() <= tol, np.abs(got - want).max()


def _data(result: list[dict]) -> list[np.ndarray]:
    assert isinstance(result, list), result  # an {"error": ...} here means the job failed
    return [np.asarray(r["data"]) for r in result]


# ------------------------------------------------------------------------ decoder embeddings

EMBED_JOBS = [
    {"pool": "embed", "prompts": MIXED},
    {"pool": "embed", "prompts": [SHARED_PREFIX + [5]]},  # fills the prefix cache
    {"pool": "embed", "prompts": PREFIX_HITS},
    {"pool": "embed", "prompts": MIXED[2:4], "params": {"dimensions": 64}},
    {"pool": "embed", "prompts": MIXED[:1], "params": {"dimensions": 7}},  # not matryoshka
    {"pool": "embed", "prompts": MIXED[2:4], "params": {"use_activation": False}},
]
# A server answers one pooling task; per-token embeddings are asked for in the config.
TOKEN_EMBED_ENGINE = {**DECODER_ENGINE, "pooler_config": {"task": "token_embed"}}
TOKEN_EMBED_JOBS = [{"pool": "token_embed", "prompts": MIXED[1:4]}]


@pytest.fixture(scope="module")
def embedder(tiny_model_dir, tmp_path_factory):
    return write_matryoshka(
        tiny_model_dir("qwen3"), tmp_path_factory.mktemp("pool") / "qwen3-embed", MATRYOSHKA
    )


@pytest.fixture(scope="module")
def embed_results(embedder):
    return run_engine_job(embedder, EMBED_JOBS, engine=DECODER_ENGINE)


def _last_hidden(model, prompt: list[int]) -> np.ndarray:
    return hf_hidden_states(model, prompt)[-1]


def test_embeddings_of_a_chunked_mixed_batch_match_transformers(embedder, embed_results):
    got = _data(embed_results[0])
    for prompt, vec in zip(MIXED, got):
        want = _unit(_last_hidden(embedder, prompt))
        assert float(vec @ want) >= 0.9999
        _close(vec, want)
    # Different prompts, different embeddings (the check above can fail).
    assert float(got[3] @ got[4]) < 0.99


def test_prefix_cache_hits_give_the_same_embeddings(embedder, embed_results):
    hits = embed_results[2]
    assert all(r["num_cached_tokens"] >= 32 for r in hits), [r["num_cached_tokens"] for r in hits]
    for prompt, vec in zip(PREFIX_HITS, _data(hits)):
        _close(vec, _unit(_last_hidden(embedder, prompt)))


def test_matryoshka_dimensions_and_raw_hidden_states(embedder, embed_results):
    for prompt, vec in zip(MIXED[2:4], _data(embed_results[3])):
        _close(vec, _unit(_last_hidden(embedder, prompt)[:64]))
    refused = embed_results[4]
    assert "error" in refused and "dimensions" in refused["error"], refused
    # use_activation=False: the last hidden state as it is, not normalised.
    for prompt, vec in zip(MIXED[2:4], _data(embed_results[5])):
        _close(vec, _last_hidden(embedder, prompt), 1e-3)


@pytest.fixture(scope="module")
def token_results(embedder):
    return run_engine_job(embedder, TOKEN_EMBED_JOBS, engine=TOKEN_EMBED_ENGINE)


def test_token_embeddings_cover_every_prompt_token_across_chunks(embedder, token_results):
    for prompt, tokens in zip(MIXED[1:4], _data(token_results[0])):
        _close(tokens, _unit(hf_hidden_states(embedder, prompt)))


# ------------------------------------------------------------------------ decoder classifiers


@pytest.fixture(scope="module")
def classifier(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pool") / "qwen3-cls"
    return write_seq_classifier(tiny_model_dir("qwen3"), out, num_labels=3)


CLASSIFY_JOBS = [
    {"pool": "classify", "prompts": MIXED},
    {"pool": "classify", "prompts": MIXED[3:4], "params": {"use_activation": False}},
]


@pytest.fixture(scope="module")
def classify_results(classifier):
    return run_engine_job(classifier, CLASSIFY_JOBS, engine=DECODER_ENGINE)


def test_class_probabilities_match_transformers(classifier, classify_results):
    got = _data(classify_results[0])
    for prompt, probs in zip(MIXED, got):
        _close(probs, _softmax(hf_classifier_logits(classifier, prompt)))
    assert not np.allclose(got[0], got[1], atol=1e-2)
    (logits,) = _data(classify_results[1])
    _close(logits, hf_classifier_logits(classifier, MIXED[3]), 1e-3)


def test_token_classification_applies_the_score_head_to_every_token(classifier):
    import torch

    from tests.fixtures.oracles import load_hf_classifier

    engine = {**DECODER_ENGINE, "pooler_config": {"task": "token_classify"}}
    (got,) = run_engine_job(
        classifier, [{"pool": "token_classify", "prompts": MIXED[1:4]}], engine=engine
    )
    head = load_hf_classifier(classifier).score.weight.detach().numpy()
    for prompt, probs in zip(MIXED[1:4], _data(got)):
        logits = torch.from_numpy(hf_hidden_states(classifier, prompt) @ head.T)
        _close(probs, torch.softmax(logits, dim=-1).numpy())


# Qwen3-Reranker style: a CausalLM whose "yes" and "no" LM-head rows make the score
# (vLLM's from_2_way_softmax conversion). Two ordinary tokens of the tiny vocabulary stand in.
RERANK_TOKENS = ["Ġnot", "Ġfound"]
RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": RERANK_TOKENS,
    "is_original_qwen3_reranker": True,
}


def test_a_reranker_made_from_the_lm_head_scores_like_the_causal_lm(tiny_model_dir):
    from transformers import AutoTokenizer

    model = tiny_model_dir("qwen3")
    engine = {**DECODER_ENGINE, "hf_overrides": RERANKER_OVERRIDES}
    (scores,) = run_engine_job(model, [{"pool": "classify", "prompts": MIXED}], engine=engine)
    no, yes = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(RERANK_TOKENS)
    for prompt, (score,) in zip(MIXED, _data(scores)):
        last = hf_logits(model, prompt)[-1]
        _close([score], [_sigmoid(last[yes] - last[no])])


# ------------------------------------------------------------------------ encoder-only models

SENTENCES = [
    "the weather is fine",
    "what is the capital of france",
    "a",
    "the first number of the sequence is one and the next one is two and so on for ever",
]
QUERY = "what is the weather"
DOCUMENTS = ["the weather is fine today", "paris is the capital", "one two three", "rain"]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {kind: write_tiny_encoder(root / kind, kind) for kind in ("bert-embed", "bert-rerank")}


def _tokenize(model, *texts):
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(model)(*texts)
    return enc["input_ids"], enc.get("token_type_ids")


def test_sentence_transformers_mean_pooling_matches_transformers(encoders):
    model = encoders["bert-embed"]
    (got,) = run_engine_job(model, [{"pool": "embed", "prompts": SENTENCES}])
    vecs = _data(got)
    for text, vec in zip(SENTENCES, vecs):
        ids, _ = _tokenize(model, text)
        _close(vec, _unit(hf_hidden_states(model, ids).mean(axis=0)))
    assert float(vecs[0] @ vecs[1]) < 0.99


RERANK_JOBS = [
    {"pool": "score", "query": QUERY, "documents": DOCUMENTS},
    {"pool": "classify", "prompts": SENTENCES},
]


@pytest.fixture(scope="module")
def rerank_results(encoders):
    return run_engine_job(encoders["bert-rerank"], RERANK_JOBS)


def test_a_cross_encoder_scores_pairs_with_their_token_types(encoders, rerank_results):
    model = encoders["bert-rerank"]
    scores, probs = rerank_results
    for doc, (score,) in zip(DOCUMENTS, _data(scores)):
        ids, types = _tokenize(model, QUERY, doc)
        assert types is not None and 1 in types  # the pair has a second segment
        _close([score], _sigmoid(hf_classifier_logits(model, ids, types)))
        # Negative control: without the types the oracle disagrees.
        assert abs(score - _sigmoid(hf_classifier_logits(model, ids))[0]) > 1e-3
    for text, (p,) in zip(SENTENCES, _data(probs)):
        ids, _ = _tokenize(model, text)
        _close([p], _sigmoid(hf_classifier_logits(model, ids)))


# ------------------------------------------------------------------------ vLLM's CPU backend


@pytest.mark.full
def test_vllm_cpu_backend_gives_the_same_numbers(embedder, embed_results, encoders, rerank_results):
    picked = [0, 3]  # the mixed batch, matryoshka
    theirs = run_engine_job(
        embedder, [EMBED_JOBS[i] for i in picked], engine=DECODER_ENGINE, backend="cpu"
    )
    for i, cpu in zip(picked, theirs):
        for a, b in zip(_data(embed_results[i]), _data(cpu)):
            _close(a, b)
    cpu_scores, cpu_probs = run_engine_job(encoders["bert-rerank"], RERANK_JOBS, backend="cpu")
    for ours, cpu in ((rerank_results[0], cpu_scores), (rerank_results[1], cpu_probs)):
        _close(np.concatenate(_data(ours)), np.concatenate(_data(cpu)))
