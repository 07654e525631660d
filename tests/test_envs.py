"""Proves that every VLLM_METAL_* variable parses as documented and that bad values fail loudly.

Booleans accept the usual spellings, choices are case-insensitive, and a bad value raises a
ValueError that names the variable, both on access and in ``envs.validate()``.
"""

from __future__ import annotations

import pytest

from vllm_metal import envs

BOOL_VARS = [name for name, var in envs.ENV_VARS.items() if var.default in ("0", "1")]
CHOICE_VARS = {
    "VLLM_METAL_BACKEND": ("mlx", "mps"),
    "VLLM_METAL_DEVICE": ("auto", "gpu", "cpu"),
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in envs.ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_every_variable_is_a_vllm_metal_name_with_help() -> None:
    assert envs.ENV_VARS, "no variables declared"
    for name, var in envs.ENV_VARS.items():
        assert name.startswith("VLLM_METAL_"), name
        assert len(var.help) > 20, f"{name} has no real help text"


def test_unset_variables_take_their_documented_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, var in envs.ENV_VARS.items():
        monkeypatch.delenv(name, raising=False)
        value = getattr(envs, name)
        if name in BOOL_VARS:
            assert value is (var.default == "1"), name
            continue
        # The documented default, set explicitly, means what leaving the variable unset means.
        monkeypatch.setenv(name, var.default)
        assert getattr(envs, name) == value, name
        monkeypatch.delenv(name)


@pytest.mark.parametrize("name", BOOL_VARS)
@pytest.mark.parametrize(
    "raw, expected",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" on ", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
        ("", False),
    ],
)
def test_booleans(monkeypatch: pytest.MonkeyPatch, name: str, raw: str, expected: bool) -> None:
    monkeypatch.setenv(name, raw)
    assert getattr(envs, name) is expected


@pytest.mark.parametrize("name", BOOL_VARS)
@pytest.mark.parametrize("raw", ["2", "maybe", "enabled", "tru"])
def test_bad_boolean_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, raw: str
) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name) as info:
        getattr(envs, name)
    assert repr(raw) in str(info.value)
    with pytest.raises(ValueError, match=name):
        envs.validate()


@pytest.mark.parametrize("name, choices", CHOICE_VARS.items())
def test_choices_are_case_insensitive(
    monkeypatch: pytest.MonkeyPatch, name: str, choices: tuple[str, ...]
) -> None:
    assert name in envs.ENV_VARS
    for choice in choices:
        monkeypatch.setenv(name, f" {choice.upper()} ")
        assert getattr(envs, name) == choice
    monkeypatch.setenv(name, "")
    assert getattr(envs, name) == envs.ENV_VARS[name].default


@pytest.mark.parametrize("name, choices", CHOICE_VARS.items())
def test_bad_choice_names_the_variable_and_the_choices(
    monkeypatch: pytest.MonkeyPatch, name: str, choices: tuple[str, ...]
) -> None:
    monkeypatch.setenv(name, "cuda")
    with pytest.raises(ValueError, match=name) as info:
        getattr(envs, name)
    for choice in choices:
        assert choice in str(info.value)


def test_values_are_read_at_access_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert envs.VLLM_METAL_BACKEND == "mlx"
    monkeypatch.setenv("VLLM_METAL_BACKEND", "mps")
    assert envs.VLLM_METAL_BACKEND == "mps"


def test_validate_passes_on_good_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_METAL_DISABLE_NAX", "1")
    monkeypatch.setenv("VLLM_METAL_DEVICE", "cpu")
    envs.validate()


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        envs.VLLM_METAL_NO_SUCH_THING  # noqa: B018
    assert set(dir(envs)) == set(envs.ENV_VARS)


def test_register_with_vllm_declares_every_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.envs as vllm_envs

    table = dict(vllm_envs.environment_variables)
    monkeypatch.setattr(vllm_envs, "environment_variables", table)
    envs.register_with_vllm()
    for name in envs.ENV_VARS:
        assert name in table
    monkeypatch.setenv("VLLM_METAL_BACKEND", "mps")
    # vLLM's own accessor now reads our variable, parsed by our parser.
    assert vllm_envs.VLLM_METAL_BACKEND == "mps"


@pytest.mark.parametrize(
    "raw, expected",
    [("64", 64 * 2**30), ("512M", 512 * 2**20), ("2T", 2 * 2**40), ("1.5GiB", 3 * 2**29)],
)
def test_sizes(monkeypatch: pytest.MonkeyPatch, raw: str, expected: int) -> None:
    monkeypatch.setenv("VLLM_METAL_SSD_CACHE_SIZE", raw)
    assert envs.VLLM_METAL_SSD_CACHE_SIZE == expected


@pytest.mark.parametrize("raw", ["lots", "-1", "0", "12X"])
def test_bad_size_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("VLLM_METAL_SSD_CACHE_SIZE", raw)
    with pytest.raises(ValueError, match="VLLM_METAL_SSD_CACHE_SIZE"):
        envs.validate()
