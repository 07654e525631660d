"""Proves that a program which runs MLX work and then builds `vllm.LLM(...)` does not hang, that the
plugin picks `fork` only for vLLM's own command line (where no user code evaluates MLX before
the engine starts) and `spawn` for every other program, that a user's explicit choice stands, and
that `vllm serve` still forks its engine core and answers.

The hazard itself is checked too (MLX evaluated in a parent, then a forked child evaluates: the
child hangs), so that if MLX ever makes fork safe, this file says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import requests

import vllm_metal
from bench.harness.servers import free_port

ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 * 2**20}
ENGINE_TIMEOUT_S = 420  # a healthy run takes well under this on 2 busy cores; a hang never ends


def _env(**overrides: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_TARGET_DEVICE")
        and not k.startswith("VLLM_METAL_")
    }
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **overrides)
    return env


# --- the rule ---------------------------------------------------------------------------------


@pytest.fixture
def _no_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv("VLLM_METAL_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)


@pytest.mark.usefixtures("_no_start_method")
def test_a_users_program_gets_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/home/me/generate_then_serve.py"])
    assert not vllm_metal.is_vllm_cli()
    assert vllm_metal.register() == vllm_metal.PLATFORM_QUALNAME
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the CLI spawns too")
@pytest.mark.usefixtures("_no_start_method")
def test_the_vllm_command_line_gets_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(Path(sys.executable).parent / "vllm"), "serve", "m"])
    assert vllm_metal.is_vllm_cli()
    vllm_metal.register()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_python_dash_m_of_the_cli_counts_as_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    class Spec:
        name = "vllm.entrypoints.cli.main"

    class Main:
        __spec__ = Spec()

    monkeypatch.setattr(sys, "argv", ["/venv/lib/python3.11/site-packages/vllm/x/main.py"])
    monkeypatch.setitem(sys.modules, "__main__", Main())
    assert vllm_metal.is_vllm_cli()


@pytest.mark.usefixtures("_no_start_method")
@pytest.mark.parametrize("choice", ["fork", "spawn"])
def test_an_explicit_choice_stands(monkeypatch: pytest.MonkeyPatch, choice: str) -> None:
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", choice)
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/vllm", "serve"])
    vllm_metal.register()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == choice
    monkeypatch.setattr(sys, "argv", ["script.py"])
    vllm_metal.register()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == choice


# --- the hazard -------------------------------------------------------------------------------

HAZARD = textwrap.dedent(
    """
    import multiprocessing as mp
    import sys

    import mlx.core as mx

    def child(q):
        q.put(mx.ones(3).sum().item() + 1)

    if __name__ == "__main__":
        mx.eval(mx.ones(3) + 1)  # MLX has run in the parent
        ctx = mp.get_context(sys.argv[1])
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,), daemon=True)
        p.start()
        p.join(float(sys.argv[2]))
        print("CHILD", "hung" if p.is_alive() else f"exit={p.exitcode} value={q.get(timeout=5)}")
        if p.is_alive():
            p.kill()
    """
)


@pytest.mark.parametrize("method, expected", [("fork", "hung"), ("spawn", "exit=0 value=4.0")])
def test_forking_after_mlx_ran_hangs_the_child(tmp_path: Path, method: str, expected: str) -> None:
    script = tmp_path / "hazard.py"
    script.write_text(HAZARD)
    wait = "15" if method == "fork" else "120"
    proc = subprocess.run(
        [sys.executable, str(script), method, wait],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"CHILD {expected}" in proc.stdout, proc.stdout + proc.stderr[-2000:]


# --- the engine after MLX work ----------------------------------------------------------------

MLX_THEN_LLM = textwrap.dedent(
    """
    import json
    import sys

    if __name__ == "__main__":
        model, engine, touch_platform_first = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
        if touch_platform_first == "1":
            # vLLM and the platform are set up before any MLX work: the start method must
            # still be right when MLX runs afterwards.
            from vllm.platforms import current_platform
            print("PLATFORM", type(current_platform).__name__, flush=True)
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        # Real MLX work in this process: a forward pass and a few decode steps with mlx-lm.
        mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
        mlx_model, tokenizer = load(model)
        steps = generate_step(mx.array(tokenizer.encode("Hello")), mlx_model, max_tokens=3)
        print("MLX-LM", json.dumps([int(tok) for tok, _ in steps]), flush=True)

        from vllm import LLM, SamplingParams
        llm = LLM(model=model, seed=0, max_num_seqs=16, **engine)
        out = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=4, temperature=0))
        print("VLLM", json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "touch_platform_first",
    ["0", pytest.param("1", marks=pytest.mark.full)],  # the same start method either way
    ids=["mlx-first", "platform-first"],
)
def test_llm_after_mlx_work_does_not_hang(
    tmp_path: Path, tiny_model_dir, touch_platform_first: str
) -> None:
    model = tiny_model_dir("qwen3")
    script = tmp_path / "mlx_then_llm.py"
    script.write_text(MLX_THEN_LLM)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model), json.dumps(ENGINE), touch_platform_first],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # so a hung engine core can be killed with its parent
    )
    try:
        stdout, stderr = proc.communicate(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"MLX work then LLM(...) did not finish in {ENGINE_TIMEOUT_S} s (a hang):\n"
            f"{stdout[-2000:]}\n{stderr[-4000:]}"
        )
    assert proc.returncode == 0, stderr[-6000:]
    lines = dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)
    assert len(json.loads(lines["MLX-LM"])) == 3, stdout
    assert len(json.loads(lines["VLLM"])) == 4, stdout
    if touch_platform_first == "1":
        assert lines["PLATFORM"] == "MetalPlatform"


# --- vllm serve still forks -------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid ...; comm may hold spaces, so split after its ")".
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
    return kids


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.skipif(
    not Path("/proc/sys/kernel/randomize_va_space").exists()
    or Path("/proc/sys/kernel/randomize_va_space").read_text().strip() == "0",
    reason="tells fork from spawn by Linux's address-space randomization",
)
def test_vllm_serve_forks_its_engine_core_and_answers(tmp_path: Path, tiny_model_dir) -> None:
    model = tiny_model_dir("qwen3")
    port = free_port()
    log_path = tmp_path / "serve.log"
    cmd = [
        *(sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"),
        *("--max-model-len", "512", "--kv-cache-memory-bytes", str(64 * 2**20), "--seed", "0"),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_env(),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        healthy = False
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    healthy = True
                    break
            time.sleep(0.5)
        assert healthy, log_path.read_text(errors="replace")[-6000:]
        # A forked engine core still has its parent's auxiliary vector (vDSO and stack addresses,
        # randomized at every exec); a spawned one was exec'd afresh. (vLLM renames the process,
        # so its command line tells nothing.)
        parent_auxv = Path(f"/proc/{proc.pid}/auxv").read_bytes()
        kids = {
            kid: Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")[0].decode()
            for kid in _children(proc.pid)
        }
        engine = [kid for kid, title in kids.items() if "EngineCore" in title]
        assert len(engine) == 1, kids
        assert Path(f"/proc/{engine[0]}/auxv").read_bytes() == parent_auxv, (
            "the engine core was spawned, not forked"
        )
        reply = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": str(model), "prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
