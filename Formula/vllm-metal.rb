# Homebrew formula: vLLM 0.32.0 with the vllm-metal platform plugin in a private virtualenv.
# With this repository tapped (brew tap vllm-project/vllm-metal URL): brew install vllm-metal
class VllmMetal < Formula
  include Language::Python::Virtualenv

  desc "Serve LLMs with vLLM on Apple Silicon (MLX model runner, native Metal kernels)"
  homepage "https://github.com/vllm-project/vllm-metal"
  url "https://github.com/vllm-project/vllm-metal.git",
      tag: "v0.1.0"
  license "Apache-2.0"
  head "https://github.com/vllm-project/vllm-metal.git", branch: "main"

  depends_on "cmake" => :build
  depends_on arch: :arm64
  depends_on :macos
  depends_on "python@3.12"

  # vLLM, torch and MLX bring ~150 packages with exact pins among them (see pyproject.toml);
  # they are resolved by pip at install time rather than listed as resources here.
  def install
    python = Formula["python@3.12"].opt_bin/"python3.12"
    virtualenv_create(libexec, python)
    pip = [libexec/"bin/python", "-m", "pip", "install", "--no-cache-dir"]

    # The native extension is compiled against the MLX and nanobind it will run with, so they
    # go in first and the plugin is built without build isolation.
    system(*pip, "setuptools>=69", "wheel", "nanobind==3.1.0", "mlx==0.32.4")
    # No macOS wheels of vLLM exist: pip builds its source release, which targets the CPU on macOS.
    with_env(VLLM_TARGET_DEVICE: "cpu") do
      system(*pip, "vllm==0.32.0", "torch==2.13.0")
    end
    system(*pip, "--no-build-isolation", buildpath)

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
    system bin/"vllm-metal-python", "-c", "import vllm_metal"
    assert_match "0.32.0", shell_output("#{bin}/vllm --version")
    platform = shell_output(
      "#{bin}/vllm-metal-python -c 'from vllm.platforms import current_platform as p; " \
      "print(type(p).__name__)'",
    )
    assert_match "MetalPlatform", platform
  end
end
