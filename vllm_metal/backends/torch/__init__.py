"""The torch backend (`VLLM_METAL_BACKEND=mps`): vLLM's own model classes and weight loaders on a
torch device (`mps` on a Mac, `cpu` elsewhere), driven by vLLM's V1 model runner, with attention
through this project's paged kernels (`attention.py`, `kernels.py`).

Why vLLM's V1 runner and not Model Runner V2: docs/torch-backend.md.
"""
