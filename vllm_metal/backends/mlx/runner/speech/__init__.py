"""Speech-to-text on the MLX runner: encoder-decoder steps for Whisper (docs/speech-to-text.md)."""
