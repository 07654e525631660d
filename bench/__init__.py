"""Side-by-side benchmarks of vllm-metal against mlx-lm and vLLM's CPU backend.

Entry point: ``python -m bench.run`` (``--list`` names the suites; see docs/benchmarks/README.md).
"""
