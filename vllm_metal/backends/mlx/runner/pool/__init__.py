"""Pooling models on the MLX runner (`--runner pooling`): embeddings, classification, scoring.

`runner.py` is the pooling runner (decoders on the paged KV cache, encoder-only models without
one); `heads.py` builds vLLM's own pooler over the hidden states, with the model's classifier.
"""
