"""Encoder-only models (BERT, XLM-RoBERTa) in MLX against transformers float32.

Each tiny checkpoint (`tests.fixtures.tiny_encoders`) gets a batch of mixed-length inputs,
including a text pair, packed into one `encode` call; every sequence's hidden states must equal
transformers' run of that sequence alone. Negative controls show that the comparison notices lost
token types and sequences that see each other.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures.tiny_encoders import KINDS, main, write_tiny_encoder
from vllm_metal.models.encoder import ENCODER_MODEL_TYPES, EncoderAdapter, load_encoder

# Mixed lengths (3 to ~40 tokens) and a text pair, as a cross-encoder sees them.
INPUTS: list[str | tuple[str, str]] = [
    "hi",
    (
        "The old lighthouse stood at the edge of the cliff, and every night its lamp turned slowly "
        "over the dark water."
    ),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    "Music travels through the air.",
]
PAIR = 2  # index of the text pair in INPUTS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-encoders")
    return {kind: write_tiny_encoder(root / kind, kind) for kind in KINDS}


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _load(path: Path, dtype: mx.Dtype = mx.float32) -> EncoderAdapter:
    return load_encoder(path, _config(path), dtype)


@functools.cache
def _tokenized(path: Path) -> list[dict[str, list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [dict(tokenizer(*x) if isinstance(x, tuple) else tokenizer(x)) for x in INPUTS]


@functools.cache
def _hf_model(path: Path) -> Any:
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    head = "ForSequenceClassification" in _config(path)["architectures"][0]
    cls = AutoModelForSequenceClassification if head else AutoModel
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def _hf_outputs(path: Path) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """transformers' last hidden states of each input run alone, and its logits if it has a
    classification head."""
    import torch

    model = _hf_model(path)
    base = getattr(model, model.base_model_prefix, model)
    hidden, logits = [], []
    with torch.no_grad():
        for enc in _tokenized(path):
            inputs = {k: torch.tensor([v]) for k, v in enc.items()}
            hidden.append(base(**inputs).last_hidden_state[0].numpy())
            if base is not model:
                logits.append(model(**inputs).logits[0].numpy())
    return hidden, (logits or None)


def _packed(path: Path, *, with_types: bool = True) -> tuple[mx.array, mx.array | None, list[int]]:
    encs = _tokenized(path)
    ids = [t for e in encs for t in e["input_ids"]]
    types = [t for e in encs for t in e.get("token_type_ids", [0] * len(e["input_ids"]))]
    lens = [len(e["input_ids"]) for e in encs]
    return (
        mx.array(ids, dtype=mx.int32),
        mx.array(types, dtype=mx.int32) if with_types else None,
        lens,
    )


def _split(hidden: mx.array, lens: list[int]) -> list[np.ndarray]:
    return np.split(np.array(hidden.astype(mx.float32)), np.cumsum(lens)[:-1])


def _max_error(got: list[np.ndarray], ref: list[np.ndarray]) -> list[float]:
    return [float(np.abs(g - r).max()) for g, r in zip(got, ref, strict=True)]


# --------------------------------------------------------------------------------------------------
# Parity with transformers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_packed_batch_matches_transformers_per_sequence(checkpoints, kind):
    path = checkpoints[kind]
    adapter = _load(path)
    ids, types, lens = _packed(path)
    assert min(lens) <= 5 and 25 <= max(lens) <= 40, lens
    hidden = adapter.encode(ids, types, lens)
    assert hidden.shape == (sum(lens), adapter.hidden_size)
    ref, _ = _hf_outputs(path)
    assert max(_max_error(_split(hidden, lens), ref)) < 1e-4


@pytest.mark.parametrize("kind", ["bert-cls", "xlmr-rerank"])
def test_classify_matches_transformers_logits(checkpoints, kind):
    path = checkpoints[kind]
    adapter = _load(path)
    ids, types, lens = _packed(path)
    hidden = adapter.encode(ids, types, lens)
    first_rows = mx.array(np.cumsum(lens) - np.array(lens))
    logits = np.array(adapter.classify(hidden[first_rows]))
    _, ref = _hf_outputs(path)
    assert adapter.num_labels == _hf_model(path).config.num_labels
    assert logits.shape == (len(INPUTS), adapter.num_labels)
    np.testing.assert_allclose(logits, np.stack(ref), atol=1e-4)


def test_sentence_transformers_mean_and_normalize_match(checkpoints):
    path = checkpoints["bert-embed"]
    modules = json.loads((path / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert json.loads((path / "1_Pooling/config.json").read_text())["pooling_mode_mean_tokens"]

    def mean_normalized(rows: list[np.ndarray]) -> np.ndarray:
        means = np.stack([r.mean(axis=0) for r in rows])
        return means / np.linalg.norm(means, axis=1, keepdims=True)

    ids, types, lens = _packed(path)
    ours = mean_normalized(_split(_load(path).encode(ids, types, lens), lens))
    ref = mean_normalized(_hf_outputs(path)[0])
    assert np.sum(ours * ref, axis=1).min() >= 0.9999
    # The oracle discriminates: different texts give clearly different embeddings.
    similarity = ref @ ref.T
    assert similarity[~np.eye(len(INPUTS), dtype=bool)].max() < 0.95


# --------------------------------------------------------------------------------------------------
# Negative controls: the comparisons above can fail
# --------------------------------------------------------------------------------------------------


def test_dropping_token_types_changes_the_pair(checkpoints):
    path = checkpoints["bert-cls"]
    ids, _, lens = _packed(path)
    assert any(_tokenized(path)[PAIR]["token_type_ids"])
    errors = _max_error(_split(_load(path).encode(ids, None, lens), lens), _hf_outputs(path)[0])
    assert errors[PAIR] > 0.1
    assert max(errors[:PAIR] + errors[PAIR + 1 :]) < 1e-4  # single texts have only type 0


@pytest.mark.parametrize("kind", ["bert-cls", "xlmr-embed"])
def test_one_long_sequence_is_not_the_batch(checkpoints, kind):
    # Packed as a single sequence, later texts attend to earlier ones and their positions continue.
    path = checkpoints[kind]
    ids, types, lens = _packed(path)
    merged = _split(_load(path).encode(ids, types, [sum(lens)]), lens)
    errors = _max_error(merged, _hf_outputs(path)[0])
    assert min(errors) > 0.1


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _rewrite_weights(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    change(weights)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    return dst


def test_a_missing_tensor_is_named(checkpoints, tmp_path):
    name = "bert.encoder.layer.1.output.dense.bias"
    path = _rewrite_weights(checkpoints["bert-cls"], tmp_path / "m", lambda w: w.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _load(path)


def test_an_unexpected_tensor_is_named_with_its_file(checkpoints, tmp_path):
    def add(weights):
        weights["roberta.encoder.layer.9.output.dense.bias"] = mx.zeros((128,))

    path = _rewrite_weights(checkpoints["xlmr-rerank"], tmp_path / "u", add)
    with pytest.raises(ValueError, match=r"layer\.9\.output\.dense\.bias.*model\.safetensors"):
        _load(path)


def test_bare_encoders_drop_the_unused_pooler(checkpoints):
    for kind in ("bert-embed", "xlmr-embed"):
        path = checkpoints[kind]
        assert "pooler.dense.weight" in mx.load(str(path / "model.safetensors"))
        adapter = _load(path)
        assert "pooler" not in adapter.model and adapter.num_labels is None
        with pytest.raises(ValueError, match="no classification head"):
            adapter.classify(mx.zeros((1, adapter.hidden_size)))
        assert adapter.model_type in ENCODER_MODEL_TYPES


def test_encode_refuses_bad_lengths(checkpoints):
    adapter = _load(checkpoints["xlmr-embed"])
    with pytest.raises(ValueError, match="seq_lens"):
        adapter.encode(mx.zeros((4,), dtype=mx.int32), None, [2, 3])
    with pytest.raises(ValueError, match="exceeds"):
        adapter.encode(mx.zeros((513,), dtype=mx.int32), None, [513])
    assert adapter.encode(mx.zeros((512,), dtype=mx.int32), None, [512]).shape == (512, 128)


# dtype -> (least cosine of a hidden state with float32's, logit tolerance); bfloat16's error
# measured ~0.0006 and ~0.09, float16's ~0.00001 and ~0.01.
LOW_PRECISION = {mx.bfloat16: (0.995, 0.25), mx.float16: (0.9995, 0.05)}


@pytest.mark.parametrize("dtype", list(LOW_PRECISION))
@pytest.mark.parametrize("kind", ["bert-cls", "xlmr-rerank"])
def test_low_precision_stays_close(checkpoints, kind, dtype):
    least_cosine, logit_tolerance = LOW_PRECISION[dtype]
    path = checkpoints[kind]
    adapter = _load(path, dtype)
    ids, types, lens = _packed(path)
    hidden = adapter.encode(ids, types, lens)
    assert hidden.dtype == dtype
    ref_hidden, ref_logits = _hf_outputs(path)
    for got, ref in zip(_split(hidden, lens), ref_hidden, strict=True):
        cosine = (
            np.sum(got * ref, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        )
        assert cosine.min() > least_cosine
    first_rows = mx.array(np.cumsum(lens) - np.array(lens))
    logits = adapter.classify(hidden[first_rows])
    assert logits.dtype == mx.float32  # the head runs in float32, as in vLLM
    np.testing.assert_allclose(np.array(logits), np.stack(ref_logits), atol=logit_tolerance)


def test_a_bfloat16_checkpoint_matches_transformers(tmp_path):
    path = write_tiny_encoder(tmp_path / "bf16", "bert-cls", dtype="bfloat16")
    assert mx.load(str(path / "model.safetensors"))["classifier.weight"].dtype == mx.bfloat16
    ids, types, lens = _packed(path)
    hidden = _load(path).encode(ids, types, lens)
    assert max(_max_error(_split(hidden, lens), _hf_outputs(path)[0])) < 1e-4


# --------------------------------------------------------------------------------------------------
# The checkpoints themselves
# --------------------------------------------------------------------------------------------------


def test_tokenizers_follow_bert_and_xlmr_pair_conventions(checkpoints):
    from tokenizers import Tokenizer

    bert = _tokenized(checkpoints["bert-cls"])[PAIR]
    sep = bert["input_ids"].index(3)  # [SEP]
    assert bert["input_ids"][0] == 2 and bert["input_ids"][-1] == 3  # [CLS] ... [SEP]
    assert bert["token_type_ids"] == [0] * (sep + 1) + [1] * (len(bert["input_ids"]) - sep - 1)
    xlmr = _tokenized(checkpoints["xlmr-rerank"])[PAIR]
    assert "token_type_ids" not in xlmr
    assert xlmr["input_ids"][0] == 0 and xlmr["input_ids"][-1] == 2  # <s> ... </s>
    assert xlmr["input_ids"].count(2) == 3  # <s> A </s> </s> B </s>
    for path in checkpoints.values():
        vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
        assert vocab == _config(path)["vocab_size"]


def test_the_writer_is_deterministic(checkpoints, tmp_path, capsys):
    assert main(["--kind", "xlmr-rerank", "--out", str(tmp_path / "again")]) == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "again").resolve())
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        original = (checkpoints["xlmr-rerank"] / name).read_bytes()
        assert (tmp_path / "again" / name).read_bytes() == original, name


# --------------------------------------------------------------------------------------------------
# Batching by length
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lens", [[5, 5, 5], [3, 200, 4, 180, 10, 9], [1], [512, 1, 1, 1, 1, 1, 1, 1, 1, 1]]
)
def test_length_groups_cover_every_sequence_and_bound_the_padding(lens: list[int]) -> None:
    from vllm_metal.models.encoder import length_groups

    lens_np = np.asarray(lens)
    groups = length_groups(lens_np)
    assert sorted(i for g in groups for i in g.tolist()) == list(range(len(lens)))
    for g in groups:
        padded = len(g) * lens_np[g].max()
        assert len(g) == 1 or lens_np[g].sum() >= padded / 2


def test_a_batch_of_very_different_lengths_equals_each_sequence_alone(checkpoints) -> None:
    adapter = _load(checkpoints["bert-embed"])
    lens = [3, 200, 4, 180, 10, 9]  # three length groups: packed rows are permuted and back
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 400, size=sum(lens)).astype(np.int32)
    together = _split(adapter.encode(mx.array(ids), None, lens), lens)
    pieces = np.split(ids, np.cumsum(lens)[:-1])
    alone = [_split(adapter.encode(mx.array(p), None, [len(p)]), [len(p)])[0] for p in pieces]
    assert max(_max_error(together, alone)) < 1e-4
