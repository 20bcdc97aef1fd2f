"""Multi-rank faults name the rank, within a bound: a SIGKILLed rank under ``trtllm-ext generate --tp 2``,
a rank blocked in a C-level receive, a rank that raises or exits mid-run, ranks given different batches.

Bounds are kept short with the collective timeout (``--rank-timeout`` / ``collective_timeout``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.ranks import RankJobError, launch_ranks
from tensorrt_llm_ext.testing.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")

ROOT = Path(__file__).resolve().parents[3]
SMALL = tiny_model(**{"model.target.vocab_size": 302, "model.target.capture_layers": [1], "max_batch_size": 2,
                       "max_seq_len": 64, "kv_cache_config.tokens_per_block": 4, "tensor_parallel_size": 2})
RANK_TIMEOUT_S = 5.0
BOUND_S = 25.0  # detection + stack dump + stop, on 2 shared CPU cores (rank start-up not counted)


def _wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_cli_names_a_sigkilled_rank(tmp_path):
    cfg = tmp_path / "small.yaml"
    cfg.write_text(json.dumps(load_config(**SMALL).model_dump(mode="json")))
    logs = tmp_path / "logs"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cli = subprocess.Popen([sys.executable, "-m", "tensorrt_llm_ext.cli", "generate", "--config", str(cfg),
                            "--max-new-tokens", "40", "--no-progress", "--rank-timeout", str(RANK_TIMEOUT_S),
                            "--log-dir", str(logs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                           text=True)
    try:
        log1 = logs / "rank1.log"
        # Mid-run: rank 1 has built its engine and bound its token selection.
        _wait_for(lambda: log1.exists() and "token selection" in log1.read_text(errors="replace"), 120,
                  "rank 1 to start generating")
        pid = json.loads((logs / "rank1.pid.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        out, err = cli.communicate(timeout=BOUND_S + 30)
        elapsed = time.monotonic() - t0
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 4, (out, err)
    assert "rank 1 was killed by signal 9 (SIGKILL)" in err, err
    assert "token selection" in err  # its last log lines are shown
    assert elapsed < BOUND_S, elapsed


def _blocked_in_c_receive():
    import torch.distributed as dist
    from mpi4py import MPI

    from tensorrt_llm_ext.distributed import init_from_mpi

    init_from_mpi(tp_size=2)
    if MPI.COMM_WORLD.Get_rank() == 1:
        print("rank 1: blocking in MPI recv", flush=True)
        MPI.COMM_WORLD.recv(source=0, tag=999)  # never sent: blocked inside C, no Python signal runs
    t = torch.ones(3)
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    return t.tolist()


def test_rank_blocked_in_c_receive_is_named():
    t0 = time.monotonic()
    with pytest.raises(RankJobError) as err:
        launch_ranks(2, _blocked_in_c_receive, timeout=300, collective_timeout=RANK_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    e = err.value
    assert e.headline.startswith("rank(s) [1] stopped responding (hung)"), str(e)
    hung = e.outcomes[1]
    assert hung.stopped_by_launcher and "in _blocked_in_c_receive" in hung.log_tail  # its stack, dumped
    assert e.outcomes[0].returncode == 1 and "Timed out" in e.outcomes[0].log_tail
    assert elapsed < RANK_TIMEOUT_S + BOUND_S + 15, elapsed  # + start-up of 2 ranks


def _engine_fault(case: str, config: dict, requests: list[dict]):
    import os

    from mpi4py import MPI

    from tensorrt_llm_ext.distributed import init_from_mpi
    from tensorrt_llm_ext.runtime.launch import GenerateJob, run_job
    from tensorrt_llm_ext.speculative.dspark_worker import DSparkWorker

    rank = MPI.COMM_WORLD.Get_rank()
    if case == "raise_before_init" and rank == 1:
        raise RuntimeError("injected: rank 1 fails before joining the process group")
    mapping = init_from_mpi(tp_size=2)
    if case == "exit_mid" and rank == 1:
        real = DSparkWorker.forward
        calls = {"n": 0}

        def forward(self, b):
            calls["n"] += 1
            if calls["n"] == 3:
                print("rank 1: os._exit(7) in step 3", flush=True)
                os._exit(7)
            return real(self, b)

        DSparkWorker.forward = forward
    if case == "other_batch" and rank == 1:
        requests = requests[:1]
    if case == "other_top_p":  # the same batch but for one sampling field: 0.5 vs 1.0 ended in a collective timeout
        requests = [dict(r, temperature=1.0, seed=5, top_p=0.5 if rank == 0 else 1.0) for r in requests]
    run_job(GenerateJob(config=config, requests=requests, modes=["speculative"]), mapping)
    return rank


@pytest.mark.parametrize("case, headline, detail", [
    ("raise_before_init", "rank 1 exited with code 1", "injected: rank 1 fails before joining"),
    ("exit_mid", "rank 1 exited with code 7", "os._exit(7) in step 3"),
    ("other_batch", "exited with code 1", "they differ in: the number of requests"),
    ("other_top_p", "exited with code 1", "they differ in: top_p)"),
])
def test_rank_fault_named(case, headline, detail):
    cfg = load_config(**SMALL).model_dump(mode="json")
    reqs = [dict(prompt_ids=[3, 4, 5], max_new_tokens=12), dict(prompt_ids=[7] * 9, max_new_tokens=12)]
    with pytest.raises(RankJobError) as err:
        launch_ranks(2, _engine_fault, case, cfg, reqs, timeout=300, collective_timeout=RANK_TIMEOUT_S)
    text = str(err.value)
    assert headline in err.value.headline and detail in text, text
    if case.startswith("other_"):  # both ranks refuse before any step, naming each rank's batch
        assert "TP ranks were given different batches" in text and "Timed out" not in text
        assert all(o.returncode == 1 and "different batches" in o.log_tail for o in err.value.outcomes), text
    if case == "other_batch":
        assert "rank 0: 2 requests" in text and "rank 1: 1 requests" in text
