"""`fleetrl tinker` as a process, SIGKILLed between an SDK client's calls and started again.

What is guaranteed (docs/tinker.md): training runs live in the process, checkpoints on disk. After a
SIGKILL the old training run's next call fails with `tinker.NotFoundError` naming it, never a step
on other weights; `create_training_client_from_state_with_optimizer` on the last `save_state`
resumes exactly what was saved (adapter, optimizer, step count).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker

from fleetrl.launcher.embedded import free_port, wait_for_port
from tests.tinker.test_tinker_api import ADAM, MODEL, SEQUENCE, datum, forward_logprobs, train

ROOT = Path(__file__).resolve().parents[2]


def start(port: int, run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FLEETRL_TINKER_OPEN_MODE": "true", "FLEETRL_TINKER_TORCH_THREADS": "1",
           "FLEETRL_TINKER_ALLOWED_MODELS": f'["{MODEL}"]', "FLEETRL_TRACING": "0"}
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fleetrl.services.tinker", "--listen", f"127.0.0.1:{port}",
                                 "--run-dir", str(run_dir)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_for_port("127.0.0.1", port, 120, proc)
    return proc


def test_a_server_sigkilled_between_calls_refuses_the_lost_run_and_resumes_the_saved_state(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "tinker.log"
    url = f"http://127.0.0.1:{port}"
    proc = start(port, tmp_path / "run", log)
    try:
        client = tinker.ServiceClient(base_url=url, api_key="tml-local")
        run = client.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
        train(run, 2)
        state = run.save_state("before-kill").result().path
        saved = forward_logprobs(run, SEQUENCE)
        train(run, 1)  # a step after the save: lost with the process
        moved = forward_logprobs(run, SEQUENCE)
        assert np.abs(moved - saved).max() > 1e-4
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        proc = start(port, tmp_path / "run", log)

        with pytest.raises(tinker.NotFoundError, match=f"model '{run.model_id}' not found"):
            run.forward_backward([datum(SEQUENCE)], "cross_entropy").result()
        with pytest.raises(tinker.NotFoundError, match=f"model '{run.model_id}' not found"):
            run.optim_step(ADAM).result()
        resumed = tinker.ServiceClient(base_url=url, api_key="tml-local") \
            .create_training_client_from_state_with_optimizer(state).result()
        np.testing.assert_allclose(forward_logprobs(resumed, SEQUENCE), saved, atol=1e-6)
        resumed.forward_backward([datum(SEQUENCE)], "cross_entropy").result()
        assert resumed.optim_step(ADAM).result().metrics["step:max"] == 3.0  # the saved 2, then this one
    finally:
        proc.kill()
        proc.wait(10)
    assert "Traceback" not in log.read_text()
