"""The MLX model runner, one module per concern (see `model_runner.py`): one runner for every
model kind, the kinds as strategies in `model_states/`, how a step ends in `output.py` (sampling
or `pool/`), and the features every kind may share: `spec_decode/`, `lora/`, `mm/` (media items),
`kv_connector.py`.
"""
