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
from tensorrt_llm_ext.runtime.ranks import RankJobError, launch_ranks, run_on_ranks
from tensorrt_llm_ext.testing.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")

ROOT = Path(__file__).resolve().parents[3]
SMALL = tiny_model(**{"model.target.vocab_size": 302, "model.target.capture_layers": [1], "max_batch_size": 2,
                       "max_seq_len": 64, "kv_cache_config.tokens_per_block": 4, "tensor_parallel_size": 2})
RANK_TIMEOUT_S = 5.0
BOUND_S = 25.0  # detection + stack dump + stop, on 2 shared CPU cores (rank start-up not counted)
# After T_c: 20 ms poll + 0.5 s for the peers' errors + 1 s stack dump + the kill (about 2 s), with a margin
# for 2 shared cores.
C_HANG_BOUND_S = 4.0
TERM_BOUND_S = 10.0  # 5 s for the ranks to end after the forwarded signal, then the kill, on 2 shared cores


def _wait_for(pred, timeout: float, what: str, cli: subprocess.Popen | None = None, logs: Path | None = None):
    """Poll ``pred`` until ``timeout``; a launch (``cli``, its rank ``logs``) that ends first or never gets there
    fails with what it said: its exit status and output, and the tail of every rank log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if cli is not None and cli.poll() is not None:
            break
        time.sleep(0.1)
    detail = ""
    if cli is not None:
        if cli.poll() is None:
            cli.kill()
        out, err = cli.communicate(timeout=30)
        tails = {f.name: f.read_text(errors="replace")[-2000:] for f in sorted(logs.glob("*.log"))} if logs else {}
        detail = f"; the CLI exited {cli.returncode}: stdout {out[-2000:]!r} stderr {err[-4000:]!r}; rank logs {tails}"
    raise AssertionError(f"timed out waiting for {what}{detail}")


def _start_generate_tp2(tmp_path) -> tuple[subprocess.Popen, Path]:
    """``generate --tp 2`` (the small config's TP) as a child process keeping its rank logs: ``(cli, log dir)``."""
    cfg = tmp_path / "small.yaml"
    cfg.write_text(json.dumps(load_config(**SMALL).model_dump(mode="json")))
    logs = tmp_path / "logs"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cli = subprocess.Popen([sys.executable, "-m", "tensorrt_llm_ext.cli", "generate", "--config", str(cfg),
                            "--max-new-tokens", "40", "--no-progress", "--rank-timeout", str(RANK_TIMEOUT_S),
                            "--log-dir", str(logs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                           text=True)
    return cli, logs


def test_cli_names_a_sigkilled_rank(tmp_path):
    cli, logs = _start_generate_tp2(tmp_path)
    try:
        log1 = logs / "rank1.log"
        # Mid-run: rank 1 has built its engine and bound its token selection.
        _wait_for(lambda: log1.exists() and "token selection" in log1.read_text(errors="replace"), 120,
                  "rank 1 to start generating", cli, logs)
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


def _processes_naming(text: str) -> list[int]:
    """Pids of the live processes whose command line contains ``text`` (mpiexec, supervisors, ranks of a run)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "token selection"), (signal.SIGINT, "start-up")],
                         ids=["SIGTERM-mid-run", "SIGINT-at-start-up"])
def test_cli_passes_a_stop_signal_on_to_the_ranks(tmp_path, sig, when):
    """SIGTERM / SIGINT to ``generate --tp 2`` (mid-run, or while the ranks start): passed on to the ranks, waited
    for (5 s at most), the rest killed; exit 128 + the signal, nothing of the run left (was: exit 143 at once,
    mpiexec and the ranks ran on for about a minute)."""
    cli, logs = _start_generate_tp2(tmp_path)
    try:
        log1 = logs / "rank1.log"
        if when == "start-up":
            _wait_for(lambda: (logs / "rank1.pid.json").exists(), 120, "rank 1 to start", cli, logs)
        else:
            _wait_for(lambda: log1.exists() and when in log1.read_text(errors="replace"), 120,
                      "rank 1 to start generating", cli, logs)
        assert _processes_naming(str(logs))  # mpiexec, supervisors and ranks are up
        cli.send_signal(sig)
        t0 = time.monotonic()
        out, err = cli.communicate(timeout=TERM_BOUND_S + 30)
        elapsed = time.monotonic() - t0
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 128 + sig, (out, err)
    assert f"interrupted by {sig.name}: passed on to the 2 ranks" in err and "no rank left running" in err, err
    assert elapsed < TERM_BOUND_S, elapsed
    assert _processes_naming(str(logs)) == []


def _blocked_in_c(how: str, marker: str):
    import ctypes
    import time

    import torch.distributed as dist
    from mpi4py import MPI

    from tensorrt_llm_ext.distributed import init_from_mpi

    init_from_mpi(tp_size=2)
    if MPI.COMM_WORLD.Get_rank() == 1:
        print(f"rank 1: blocking in C ({how})", flush=True)
        with open(marker, "w") as f:
            f.write(str(time.time()))
        if how == "mpi_recv":
            MPI.COMM_WORLD.recv(source=0, tag=999)  # never sent: blocked inside C, no Python signal runs
        else:
            ctypes.CDLL(None).sleep(100000)  # interruptible: the launcher's stack-dump signal ends the sleep
    t = torch.ones(3)
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    return t.tolist()


@pytest.mark.parametrize("how", ["mpi_recv", "libc_sleep"])
def test_rank_blocked_in_c_receive_is_named(how, tmp_path):
    """A rank blocked in a C call is named as hung within ``T_c`` + about 2 s of the fault, also when the C
    call is interruptible and the stack dump wakes it (was: "rank 0 exited with code 1" and "rank 1 exited
    with code 1" for libc ``sleep``, and a bound of 45 s)."""
    marker = tmp_path / "blocked_at"
    with pytest.raises(RankJobError) as err:
        launch_ranks(2, _blocked_in_c, how, str(marker), timeout=300, collective_timeout=RANK_TIMEOUT_S)
    after_fault = time.time() - float(marker.read_text())
    e = err.value
    assert e.headline.startswith("rank(s) [1] stopped responding (hung): rank 0 timed out waiting for them"), str(e)
    hung = e.outcomes[1]
    assert hung.running_at_failure and "in _blocked_in_c" in hung.log_tail  # its stack, dumped from C
    assert hung.stopped_by_launcher or how == "libc_sleep"  # a woken sleep may end by itself after the dump
    assert "Timed out" in e.outcomes[0].error
    assert after_fault < RANK_TIMEOUT_S + C_HANG_BOUND_S, after_fault


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
    from tensorrt_llm_ext.runtime.requests import Request

    run_job(GenerateJob(config=config, requests=[Request(**r) for r in requests], modes=["speculative"]), mapping)
    return rank


@pytest.mark.parametrize("case, headline, detail", [
    ("raise_before_init", "rank 1 raised RuntimeError: injected: rank 1 fails before joining", "in _engine_fault"),
    ("exit_mid", "rank 1 exited with code 7", "os._exit(7) in step 3"),
])
def test_rank_fault_named(case, headline, detail):
    cfg = load_config(**SMALL).model_dump(mode="json")
    reqs = [dict(prompt_ids=[3, 4, 5], max_new_tokens=12), dict(prompt_ids=[7] * 9, max_new_tokens=12)]
    with pytest.raises(RankJobError) as err:
        launch_ranks(2, _engine_fault, case, cfg, reqs, timeout=300, collective_timeout=RANK_TIMEOUT_S)
    text = str(err.value)
    assert headline in err.value.headline and detail in text, text


def _different_batches(config: dict, requests: list[dict]) -> dict:
    import dataclasses

    from mpi4py import MPI

    from tensorrt_llm_ext.distributed import init_from_mpi
    from tensorrt_llm_ext.runtime.config import parse_config
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.requests import Request

    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()
    engine = Engine(parse_config(config), init_from_mpi(tp_size=2))
    agreed = [Request(**r) for r in requests]
    cases = {
        "other_batch": agreed[:1] if rank == 1 else agreed,
        # The same batch but for one sampling field: 0.5 vs 1.0 ended in a collective timeout, 0.5 vs 0.3 gave
        # tokens matching neither.
        "other_top_p": [dataclasses.replace(r, sampling=SamplingParams(temperature=1.0, seed=5,
                                                                       top_p=0.5 if rank == 0 else 1.0))
                        for r in agreed],
    }
    out = {}
    for name, batch in cases.items():
        try:
            engine.generate(batch)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    out["agreed"] = [r.output_ids for r in engine.generate(agreed)[0]]  # then an agreed batch is served
    return out


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_ranks_given_different_batches_all_refuse(mpi_pool_executor):
    """Ranks whose batches differ (in size, or only in one sampling field) all raise before any step, naming
    each rank's batch and the field; the engine then serves an agreed batch on every rank."""
    cfg = load_config(**SMALL).model_dump(mode="json")
    reqs = [dict(prompt_ids=[3, 4, 5], max_new_tokens=4), dict(prompt_ids=[7] * 9, max_new_tokens=4)]
    out = run_on_ranks(mpi_pool_executor, _different_batches, cfg, reqs, timeout=300)
    for o in out:
        assert "they differ in: the number of requests" in o["other_batch"], o
        assert "rank 0: 2 requests" in o["other_batch"] and "rank 1: 1 requests" in o["other_batch"], o
        assert "they differ in: top_p)" in o["other_top_p"], o
    assert out[0]["agreed"] == out[1]["agreed"] and all(len(x) == 4 for x in out[0]["agreed"])
