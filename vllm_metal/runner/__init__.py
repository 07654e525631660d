"""MLX model runner: per-request state, varlen batch packing, forward over a paged KV cache and
sampling through vLLM's own Sampler."""
