"""Pooling models on the MLX runner (`--runner pooling`): embeddings, classification, scoring.

`pooling.py` is the output stage that ends a step at the hidden states and pools them (for every
model kind that pools: decoders on the paged KV cache, encoder-only models without one);
`heads.py` builds vLLM's own pooler over the hidden states, with the model's classifier.
"""
