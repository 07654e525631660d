"""Images through `vllm serve`: time to first token and decode tok/s of a vision-language model,
the plugin against vLLM's own CPU backend, one run.

The model is a random-weight Idefics3 (SmolVLM's architecture) written locally with
`vllm_metal.testing.tiny_idefics3.write_tiny_idefics3`. Its text model has SmolVLM-256M's widths
(hidden 576, MLP 1536, 9 query / 3 KV heads of 64) at 10 layers instead of 30; its vision tower is
SigLIP-base-wide (hidden 768, MLP 3072, 12 heads) at 6 layers instead of 12, and it sees images
as SmolVLM does: 512x512 tiles of 16x16 patches (1,024 patches), folded by the connector's pixel
shuffle (scale factor 4) into 64 image embeddings per tile. The image processor's longest edge is
512, so the 512x512 test image is one tile (SmolVLM-256M's processor first resizes to a longest
edge of 2,048: 16 tiles plus a global view, 17 times the encoder work), and the prompt is 85
tokens. The vocabulary is the tiny tokenizer's 808 tokens. Weights are drawn narrower than the
tiny model's (`FULL_INIT`), so float32 rounding does not decide greedy tokens; the answer still
depends on the image. The tile geometry is set by patching `tiny_idefics3`'s module constants
while it writes the checkpoint (`write_vision_model`); config.json is checked after.

Each backend is one `vllm serve` (`bench/serving.py`'s `Server`; `VLLM_TARGET_DEVICE=cpu` for
vLLM's), with the same arguments: `--dtype float32 --max-model-len 512 --max-num-seqs 8
--max-num-batched-tokens 1024 --kv-cache-memory-bytes 256M --limit-mm-per-prompt {"image": 1}`.
Both servers are started at once, then this process sends them the same rounds alternately (the
first backend alternating), each round once the other server's processes are idle again, through
the official `openai` client: a streamed `chat.completions.create` with one user message of an
`image_url` part (`tiny_image(seed, (512, 512))` as a PNG data URL) and the text "Describe this
image.", `temperature=0`, `max_tokens=64`, `extra_body={"ignore_eos": True, "return_token_ids":
True}`, `stream_options={"include_usage": True}`. Every request decodes exactly 64 tokens (checked
on the streamed token ids, the usage's `completion_tokens` and the server's
`vllm:generation_tokens_total`).

- TTFT: send -> first streamed chunk carrying a generated token, 1 concurrent request per round;
  median of the rounds. (This includes the API server's image decoding and preprocessing, the same
  vLLM code on both backends, the vision tower, the connector and the prompt's prefill.)
- Decode tok/s of a request: (generated tokens after the first chunk's) / (last token's arrival -
  first token's arrival). 1 concurrent: median over the TTFT rounds' requests (the same requests).
  8 concurrent: 8 requests released together (threads behind a barrier); median over all
  requests of all rounds. Beside it the round's output tok/s (all generated tokens / round wall
  time, first sent -> last token) and TTFT of the 8.
- Where the time goes: after the servers stop, a process of its own times the plugin's vision tower
  on one tile, and one of its layers operation by operation in MLX against the same operations in
  torch on one thread (`tower_profile`).

Every request gets an image of its own (a new seed), the same image for both backends in a round:
the same image again would hit vLLM's multimodal processor cache and prefix cache (its prompt's KV
blocks are keyed by the image's hash), and an image a real user sends is new. One warm-up round of
each size per backend comes first (their own images). The greedy token ids of every image must be
identical on both backends, or the run fails (exit code 1, the report written anyway, with the
first difference).

    python -m bench.vision --out docs/benchmarks            # ~6 min on 2 cores
    python -m bench.vision --quick --out /tmp/vision-quick  # tiny Idefics3, ~1 min: checks harness

`--quick`: the tests' tiny Idefics3 (`write_tiny_idefics3` defaults: 32x32 tiles, 2-layer towers),
64x64 images (4 tiles and a global view, 20 image embeddings), 16 tokens, one round per case, and
`--enforce-eager` on both servers (vLLM's CPU backend then skips its torch.compile warm-up, most of
its start-up).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.processes import settle, tree_cpu_seconds
from bench.speech_servers import wait_healthy
from bench.vision_servers import (
    CONCURRENCY,
    DTYPE,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    QUESTION,
    Answer,
    Backend,
    image_data_url,
    launch,
)

# Nothing here imports the plugin, MLX or torch at module level: the servers run in processes of
# their own, and this one only sends requests (and must stay idle between them).

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("plugin", "cpu")
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
FULL_CASE = {"image_size": 512, "max_tokens": 64}
QUICK_CASE = {"image_size": 64, "max_tokens": 16}


def cases() -> list[dict[str, Any]]:
    return [{"name": f"c{n}_{be}", "concurrency": n, "backend": be}
            for n in CONCURRENCY for be in BACKENDS]  # fmt: skip


# ------------------------------------------------------------------------------ checkpoint


@contextmanager
def _tile_geometry(constants: dict[str, int]) -> Iterator[None]:
    """`tiny_idefics3` writes 32x32 tiles of 8x8 patches from module constants; set others."""
    from unittest import mock

    from vllm_metal.testing import tiny_idefics3

    with mock.patch.multiple(tiny_idefics3, **constants):
        yield


def write_vision_model(work: Path, quick: bool) -> Path:
    """Write (or reuse) the benchmark checkpoint (`--quick`: the tests' tiny Idefics3)."""
    from vllm_metal.testing.tiny_idefics3 import ModelSize, WeightInit, write_tiny_idefics3

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
    from bench.model import _safetensors_sizes

    config = json.loads((path / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    sizes = _safetensors_sizes(path / "model.safetensors")

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


# ------------------------------------------------------------------------------ the whole run


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(answers: dict[str, list[Answer]], counted: dict[str, list[float]],
              max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """Whether every image's greedy tokens are the same on both backends, and every request
    decoded `max_tokens` tokens (streamed ids, the usage's count and the server's counter, per
    request of each round)."""
    by_image = {be: {a.image_seed: a for a in ans} for be, ans in answers.items()}
    seeds = sorted(by_image["plugin"])
    if sorted(by_image["cpu"]) != seeds:
        raise RuntimeError("the backends were sent different images")
    first = None
    differing = []
    for seed in seeds:
        p, c = by_image["plugin"][seed], by_image["cpu"][seed]
        at = _first_difference(p.token_ids, c.token_ids)
        if at is not None:
            differing.append(seed)
            if first is None:
                first = {
                    "image_seed": seed,
                    "token_index": at,
                    "plugin_tokens": p.token_ids,
                    "cpu_tokens": c.token_ids,
                    "plugin_text": p.text,
                    "cpu_text": c.text,
                }
    full_length = {
        be: all(len(a.token_ids) == max_tokens and a.completion_tokens == max_tokens for a in ans)
        and all(t == max_tokens for t in counted[be])
        for be, ans in answers.items()
    }
    distinct = len({tuple(by_image["plugin"][s].token_ids) for s in seeds})
    return {
        "images": len(seeds),
        "requests": {be: len(ans) for be, ans in answers.items()},
        "identical_across_backends": not differing,
        "images_differing": differing,
        "first_difference": first,
        "tokens_per_request": {
            be: sorted({len(a.token_ids) for a in ans}) for be, ans in answers.items()
        },
        "server_counted_per_request": {be: sorted(set(ts)) for be, ts in counted.items()},
        "every_request_full_length": full_length,
        "distinct_answers": distinct,
        "passed": not differing and all(full_length.values()),
    }


def _median(xs: list[float | None]) -> float | None:
    values = [x for x in xs if x is not None]
    return statistics.median(values) if values else None


def _case(n: int, backend: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    requests = [a.summary() for r in rounds for a in r["answers"]]
    spread = [max(a.chunk_times[0] for a in r["answers"]) - min(a.chunk_times[0]
              for a in r["answers"]) for r in rounds]  # fmt: skip
    return {
        "concurrency": n,
        "backend": backend,
        "rounds": len(rounds),
        "median_ttft_ms": 1000 * statistics.median(q["ttft_s"] for q in requests),
        "max_ttft_ms": 1000 * max(q["ttft_s"] for q in requests),
        "median_decode_tok_s": _median([q["decode_tok_s"] for q in requests]),
        "min_decode_tok_s": min(q["decode_tok_s"] or 0.0 for q in requests),
        "first_token_spread_s": [round(x, 3) for x in spread],
        "round_wall_s": [round(r["wall_s"], 3) for r in rounds],
        "output_tok_s": statistics.median(r["generated_tokens"] / r["wall_s"] for r in rounds),
        "tokens_per_request": sorted({q["generated_tokens"] for q in requests}),
        # Streamed chunks carrying tokens, per request: fewer than the tokens when the API server
        # (or this client) fell behind and sent several tokens in one chunk.
        "token_chunks_per_request": sorted({q["token_chunks"] for q in requests}),
        "server_generated_tokens": [r["generated_tokens"] for r in rounds],
        "prompt_tokens": sorted({q["prompt_tokens"] for q in requests if q["prompt_tokens"]}),
        "preemptions": sum(r["preemptions"] for r in rounds),
        "busy_after_round_s": statistics.median(r["busy_after_s"] for r in rounds),
        "server_cpu_s": [round(r["cpu_s"], 2) for r in rounds],
        "other_server_cpu_s": [round(r["other_cpu_s"], 2) for r in rounds],
        "load_average_1m": [round(r["load_1m"], 2) for r in rounds],
        "requests": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in q.items()}
            for q in requests
        ],
    }


def _server_info(server: Any, ready: dict[str, Any]) -> dict[str, Any]:
    from bench.run import blas_log_lines

    text = server.log_path.read_text(encoding="utf-8", errors="replace")
    bound = re.search(r"core ids=\[([^\]]*)\]", text)
    platform = ("MetalPlatform" if "vllm-metal: backend" in text
                else "CpuPlatform" if "cpu_model_runner" in text else None)  # fmt: skip
    return {**ready, "platform": platform, "phases_s": server.phases(),
            "command": server.cmd[2:], "log": str(server.log_path),
            "cpu_blas_logged": blas_log_lines(text),
            "omp_bound_cores": bound.group(1) if bound else None}  # fmt: skip


def _wait_group_gone(pgid: int, limit: float = 60.0) -> None:
    """Wait until every process of a stopped server's process group (its engine core too) has
    exited, so none of them is still running when the tower is profiled."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def run(args: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    case = QUICK_CASE if args.quick else FULL_CASE
    size, max_tokens = (case["image_size"],) * 2, case["max_tokens"]
    rounds = {1: args.c1_rounds, 8: args.c8_rounds}
    # Every request its own image: warm-up rounds first, then the measured ones, in send order.
    seeds = itertools.count()
    plan = {(n, k): [next(seeds) for _ in range(n)]
            for n in CONCURRENCY for k in range(-1, rounds[n])}  # fmt: skip
    urls = {s: image_data_url(s, size) for ss in plan.values() for s in ss}
    print(f"[vision] {len(urls)} images of {size[0]}x{size[1]}", flush=True)

    print("[vision] starting both servers", flush=True)
    started = time.perf_counter()
    servers = {be: launch(model, be, args.quick, logs / f"server-{be}.log") for be in BACKENDS}
    try:
        ready = {be: {"launch_to_health_s": wait_healthy(s, url, args.startup_timeout)}
                 for be, (s, url) in servers.items()}  # fmt: skip
        both_ready_s = time.perf_counter() - started
        backends = {be: Backend(be, s, url, args.timeout) for be, (s, url) in servers.items()}

        def round_robin(n: int, k: int) -> dict[str, dict[str, Any]]:
            """Round k of n concurrent requests on both backends, the first alternating; each
            starts once the previous round's server is idle."""
            images = [(s, urls[s]) for s in plan[n, k]]
            order = BACKENDS if k % 2 == 0 else BACKENDS[::-1]
            out = {}
            for be in order:
                own = backends[be].server.proc.pid
                other = servers[BACKENDS[1 - BACKENDS.index(be)]][0].proc.pid
                own_before, other_before = tree_cpu_seconds(own), tree_cpu_seconds(other)
                out[be] = backends[be].round(images, max_tokens)
                # CPU time the server used for the round, and the idle one meanwhile (none).
                out[be]["cpu_s"] = tree_cpu_seconds(own) - own_before
                out[be]["other_cpu_s"] = tree_cpu_seconds(other) - other_before
                out[be]["load_1m"] = os.getloadavg()[0]
                out[be]["busy_after_s"] = settle(own)
            return out

        answers: dict[str, list[Answer]] = {be: [] for be in BACKENDS}
        # Tokens the server counted (vllm:generation_tokens_total) per request, every round.
        counted: dict[str, list[float]] = {be: [] for be in BACKENDS}
        for n in CONCURRENCY:
            for be, r in round_robin(n, -1).items():
                ready[be].setdefault("warmup_s", []).append(round(r["wall_s"], 3))
                answers[be].extend(r["answers"])
                counted[be].append(r["generated_tokens"] / n)
        calls: dict[int, dict[str, list[dict]]] = {n: {be: [] for be in BACKENDS}
                                                  for n in CONCURRENCY}  # fmt: skip
        for n in CONCURRENCY:
            print(f"[vision] {rounds[n]} round(s) of {n} concurrent per backend", flush=True)
            for k in range(rounds[n]):
                for be, r in round_robin(n, k).items():
                    calls[n][be].append(r)
                    answers[be].extend(r["answers"])
                    counted[be].append(r["generated_tokens"] / n)
                    ttft = statistics.median(a.ttft_s for a in r["answers"])
                    print(f"[vision] c={n} {be}: TTFT {1000 * ttft:.0f} ms, "
                          f"round {r['wall_s']:.2f} s", flush=True)  # fmt: skip
    finally:
        for s, _ in servers.values():
            s.stop()
        for s, _ in servers.values():
            _wait_group_gone(s.proc.pid)

    out_cases = {f"c{n}_{be}": _case(n, be, calls[n][be]) for n in CONCURRENCY for be in BACKENDS}
    return {
        "model": describe_model(model),
        "workload": {
            **case,
            "question": QUESTION,
            "image_format": "PNG data URL",
            "images_per_request": 1,
            "image_seeds": {f"c{n}_round{k}": ss for (n, k), ss in plan.items()},
        },
        "servers": {be: _server_info(s, ready[be]) for be, (s, _) in servers.items()},
        "both_ready_s": round(both_ready_s, 1),
        "cases": out_cases,
        "agreement": agreement(answers, counted, max_tokens),
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    cs = report["cases"]
    big = max(CONCURRENCY)

    def ratio(key: str, n: int) -> float | None:
        p, c = cs[f"c{n}_plugin"][key], cs[f"c{n}_cpu"][key]
        return None if p is None or not c else round(p / c, 3)

    # plugin / vLLM CPU: TTFT below 1 and decode tok/s above 1 mean the plugin is faster.
    return {
        "ttft_ms": {be: round(cs[f"c1_{be}"]["median_ttft_ms"], 1) for be in BACKENDS},
        "decode_tok_s": {
            f"c{n}": {be: cs[f"c{n}_{be}"]["median_decode_tok_s"] for be in BACKENDS}
            for n in CONCURRENCY
        },
        "ratios": {
            "ttft_plugin_vs_cpu": ratio("median_ttft_ms", 1),
            **{f"decode_c{n}_plugin_vs_cpu": ratio("median_decode_tok_s", n) for n in CONCURRENCY},
            f"ttft_c{big}_plugin_vs_cpu": ratio("median_ttft_ms", big),
            f"output_c{big}_plugin_vs_cpu": ratio("output_tok_s", big),
        },
        "agreement_passed": report["agreement"]["passed"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--quick", action="store_true", help="tiny Idefics3: checks the harness")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "vllm-metal-bench"))
    p.add_argument("--c1-rounds", type=int, default=None, help="1-concurrent rounds: 8 (1)")
    p.add_argument("--c8-rounds", type=int, default=None, help="8-concurrent rounds: 3 (1)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--machine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    # The tower profile stage (a process of its own).
    p.add_argument("--tower-profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tower_profile:
        return tower_profile(args)
    if args.machine:
        from bench.machine import describe_machine

        Path(args.json).write_text(json.dumps(describe_machine(), indent=2))
        return 0
    if args.c1_rounds is None:
        args.c1_rounds = 1 if args.quick else 8
    if args.c8_rounds is None:
        args.c8_rounds = 1 if args.quick else 3

    from bench.run import _python_stage

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("vision-quick" if args.quick else "vision")
    logs.mkdir(parents=True, exist_ok=True)
    print("[vision] machine", flush=True)
    machine = _python_stage("bench.vision", ["--machine"], 600, logs / "machine.log")
    print("[vision] checkpoint", flush=True)
    model = write_vision_model(work, args.quick)
    result = run(args, model, logs)
    print("[vision] vision tower profile", flush=True)
    result["tower_profile"] = _python_stage("bench.vision", ["--tower-profile", "--model",
                                            str(model)], 600, logs / "tower.log")  # fmt: skip
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "dtype": DTYPE,
            "concurrency": list(CONCURRENCY),
            "c1_rounds": args.c1_rounds,
            "c8_rounds": args.c8_rounds,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "enforce_eager": args.quick,
            "command": " ".join(
                ["python -m bench.vision", *(argv if argv is not None else sys.argv[1:])]
            ),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        **result,
    }
    report["summary"] = summarize(report)
    from bench.vision_report import write_report

    write_report(report, Path(args.out))
    if not report["agreement"]["passed"]:
        print("[vision] the backends' greedy tokens disagree (or stopped short); see the report",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
