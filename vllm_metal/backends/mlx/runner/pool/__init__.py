"""Pooling on the MLX runner: hidden states of the scheduled rows reduced per request (last
token, mean, CLS) and the model's head for `embed` / `classify` tasks. Not built yet:
`--runner pooling` is refused at startup by the capability table."""
