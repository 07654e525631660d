"""Multimodal inputs on the MLX runner: the model's towers run on the items the scheduler
schedules for encoding, their outputs wait in an encoder cache (`embeddings.EncoderCache`) under
vLLM's item identifiers, and each step writes the rows its tokens take over their token
embeddings before the language model runs (`forward.hidden_states`). `mrope` places tokens on
M-RoPE's three streams, `spans` lets one image's tokens attend to each other in prefix-LM models,
and `profile.encoder_peak` is the towers' share of the step's memory peak."""
