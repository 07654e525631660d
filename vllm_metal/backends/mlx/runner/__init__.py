"""The MLX model runner, one module per concern (see `model_runner.py`).

Homes for what comes next: `spec_decode/` (draft proposers and verification rows), `lora/`
(adapter weights and per-row adapter mapping), `pool/` (pooling heads for embed/classify), `mm/`
(encoder outputs merged at placeholder positions).
"""
