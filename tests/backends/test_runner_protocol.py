"""Every runner class meets the worker's `ModelRunner` protocol: each protocol method exists with the
same parameter names and kinds (what the worker's calls rely on), checked by `inspect.signature`."""

from __future__ import annotations

import inspect

import pytest

from vllm_metal.backends.protocol import ModelRunner


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(ModelRunner).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def _shape(signature: inspect.Signature) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in signature.parameters.values()]


def mismatches(runner_class: type) -> list[str]:
    """What `runner_class` lacks or declares differently from the protocol, in words."""
    problems = []
    for name, wanted in _protocol_methods().items():
        member = inspect.getattr_static(runner_class, name, None)
        if not inspect.isfunction(member):
            problems.append(f"{runner_class.__name__}.{name}: missing")
            continue
        got = inspect.signature(member)
        if _shape(got) != _shape(wanted):
            problems.append(f"{runner_class.__name__}.{name}{got} differs from {name}{wanted}")
    return problems


def _mlx_runner() -> type:
    from vllm_metal.backends.mlx.runner.model_runner import MLXModelRunner

    return MLXModelRunner


def _torch_runner() -> type:
    from vllm_metal.backends.torch.runner import TorchRunner

    return TorchRunner


def test_the_protocol_has_the_worker_calls() -> None:
    # A guard for the check itself: an empty method set would pass every runner.
    methods = _protocol_methods()
    assert {"load_model", "execute_model", "sample_tokens", "wake_up", "discard"} <= set(methods)
    assert _shape(methods["wake_up"]) == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("tags", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ]


@pytest.mark.parametrize("runner_class", [_mlx_runner, _torch_runner], ids=["mlx", "torch"])
def test_runner_meets_the_protocol(runner_class) -> None:
    assert mismatches(runner_class()) == []


def test_a_runner_that_drifts_is_caught() -> None:
    class Drifted:
        def load_model(self) -> None: ...
        def execute_model(self, output) -> None: ...  # renamed parameter
        def wake_up(self, *tags) -> None: ...  # another kind

    problems = mismatches(Drifted)
    assert any(p.startswith("Drifted.execute_model(self, output)") for p in problems)
    assert any(p.startswith("Drifted.wake_up(self, *tags)") for p in problems)
    assert "Drifted.sample_tokens: missing" in problems
    assert not any(p.startswith("Drifted.load_model") for p in problems)
