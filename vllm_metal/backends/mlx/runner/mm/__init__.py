"""Multimodal inputs on the MLX runner: the vision/audio encoder run per `mm_features` entry,
an encoder cache within vLLM's budget, and the embeddings merged at `PlaceholderRange`
positions through the adapter's `embed` -> `forward(input_embeds)` entry. Not built yet."""
