"""Code the subprocess tests of tests/ops run first in a child interpreter, to change what it finds."""

# Makes vllm_metal._C unimportable, as in a package installed with VLLM_METAL_SKIP_NATIVE=1.
BLOCK_EXTENSION = """
import importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm_metal._C":
            raise ImportError("No module named 'vllm_metal._C'")
sys.meta_path.insert(0, Block())
"""

# Pretends another MLX is installed than the extension was built for.
OTHER_MLX = """
import mlx.core
mlx.core.__version__ = "0.31.1"
"""
