"""The runner's view of an mlx-lm model: embeddings, a forward over hidden states, logits and
the kind of each layer.

The generic adapter fits mlx-lm architectures laid out as `Model.model` (embeddings, decoder
layers, final norm) plus a head, which is most of them. A family whose mlx-lm class differs
subclasses it in `families/<model_type>.py`. Mirrors mlx-lm 0.32.2.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import mlx.core as mx

from vllm_metal.compat import mlx_lm_attention as attention
from vllm_metal.models.layers import FULL_ATTENTION, LayerKind, kinds_from_caches, state_shapes_of
from vllm_metal.models.loaders import parameter_bytes

# A layer's token mixer: attention, or a linear-attention (state) layer in hybrid models.
_ATTENTION_ATTRS = ("self_attn", "attention", "attn", "linear_attn", "mamba")


@dataclass(frozen=True)
class LayerRange:
    """The decoder layers one pipeline stage runs, `start` to `end` of `total`: the first stage
    embeds the tokens, the last applies the final norm and the head."""

    start: int
    end: int
    total: int

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.total


class AbsentLayer:
    """Stands in a decoder's layer list for a layer another pipeline stage runs: it holds no
    weights (mlx-lm's module tree skips plain objects), only the layer's plain attributes, which
    mlx-lm's `make_cache` reads (Llama's `use_sliding`)."""

    def __init__(self, layer: Any):
        self._attributes = {k: v for k, v in vars(layer).items() if not k.startswith("_")}

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_attributes"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


def keep_layers(model: Any, layers: LayerRange) -> None:
    """Drop the decoder layers of `model` (an mlx-lm model, weights not evaluated yet) outside
    `layers`, before its weights are read: the stage loads only its own."""
    stack = model.model.layers
    if len(stack) != layers.total:
        raise ValueError(f"the model has {len(stack)} layers, the stage plan {layers.total}")
    for i in range(layers.total):
        if not layers.start <= i < layers.end:
            stack[i] = AbsentLayer(stack[i])


class ModelAdapter:
    # Whether `forward` takes M-RoPE positions (`multimodal.MultimodalAdapter`).
    uses_mrope = False
    # Whether `forward` takes the step's token ids (`token_ids=`, `[T, 1]`) beside the embeddings.
    takes_token_ids = False

    def __init__(self, model: Any, config: dict[str, Any]):
        self.model = model  # the mlx-lm `Model`
        self.config = config  # the checkpoint's config.json, as mlx-lm read it
        self.model_type: str = config.get("model_type", "")
        # The layers this process runs (pipeline parallelism, `keep_layers`); None: all of them.
        self.stage: LayerRange | None = None

    # ----------------------------------------------------------- structure

    @property
    def decoder(self) -> Any:
        """The decoder stack: embeddings, layers, final norm (mlx-lm's `Model.model`)."""
        return self.model.model

    @property
    def weight_bytes(self) -> int:
        return parameter_bytes(self.model)

    @property
    def num_layers(self) -> int:
        """The decoder layers this process runs (a pipeline stage's share)."""
        if self.stage is not None:
            return self.stage.end - self.stage.start
        return len(self.model.layers)

    def _stage_indices(self) -> range:
        stage = self.stage
        return range(len(self.model.layers)) if stage is None else range(stage.start, stage.end)

    @cached_property
    def attention_layer_names(self) -> list[str]:
        """The module name of each memory layer (a layer's attention or state mixer: one per
        decoder layer here; a family may declare none or several per layer, `layers.py`), as in
        the checkpoint's weights, in the order of `layer_kinds`."""
        path_of = {id(m): name for name, m in self.model.named_modules()}
        names = []
        for i in self._stage_indices():
            layer = self.model.layers[i]
            attr = next((a for a in _ATTENTION_ATTRS if hasattr(layer, a)), None)
            if attr is None or id(layer) not in path_of:
                raise ValueError(f"{self.model_type}: layer {i} has no attention module")
            names.append(f"{path_of[id(layer)]}.{attr}")
        return names

    def layer_kinds(self) -> list[LayerKind]:
        """From mlx-lm's `make_cache()` where the model declares one, else full attention; state
        layers carry their shapes (`layers.STATE_SHAPES`)."""
        if not hasattr(self.model, "make_cache"):
            return [FULL_ATTENTION] * self.num_layers
        kinds = kinds_from_caches(self.model.make_cache())
        if self.stage is not None:
            kinds = kinds[self.stage.start : self.stage.end]
        if any(kind.is_state for kind in kinds):
            state = LayerKind(is_state=True, state=state_shapes_of(self.model_type, self.config))
            kinds = [state if kind.is_state else kind for kind in kinds]
        return kinds

    def install_paged_attention(self) -> None:
        attention.route_module_sdpa(self.model)

    # ------------------------------------------------------------- compute

    def embed(self, token_ids: mx.array) -> mx.array:
        """Input embeddings of `token_ids` ([T, 1] -> [T, 1, hidden]), before any scaling the
        decoder applies itself (the form multimodal embeddings are merged in)."""
        return self.decoder.embed_tokens(token_ids)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        """Decoder hidden states after the final norm, from input embeddings."""
        if not self._takes_input_embeddings:
            raise NotImplementedError(
                f"{self.model_type}: the mlx-lm decoder takes no input embeddings; "
                "its family adapter must implement forward"
            )
        return self.decoder(None, caches, input_embeddings=input_embeds)

    def forward_with_aux(
        self, input_embeds: mx.array, caches: list[Any], layer_ids: tuple[int, ...]
    ) -> tuple[mx.array, mx.array]:
        """`forward`'s hidden states and the aux states an EAGLE-3 head reads: the input of each
        decoder layer in `layer_ids` (id L: the last layer's output before the final norm), joined
        in layer order (`[T, 1, n * hidden]`). For decoders that are embeddings -> layers -> final
        norm and nothing else (`families.eagle3.TARGET_TYPES`)."""
        wanted = set(layer_ids)
        h = input_embeds
        aux = [h] if 0 in wanted else []
        for i, (layer, cache) in enumerate(zip(self.decoder.layers, caches), start=1):
            h = layer(h, None, cache)
            if i in wanted:
                aux.append(h)
        return self.decoder.norm(h), mx.concatenate(aux, axis=-1)

    def decode_layers(self, h: mx.array, caches: list[Any]) -> mx.array:
        """The decoder's layers over packed rows, then its final norm: the rest of mlx-lm's
        decoder `__call__` once the embeddings are in, for families whose decoder takes no input
        embeddings. Rows are single tokens, so no mask (state layers take their sequences from
        their caches)."""
        for layer, cache in zip(self.decoder.layers, caches):
            h = layer(h, None, cache)
        return self.decoder.norm(h)

    def forward_stage(self, h: mx.array, caches: list[Any]) -> mx.array:
        """A pipeline stage's layers over packed rows (`decode_layers` over the stage's share):
        from the first stage's embeddings or the previous stage's hidden states, to the final
        norm on the last stage."""
        stage = self.stage
        assert stage is not None, "not a pipeline stage"
        layers = self.decoder.layers[stage.start : stage.end]
        for layer, cache in zip(layers, caches, strict=True):
            h = layer(h, None, cache)
        return self.decoder.norm(h) if stage.last else h

    def logits(self, hidden: mx.array) -> mx.array:
        """The model's head on selected hidden rows: tied embeddings, softcapping and all."""
        # mlx-lm's `Model.__call__` is `head(self.model(inputs, cache))`; swapping the decoder
        # for one call turns it into `head(hidden)` without restating each family's head.
        inner = self.model["model"]
        self.model["model"] = _Passthrough(inner, hidden)
        try:
            return self.model(None)
        finally:
            self.model["model"] = inner

    @cached_property
    def _takes_input_embeddings(self) -> bool:
        params = inspect.signature(type(self.decoder).__call__).parameters
        return "input_embeddings" in params


class _Passthrough:
    """Stands in for the decoder: returns the given hidden states, forwards attributes."""

    def __init__(self, inner: Any, hidden: mx.array):
        self._inner = inner
        self._hidden = hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
