"""LoRA adapters on the MLX runner: PEFT checkpoints loaded per `LoRARequest`, linears wrapped
through the model adapter, rows of a batch mapped to their adapter. Not built yet:
`--enable-lora` is refused at startup by the capability table."""
