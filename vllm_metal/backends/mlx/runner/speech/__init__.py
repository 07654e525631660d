"""Speech-to-text on the MLX runner: the cross-attention inputs of encoder-decoder steps (Whisper;
the model kind is `model_states/encoder_decoder.py`, docs/speech-to-text.md)."""
