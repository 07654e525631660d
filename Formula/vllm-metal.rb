# Homebrew formula: vLLM 0.32.0 with the vllm-metal platform plugin in a private virtualenv,
# installed from the release's prebuilt macOS arm64 wheels (no compiler is needed).
# With this repository tapped (brew tap vllm-project/vllm-metal URL): brew install vllm-metal
class VllmMetal < Formula
  include Language::Python::Virtualenv

  desc "Serve LLMs with vLLM on Apple Silicon (MLX model runner, native Metal kernels)"
  homepage "https://github.com/vllm-project/vllm-metal"
  url "https://github.com/vllm-project/vllm-metal.git",
      tag: "v0.32.0"
  license "Apache-2.0"
  head "https://github.com/vllm-project/vllm-metal.git", branch: "main"

  depends_on arch: :arm64
  depends_on :macos
  depends_on "python@3.12"

  # The release's find-links page: one link per wheel, each with its SHA-256, which pip verifies.
  WHEEL_INDEX = "https://github.com/vllm-project/vllm-metal/releases/download/v0.32.0/index.html".freeze

  # vLLM, torch and MLX bring ~150 packages with exact pins among them (see pyproject.toml);
  # pip resolves them from PyPI at install time rather than listing them as resources here.
  def install
    python = Formula["python@3.12"].opt_bin/"python3.12"
    virtualenv_create(libexec, python)
    pip = [libexec/"bin/python", "-m", "pip", "install", "--no-cache-dir", "--prefer-binary"]
    if build.head?
      # main has no release wheels: build the plugin from the checkout (needs Xcode's compilers).
      system(*pip, "setuptools>=69", "wheel", "nanobind==3.1.0", "mlx==0.32.4", "cmake")
      with_env(VLLM_TARGET_DEVICE: "cpu") do
        system(*pip, "vllm==0.32.0", "torch==2.13.0")
      end
      system(*pip, "--no-build-isolation", buildpath)
    else
      # Release assets are not served as text/html, which pip requires of a find-links URL.
      system "curl", "-fsSL", "-o", buildpath/"index.html", WHEEL_INDEX
      system(*pip, "--find-links", buildpath/"index.html",
             "--only-binary=vllm,vllm-metal,mlx,mlx-metal,torch",
             "vllm==0.32.0", "vllm-metal==0.32.0", "torch==2.13.0")
    end

    # mlx-vlm (vision-language models) without its declared dependencies, as install.sh does.
    mlx_vlm = Utils.safe_popen_read(libexec/"bin/python", "-m", "vllm_metal.models.loaders.mlx_vlm",
                                    "--requirement").strip
    system(*pip, "--no-deps", mlx_vlm)

    bin.install_symlink libexec/"bin/vllm"
    (bin/"vllm-metal-python").write_env_script libexec/"bin/python", PATH: "#{libexec}/bin:$PATH"
  end

  def caveats
    <<~EOS
      vllm serve now runs on the Metal GPU through the plugin, e.g.:
        vllm serve Qwen/Qwen3-0.6B
      The virtualenv's interpreter is available as vllm-metal-python.
    EOS
  end

  test do
    assert_match "0.32.0", shell_output("#{bin}/vllm --version")
    # The plugin activates: vLLM picks its platform, and the native extension with the Metal
    # kernels is the one in use.
    out = shell_output(
      "#{bin}/vllm-metal-python -c 'from vllm.platforms import current_platform as p; " \
      "from vllm_metal import _C; print(type(p).__name__, _C.HAS_METAL)'",
    )
    assert_match "MetalPlatform True", out
  end
end
