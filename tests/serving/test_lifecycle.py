"""Proves `vllm serve` stops cleanly on SIGTERM, as a user's `kill` sends it: the engine core tears
down and exits on its own (vLLM's process manager does not force-kill it), the server exits 0, and
no native extension reports leaked objects at exit (`vllm_metal.compat.engine_shutdown`)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.stops_main_server]

EXIT_TIMEOUT_S = 60


def test_sigterm_stops_the_engine_core_without_a_kill_or_a_leak_report(
    vllm_server, server_slot
) -> None:
    server = vllm_server
    # A streaming request in flight when the signal arrives: it is aborted, not waited for.
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    streaming = threading.Thread(
        target=lambda: requests.post(
            server.url("/v1/completions"), json=body, headers=server.headers, timeout=60
        ),
        daemon=True,
    )
    streaming.start()
    # The server now belongs to this test: the slot must not stop it again.
    server_slot.server = server_slot.key = None

    os.kill(server.process.pid, signal.SIGTERM)  # the API server only, as `kill PID` does
    returncode = server.process.wait(timeout=EXIT_TIMEOUT_S)
    server.stop()  # reaps what remains (nothing, if the test passes) and joins the log reader
    log = "\n".join(line for _, line in server.lines)

    assert returncode == 0, log[-4000:]
    assert "EngineCore: exiting busy loop" in log, log[-4000:]
    assert "force killing" not in log, log[-4000:]
    assert "leaked" not in log, log[-4000:]
