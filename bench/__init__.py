"""Side-by-side benchmarks of vllm-metal against mlx-lm and vLLM's CPU backend.

Entry point: ``python -m bench.run --out docs/benchmarks`` (see docs/benchmarks/README.md).
"""
