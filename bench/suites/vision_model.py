"""The vision suite's checkpoint (an Idefics3 shaped like SmolVLM, random weights, or the tests'
tiny one with --quick) and the vision-tower profile, a stage in a process of its own:

    python -m bench.suites.vision_model --model DIR --json OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.suites.vision_servers import DTYPE

WEIGHT_SEED = 0
# SmolVLM-256M's text widths at 10 layers, a SigLIP-base-wide vision tower at 6 layers.
FULL_SIZE = {
    "text_hidden": 576, "text_intermediate": 1536, "text_layers": 10,
    "text_heads": 9, "text_kv_heads": 3,
    "vision_hidden": 768, "vision_intermediate": 3072, "vision_layers": 6, "vision_heads": 12,
}  # fmt: skip
# SmolVLM's image geometry, one tile per image: `tiny_idefics3`'s module constants while writing.
FULL_GEOMETRY = {
    "TILE_SIZE": 512, "PATCH_SIZE": 16, "SCALE_FACTOR": 4,
    "LONGEST_EDGE": 512, "IMAGE_SEQ_LEN": (512 // 16) ** 2 // 4**2,
}  # fmt: skip
# `WeightInit` spreads far narrower than the tiny model's (0.3 for every matrix): at these widths
# those make a chaotic model whose float32 rounding decides greedy tokens. Measured with
# transformers on this checkpoint, float32 logits differ from float64 ones by ~1e-5 here (top-2 gaps
# >= 1.6e-3 over 6 images x 64 tokens) against 5e-2 at the tiny spreads scaled to these widths
# (0.2), where 8 of 41 images' answers differed between the two backends in a first run. The
# connector's 12,288 inputs (768 x 4 x 4) keep its output as loud as the tiny model's 256 do
# (0.05 x sqrt(256) ~ 0.0072 x sqrt(12288)); the end-of-utterance and markup output rows are
# narrowed in proportion to the other rows.
FULL_INIT = {"matrix_std": 0.05, "connector_std": 0.0072, "eos_head_std": 0.1,
             "markup_head_std": 0.002}  # fmt: skip

# ------------------------------------------------------------------------------ checkpoint


@contextmanager
def _tile_geometry(constants: dict[str, int]) -> Iterator[None]:
    """`tiny_idefics3` writes 32x32 tiles of 8x8 patches from module constants; set others."""
    from unittest import mock

    from tests.fixtures import tiny_idefics3

    with mock.patch.multiple(tiny_idefics3, **constants):
        yield


def write_vision_model(work: Path, quick: bool) -> Path:
    """Write (or reuse) the benchmark checkpoint (`--quick`: the tests' tiny Idefics3)."""
    from tests.fixtures.tiny_idefics3 import ModelSize, WeightInit, write_tiny_idefics3

    name = "idefics3-tiny-test" if quick else "idefics3-smolvlm-shaped-random"
    path = Path(work) / "models" / f"{name}-s{WEIGHT_SEED}-{DTYPE}"
    stamp = {"kind": "idefics3", "quick": quick, "dtype": DTYPE, "seed": WEIGHT_SEED, "format": 2}
    if not quick:
        stamp.update(size=FULL_SIZE, geometry=FULL_GEOMETRY, init=FULL_INIT)
    stamp_file = path / "bench_model.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return path
    if quick:
        write_tiny_idefics3(path, DTYPE, WEIGHT_SEED)
    else:
        with _tile_geometry(FULL_GEOMETRY):
            write_tiny_idefics3(path, DTYPE, WEIGHT_SEED, size=ModelSize(**FULL_SIZE),
                                init=WeightInit(**FULL_INIT))  # fmt: skip
        vision = json.loads((path / "config.json").read_text())["vision_config"]
        got = (vision["image_size"], vision["patch_size"])
        if got != (FULL_GEOMETRY["TILE_SIZE"], FULL_GEOMETRY["PATCH_SIZE"]):
            raise RuntimeError(f"tiny_idefics3 ignored the tile geometry: {got}")
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return path


def describe_model(path: Path) -> dict[str, Any]:
    """Shapes, image geometry and parameter counts from the config files and safetensors header."""
    from bench.harness.checkpoints import safetensors_sizes

    config = json.loads((path / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    sizes = safetensors_sizes(path / "model.safetensors")

    def params(part: str) -> int:
        return sum(v for n, v in sizes.items() if part in n) // 4

    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    return {
        "path": str(path),
        "name": path.name,
        "architecture": config["architectures"][0],
        "dtype": DTYPE,
        "text_layers": text["num_hidden_layers"],
        "text_hidden": text["hidden_size"],
        "text_intermediate": text["intermediate_size"],
        "text_heads": text["num_attention_heads"],
        "text_kv_heads": text["num_key_value_heads"],
        "head_dim": text["head_dim"],
        "vocab_size": config["vocab_size"],
        "vision_layers": vision["num_hidden_layers"],
        "vision_hidden": vision["hidden_size"],
        "vision_intermediate": vision["intermediate_size"],
        "vision_heads": vision["num_attention_heads"],
        "tile_size": vision["image_size"],
        "patch_size": vision["patch_size"],
        "patches_per_tile": patches,
        "scale_factor": config["scale_factor"],
        "image_tokens_per_tile": patches // config["scale_factor"] ** 2,
        "longest_edge": preprocessor["size"]["longest_edge"],
        "num_parameters": sum(sizes.values()) // 4,
        "vision_parameters": params("vision_model."),
        "connector_parameters": params("connector."),
        "weight_bytes": sum(sizes.values()),
        "kv_bytes_per_token": 2
        * text["num_hidden_layers"]
        * text["num_key_value_heads"]
        * text["head_dim"]
        * 4,
    }


# ------------------------------------------------------------------------------ tower profile


def _best_ms(fn: Any, sync: Any, reps: int = 3) -> float:
    """Fastest of `reps` timed calls of `fn` after one untimed, `sync` making each call finish."""
    sync(fn())
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def tower_profile(args: argparse.Namespace) -> int:
    """Where a tile's time goes in the vision tower (in a process of its own, after the servers
    stop): the plugin's whole tower (`embed_multimodal`, one tile), one of its layers and that
    layer's operations in MLX, against the same operations in torch on one thread, as vLLM's CPU
    worker runs them on its one core (torch's ops, not necessarily vLLM's exact kernels). Inputs
    are random tensors of the layer's shapes; the MLX operations use the layer's own weights."""
    # The plugin's import sets up MLX's CPU BLAS, which has to precede mlx.core: the tower's
    # float32 matmuls then run on the same library as the plugin's engine.
    import vllm_metal  # noqa: F401, I001

    import mlx.core as mx
    from mlx import nn
    import numpy as np
    import torch
    import torch.nn.functional as F

    from vllm_metal.models import load_model

    config = json.loads((Path(args.model) / "config.json").read_text())
    adapter = load_model(args.model, compute_dtype=mx.float32, hf_config=config)
    layer = adapter.model.vision_model.encoder.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    vision = config["vision_config"]
    tile, hidden = vision["image_size"], vision["hidden_size"]
    inter, heads = vision["intermediate_size"], vision["num_attention_heads"]
    tokens = (tile // vision["patch_size"]) ** 2
    rng = np.random.default_rng(0)
    item = {"pixel_values": rng.uniform(-1, 1, (1, 3, tile, tile)).astype(np.float32),
            "pixel_attention_mask": np.ones((1, tile, tile), dtype=bool)}  # fmt: skip

    def normal(*shape: int) -> mx.array:
        x = mx.random.normal(shape)
        mx.eval(x)
        return x

    x, h = normal(1, tokens, hidden), normal(1, tokens, inter)
    q = normal(1, heads, tokens, hidden // heads)
    scores = (q @ q.transpose(0, 1, 3, 2)) * attn.scale
    mx.eval(scores)
    mlx_ms = {
        "layer norms (2)": _best_ms(lambda: [layer.layer_norm1(x), layer.layer_norm2(x)], mx.eval),
        "q, k, v, out projections": _best_ms(
            lambda: [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.out_proj(x)], mx.eval
        ),
        "attention (scaled_dot_product_attention)": _best_ms(
            lambda: mx.fast.scaled_dot_product_attention(q, q, q, scale=attn.scale), mx.eval
        ),
        "MLP fc1 + fc2": _best_ms(lambda: [mlp.fc1(x), mlp.fc2(h)], mx.eval),
        "GELU (tanh)": _best_ms(lambda: nn.gelu_approx(h), mx.eval),
    }
    mlx_parts = {
        "softmax inside attention": _best_ms(lambda: mx.softmax(scores, axis=-1), mx.eval),
        "one layer": _best_ms(lambda: layer(x), mx.eval),
        "whole tower, one tile": _best_ms(
            lambda: adapter.embed_multimodal("image", [item]), mx.eval
        ),
    }

    torch.set_num_threads(1)
    with torch.no_grad():
        tx, th = torch.randn(1, tokens, hidden), torch.randn(1, tokens, inter)
        tq = torch.randn(1, heads, tokens, hidden // heads)
        w_attn, b_attn = torch.randn(hidden, hidden), torch.randn(hidden)
        w1, w2 = torch.randn(inter, hidden), torch.randn(hidden, inter)
        b1, b2 = torch.randn(inter), torch.randn(hidden)
        norm_w, norm_b = torch.ones(hidden), torch.zeros(hidden)

        def nothing(_: Any) -> None:
            return None

        torch_ms = {
            "layer norms (2)": _best_ms(
                lambda: [F.layer_norm(tx, (hidden,), norm_w, norm_b) for _ in range(2)], nothing
            ),
            "q, k, v, out projections": _best_ms(
                lambda: [F.linear(tx, w_attn, b_attn) for _ in range(4)], nothing
            ),
            "attention (scaled_dot_product_attention)": _best_ms(
                lambda: F.scaled_dot_product_attention(tq, tq, tq), nothing
            ),
            "MLP fc1 + fc2": _best_ms(
                lambda: [F.linear(tx, w1, b1), F.linear(th, w2, b2)], nothing
            ),
            "GELU (tanh)": _best_ms(lambda: F.gelu(th, approximate="tanh"), nothing),
        }
    Path(args.json).write_text(json.dumps({
        "tile": tile, "tokens_per_tile": tokens, "hidden": hidden, "intermediate": inter,
        "heads": heads, "layers": vision["num_hidden_layers"],
        "mlx_ms": {k: round(v, 3) for k, v in mlx_ms.items()},
        "mlx_other_ms": {k: round(v, 3) for k, v in mlx_parts.items()},
        "torch_1_thread_ms": {k: round(v, 3) for k, v in torch_ms.items()},
    }, indent=2))  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.suites.vision_model", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--json", required=True)
    return tower_profile(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
