"""``trtllm-ext serve --tp 2`` over MPI on loopback: rank 0 serves HTTP and broadcasts each plan; the
outputs equal TP 1's; a rank that dies makes the server answer 503 and exit non-zero (never hang)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tensorrt_llm_ext.runtime.config import load_config  # noqa: E402
from tensorrt_llm_ext.runtime.engine_loop import HEARTBEAT_S  # noqa: E402
from tensorrt_llm_ext.runtime.server import EXIT_ENGINE_FAILED  # noqa: E402
from tensorrt_llm_ext.runtime.tokenizer import resolve_tokenizer  # noqa: E402
from tensorrt_llm_ext.testing.server import (SMALL_SERVE_CONFIG as SMALL, free_port,  # noqa: E402
                                             reference_outputs, sample_bodies, start_server)

BODIES = sample_bodies(6, SMALL["model.target.vocab_size"])


def _reference(bodies):
    return reference_outputs(SMALL, bodies)

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                reason="needs 2 GPUs")


def test_tp2_server_equals_tp1_and_a_dead_rank_gives_503(tmp_path):
    bodies = BODIES[:6]
    reference = _reference(bodies)
    tok = resolve_tokenizer(load_config(**SMALL))  # the embedded model's, as serve resolves it
    cfg = tmp_path / "small.yaml"
    cfg.write_text(json.dumps(load_config(**SMALL).model_dump(mode="json", exclude_unset=True)))
    srv = start_server(["--config", str(cfg), "--tp", "2"], str(tmp_path / "server.log"), start_timeout=240)
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            # logprobs on the vocab-parallel head: computed on the shards, every rank in step
            answers = [c.post("/v1/completions", json={**b, "logprobs": 2}).json()["choices"][0] for b in bodies[:2]]
            health = c.get("/health").json()
        got = [a["token_ids"] for a in answers]
        assert got == reference[:2]
        for a in answers:
            lp = a["logprobs"]
            assert lp["tokens"] == [tok.decode([t]) for t in a["token_ids"]]
            assert all(-9999.0 <= v <= 0 for v in lp["token_logprobs"])
        # bodies[0] is greedy: each token is the argmax, so its logprob is the first of the top 2
        first = [list(top.items())[0] for top in answers[0]["logprobs"]["top_logprobs"]]
        assert [k for k, _ in first] == [tok.decode([t]) for t in answers[0]["token_ids"]]
        assert [v for _, v in first] == answers[0]["logprobs"]["token_logprobs"]
        batch = [httpx.post(srv.url + "/v1/completions", json={"prompt": [b["prompt"] for b in bodies[2:]],
                                                                "max_tokens": 3}, timeout=300)]
        # A batch prompt is one choice per prompt; greedy (no temperature), so compare with greedy TP 1.
        greedy = _reference([{"prompt": b["prompt"], "max_tokens": 3} for b in bodies[2:]])
        assert [ch["token_ids"] for ch in batch[0].json()["choices"]] == greedy
        assert [r["rank"] for r in health["ranks"]] == [0, 1]
        # Requests arriving while another decodes: each prefill launched behind a step and read back a plan later
        # (the overlap scheduler), every rank applying the same plans; the tokens are TP 1's.
        long = {"prompt": [3, 4], "max_tokens": 36}  # max_seq_len 40
        arriving = [dict(b, max_tokens=4) for b in bodies[2:5]]
        want = _reference([long] + arriving)
        got = {}

        def post(i, body):
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=300)
            got[i] = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text

        threads = [threading.Thread(target=post, args=(0, long))]
        threads[0].start()
        while httpx.get(srv.url + "/health", timeout=10).json()["active"] == 0 and threads[0].is_alive():
            time.sleep(0.02)
        threads += [threading.Thread(target=post, args=(i + 1, b)) for i, b in enumerate(arriving)]
        for th in threads[1:]:
            th.start()
        for th in threads:
            th.join(300)
        assert [got[i] for i in range(len(want))] == want
        result = {}

        def long_request():
            result["r"] = httpx.post(srv.url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 36},
                                     timeout=300)

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and httpx.get(srv.url + "/health", timeout=10).json()["active"] == 0:
            time.sleep(0.05)
        os.kill(health["ranks"][1]["pid"], signal.SIGKILL)
        t.join(180)
        r = result["r"]
        if r.status_code == 200:  # it finished before the kill landed: the next request sees the failure
            time.sleep(HEARTBEAT_S * 2)  # noticed within a heartbeat; the server exits 2 s later
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 4}, timeout=300)
        assert r.status_code == 503, r.text
        assert "engine failed" in r.json()["error"]["message"]
        rc = srv.wait(120)
        assert rc != 0, srv.log()[-3000:]
        # The dead rank is named by its supervisor; rank 0 ended by itself with the engine-failure code.
        assert "rank 1 was killed by signal 9 (SIGKILL)" in srv.log(), srv.log()[-3000:]
        assert f"rank 0 exited with code {EXIT_ENGINE_FAILED}" in srv.log(), srv.log()[-3000:]
    finally:
        srv.stop(30)


# The most a job may take from the line that reports its rank's fault to its end. The faults these tests guard
# against took 10 s or more after it (the interpreter's exit: a 10-s shutdown barrier, then MPI_Finalize waiting for
# a peer); the fixed path takes ~0.1 s. Timed from the fault, not the launch: the ranks' start-up (torch imports,
# engines built under the interpreter) took 35 s on CI's loaded 2-core machine where it takes 5 s alone.
FAULT_TO_EXIT_S = 8.0


class RanksRun:
    """What ``_serve_ranks`` saw: the exit code (None if killed after 90 s), the output, and when each line
    arrived (the ranks run unbuffered, so a line arrives when it is written)."""

    def __init__(self, rc: int | None, lines: list[tuple[float, str]], end: float):
        self.rc, self.lines, self.end = rc, lines, end
        self.out = "".join(line for _, line in lines)

    def seconds_after(self, needle: str) -> float:
        """Seconds from the first line holding ``needle`` to the job's end (inf when no line holds it)."""
        return next((self.end - t for t, line in self.lines if needle in line), float("inf"))


def _serve_ranks(tmp_path, rank_cmd: list[str]) -> RanksRun:
    """``rank_cmd`` on 2 ranks the way `serve --tp 2` runs its ranks once its checks passed (``launch_command``,
    ``TLLM_EXT_SERVE_RANK=1``)."""
    code = (f"import sys; from tensorrt_llm_ext.runtime.ranks import launch_command; "
            f"sys.exit(launch_command(2, {rank_cmd!r}, linger_s=30, env={{'TLLM_EXT_SERVE_RANK': '1'}}))")
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": root, "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in launcher.stdout),
                              daemon=True)
    reader.start()
    timed_out = False
    try:
        launcher.wait(timeout=90)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    end = time.monotonic()
    reader.join(30)
    return RanksRun(None if timed_out else launcher.returncode, lines, end)


def _small_config(tmp_path) -> str:
    cfg = tmp_path / "small.yaml"
    cfg.write_text(json.dumps(load_config(**SMALL).model_dump(mode="json", exclude_unset=True)))
    return str(cfg)


@pytest.mark.parametrize("fault", ["port_taken", "server_build_error"])
def test_tp2_rank_0_failing_after_its_followers_serve_ends_the_job_with_its_code(tmp_path, fault):
    """The ranks of `serve --tp 2` as its launcher runs them after its checks, rank 0 failing once the follower is in
    its loop: uvicorn cannot listen (the port taken after the launcher's check: its SystemExit 3) or an error while
    rank 0 builds its server (a --chat-template that is neither a file nor a template). The job exits with rank 0's
    code, as at TP 1 (3 / 1), within seconds of the fault (was: rank 0 went out through the interpreter's exit, 10 s
    at the shutdown barrier then MPI_Finalize waiting for the follower: exit 0 or 9 for the port, exit 9 after 43 s
    for the error)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    if fault == "port_taken":
        holder.listen(1)
    else:
        holder.close()
    extra = ["--chat-template", "neither-a-file-nor-a-template"] if fault == "server_build_error" else []
    try:
        run = _serve_ranks(tmp_path, [sys.executable, "-m", "tensorrt_llm_ext.cli", "serve", "--config",
                                      _small_config(tmp_path), "--tp", "2", "--port", str(port), *extra])
    finally:
        holder.close()
    expected = 3 if fault == "port_taken" else 1
    rc, out = run.rc, run.out
    fault_line = "address already in use" if fault == "port_taken" else "serve: rank 0 failed: ValueError"
    assert rc == expected and run.seconds_after(fault_line) < FAULT_TO_EXIT_S, (rc, out[-3000:])
    assert f"rank 0 exited with code {expected}" in out, out[-3000:]
    if fault == "server_build_error":
        assert "serve: rank 0 failed: ValueError: --chat-template" in out, out[-3000:]


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_rank_raising_while_the_ranks_start_ends_the_job_within_seconds(tmp_path, rank):
    """A rank raises while the ranks start, after joining MPI (its scheduler cannot be built: an error injected): the
    job exits 1 within seconds of the fault with that rank's traceback (was: the rank went out through the
    interpreter's exit, whose shutdown barrier and MPI_Finalize waited for a peer stuck in a start-up collective:
    126 s -- rank 0's collective timeout -- for rank 1, 22 s for rank 0)."""
    serve = ["serve", "--config", _small_config(tmp_path), "--tp", "2", "--port", str(free_port())]
    inject = textwrap.dedent(f"""
        import os, sys
        import tensorrt_llm_ext.runtime.scheduler as scheduler
        if os.environ["PMI_RANK"] == "{rank}":
            class Injected:
                def __init__(self, *args, **kwargs):
                    raise MemoryError("injected: rank {rank} failed while the ranks start")
            scheduler.Scheduler = Injected
        from tensorrt_llm_ext.cli import main
        sys.exit(main({serve!r}))
    """)
    run = _serve_ranks(tmp_path, [sys.executable, "-c", inject])
    rc, out = run.rc, run.out
    took = run.seconds_after(f"MemoryError: injected: rank {rank}")
    assert rc not in (None, 0) and took < FAULT_TO_EXIT_S, (rc, took, out[-3000:])
    assert f"rank {rank} exited with code 1" in out, out[-3000:]
    assert f"MemoryError: injected: rank {rank} failed while the ranks start" in out, out[-3000:]
