"""The per-rank supervisor of ``serve --tp N`` (``ranks.py --supervise-command``), without MPI: the rank
index comes from ``PMI_RANK`` as under MPICH. Exit codes, the dead rank named on stderr, the linger of a
follower (and none for rank 0), SIGTERM forwarded to the child, a signal without a name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _told(*stages: str) -> str:
    """Code for a rank that tells its supervisor these stages of its start-up (``JOB_JOINED``: init_from_mpi built its
    groups, every rank is past MPI_Init; ``SERVING``: start-up is over)."""
    return "".join(f"from tensorrt_llm_ext.runtime.rank_files import {s}, tell_supervisor; tell_supervisor({s})\n"
                   for s in stages)


SERVING = _told("JOB_JOINED", "SERVING")  # a serving rank's start-up


def _supervise(rank: int, child_code: str, linger_s: float = 0.0, told: str = SERVING, **popen) -> subprocess.Popen:
    """The supervisor over ``child_code``, run after ``told`` (by default: a rank of a serving job)."""
    env = {**os.environ, "PMI_RANK": str(rank), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tensorrt_llm_ext.runtime.rank_supervisor", "--supervise-command", str(linger_s), "--",
           sys.executable, "-c", told + textwrap.dedent(child_code)]
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, **popen)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, float]:
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err, time.monotonic() - t0


@pytest.mark.parametrize("rank", [0, 1])
def test_supervisor_passes_exit_codes_and_names_a_killed_rank(rank):
    rc, err, _ = _finish(_supervise(rank, "raise SystemExit(0)"))
    assert rc == 0 and "[ERROR]" not in err, err
    rc, err, _ = _finish(_supervise(rank, "raise SystemExit(3)"))
    assert rc == 3 and f"rank {rank} exited with code 3" in err, err
    rc, err, _ = _finish(_supervise(rank, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    assert rc == 128 + 9 and f"rank {rank} was killed by signal 9 (SIGKILL)" in err, err


def test_supervisor_survives_a_signal_without_a_name():
    """Real-time signals between SIGRTMIN and SIGRTMAX have no ``signal.Signals`` member: the supervisor
    still reports the rank and passes the code on (it raised ValueError while reporting before)."""
    signum = signal.SIGRTMIN + 6
    with pytest.raises(ValueError):
        signal.Signals(signum)
    rc, err, _ = _finish(_supervise(1, f"import os; os.kill(os.getpid(), {signum})"))
    assert rc == 128 + signum, err
    assert f"rank 1 was killed by signal {signum} (signal {signum})" in err, err
    assert "Traceback" not in err, err


def test_follower_lingers_and_rank_0_does_not():
    """A failed follower's supervisor stays ``linger_s`` (rank 0 must answer before the launcher reacts), then,
    nobody having ended the job, dies by SIGKILL: mpiexec ends a job whose process dies by a signal (was: it exited
    with the rank's code, and MPICH waited on for a rank 0 still in MPI_Init: `serve --tp 2` with rank 1 SIGKILLed
    at start-up hung for good); rank 0's end is passed on at once."""
    rc, err, took = _finish(_supervise(1, "raise SystemExit(5)", linger_s=1.5))
    assert rc == -signal.SIGKILL and took >= 1.5, (rc, took, err)
    assert "rank 1 exited with code 5" in err and "rank 0 did not end the job within 1.5 s" in err, err
    rc, err, took = _finish(_supervise(0, "raise SystemExit(5)", linger_s=30))
    assert rc == 5 and took < 15, (rc, took, err)


def test_a_follower_that_fails_while_the_job_starts_passes_its_code_on_at_once():
    """Every rank joined MPI, start-up not over (no request can be in flight): a failed follower's code is passed on
    at once, no linger, no SIGKILL -- mpiexec then aborts the ranks in MPI itself (was: 30 s, then SIGKILL)."""
    rc, err, took = _finish(_supervise(1, "raise SystemExit(2)", linger_s=30, told=_told("JOB_JOINED")))
    assert rc == 2 and took < 15, (rc, took, err)
    assert "rank 1 exited with code 2" in err and "did not end the job" not in err, err


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_ends_before_the_job_joined_mpi_takes_the_job_down_at_once(rank):
    """A rank that ends before every rank joined MPI (SIGKILLed or failing while it starts): its supervisor reports it
    and dies by SIGKILL at once, rank 0's and a follower's alike, without the follower's linger -- mpiexec ends a job
    on a death by a signal, while a peer that reaches MPI_Init after an exit by code waits there for good (was: rank
    0 SIGKILLed 0.5 s into `serve --tp 2` hung it; a follower took its 30 s linger)."""
    for child in ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "raise SystemExit(5)"):
        rc, err, took = _finish(_supervise(rank, child, linger_s=30, told=""))
        assert rc == -signal.SIGKILL and took < 15, (child, rc, took, err)
        assert f"rank {rank} ended before every rank had joined MPI: ending the job" in err, err


def _launch_2_ranks(tmp_path, rank_code: str, signal_after_s: float | None = None,
                    sig: int = signal.SIGTERM) -> tuple[int | None, str, float, bool]:
    """``launch_command`` (serve --tp N's launcher, follower linger 30 s) on 2 real MPI ranks running ``rank_code``
    (each writes ``rank<r>.pid`` first); ``signal_after_s``: ``sig`` to the launcher once both ranks run, after that
    long. Returns (exit code or None after 40 s, its stderr, seconds from the start or the signal, whether a rank
    outlived the job)."""
    code = textwrap.dedent(f"""
        import os
        _pid_file = os.path.join({str(tmp_path)!r}, "rank%s.pid" % os.environ["PMI_RANK"])
        with open(_pid_file + ".partial", "w") as _f:
            _f.write(str(os.getpid()))
        os.replace(_pid_file + ".partial", _pid_file)  # whole or absent: a rank killed mid-write leaves no empty file
    """) + textwrap.dedent(rank_code)
    launcher_code = (f"import sys; from tensorrt_llm_ext.runtime.ranks import launch_command; "
                     f"sys.exit(launch_command(2, [sys.executable, '-c', {code!r}], linger_s=30))")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if signal_after_s is not None:
            deadline = time.monotonic() + 30
            while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(signal_after_s)
            launcher.send_signal(sig)
        rc, err, took = _finish(launcher, timeout=40)
    except subprocess.TimeoutExpired:
        rc, err, took = None, "", 40.0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        time.sleep(0.5)
        left = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if _alive(int(p.read_text()))]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    return rc, err, took, bool(left)


def test_serve_tp2_whose_rank_0_ends_before_its_peer_joins_mpi_exits_at_once(tmp_path):
    """Rank 0 ends at once (as when SIGKILLed while it imports), rank 1 reaches MPI_Init 2 s later. The job ends
    non-zero within seconds, naming rank 0, nothing left (was: mpiexec waited for good, rank 1 spinning in MPI_Init)."""
    rc, err, took, left = _launch_2_ranks(tmp_path, """
        import os, time
        if os.environ["PMI_RANK"] == "0":
            os._exit(5)
        time.sleep(2)
        from mpi4py import MPI
        time.sleep(60)
    """)
    assert rc not in (None, 0) and took < 20, (rc, took, err)
    assert "rank 0 exited with code 5" in err and "rank 0 ended before every rank had joined MPI" in err, err
    assert not left, "rank 1 outlived the job"


# Both ranks join MPI and say so (as init_from_mpi does), then start up for a minute.
_JOINED_STARTING = "from mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n" + _told("JOB_JOINED")


def test_serve_tp2_whose_ranks_all_refuse_at_start_up_exits_with_their_code_at_once(tmp_path):
    """Every rank refuses at start-up with the same code (a checkpoint with a NaN weight: exit 2): the job exits 2
    within seconds (was: the follower's supervisor lingered 30 s for requests that could not exist yet, then died by
    SIGKILL: exit 9 after 33 s)."""
    rc, err, took, left = _launch_2_ranks(tmp_path, _JOINED_STARTING + "raise SystemExit(2)\n")
    assert rc == 2 and took < 15, (rc, took, err)
    assert "rank 1 exited with code 2" in err and "did not end the job" not in err, err
    assert not left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_serve_tp2_while_the_ranks_start_exits_128_plus_it_at_once(tmp_path, sig):
    """SIGTERM / SIGINT (Ctrl-C) to the launcher while the ranks start (importing, before MPI_Init): passed on (as
    SIGTERM), every rank ends by it, the launcher exits 128 + the signal it got (143 / 130, as at TP 1) within seconds,
    nothing left (was: the follower's supervisor lingered 30 s as for a lost rank, then died by SIGKILL: exit 9 after
    30.4 s; then 143 for Ctrl-C)."""
    rc, err, took, left = _launch_2_ranks(tmp_path, "import time; time.sleep(60)\nfrom mpi4py import MPI\n",
                                          signal_after_s=0.5, sig=sig)
    assert rc == 128 + sig and took < 15, (rc, took, err)
    assert "did not end the job" not in err, err
    assert not left


def test_serve_tp2_exits_with_rank_0s_code_after_its_follower_ended_cleanly(tmp_path):
    """Rank 0 ends the job with code 3 (uvicorn could not listen: the port was taken after the launcher's check)
    half a second after its follower left with 0 (the loop's stop): the launcher exits 3, rank 0's code, as at TP 1
    (was: mpiexec's own code, 0 or 9 -- a server that never listened reported success)."""
    rc, err, took, left = _launch_2_ranks(tmp_path, _JOINED_STARTING + _told("SERVING") + textwrap.dedent("""
        import os, time
        if os.environ["PMI_RANK"] == "0":
            time.sleep(0.5)
            os._exit(3)
        os._exit(0)
    """))
    assert rc == 3 and took < 15, (rc, took, err)
    assert "rank 0 exited with code 3" in err, err
    assert not left


def test_sigterm_reaches_the_child_and_its_drain_decides_the_code():
    """SIGTERM to the supervisor is forwarded: the child's handler runs (a drain) and its exit code is
    the supervisor's."""
    child = """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        print("ready", flush=True)
        time.sleep(60)
        sys.exit(7)
    """
    proc = _supervise(0, child, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    rc, err, took = _finish(proc)
    assert rc == 0 and took < 30, (rc, took, err)


def test_a_rank_whose_launcher_is_gone_is_ended():
    """``--launcher PID``: once that process is gone (SIGKILLed), the supervisor SIGTERMs its rank (which
    drains) and exits with the rank's code (was: the job ran on orphaned, still serving its port)."""
    _launcher_gone_ends_the_rank(reap=True)


def test_a_rank_whose_launcher_is_killed_but_not_yet_reaped_is_ended():
    """The launcher SIGKILLed while its parent has not reaped it (a zombie: a script that waits for it later): it
    has ended all the same (was: ``kill(pid, 0)`` succeeds on a zombie, so the ranks -- of ``generate --tp N`` too
    -- ran on until the parent reaped it)."""
    from tensorrt_llm_ext.runtime.rank_files import pid_alive

    assert pid_alive(os.getpid())
    _launcher_gone_ends_the_rank(reap=False)


def _launcher_gone_ends_the_rank(reap: bool):
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    env = {**os.environ, "PMI_RANK": "0", "PYTHONPATH": str(ROOT)}
    child = """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        print("ready", flush=True)
        time.sleep(120)
        sys.exit(7)
    """
    proc = subprocess.Popen([sys.executable, "-m", "tensorrt_llm_ext.runtime.rank_supervisor", "--supervise-command",
                             "0", "--launcher", str(launcher.pid), "--", sys.executable, "-c",
                             textwrap.dedent(child)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        assert proc.poll() is None  # the launcher lives: the rank runs on
        launcher.kill()
        if reap:
            launcher.wait()
        rc, err, took = _finish(proc, timeout=30)
    finally:
        launcher.kill()
        launcher.wait()
        proc.kill()
    assert rc == 0 and took < 10, (rc, took, err)
    assert f"the launcher (pid {launcher.pid}) is gone: ending the rank" in err, err


def test_an_mpi_job_dies_with_its_launcher_killed_outright(tmp_path):
    """``launch_command`` on 2 MPI ranks, its launcher SIGKILLed: every rank ends within seconds (mpiexec's
    parent-death SIGTERM, the supervisors' launcher watch), none is left running."""
    rank = textwrap.dedent(f"""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        open(os.path.join({str(tmp_path)!r}, "rank%s.pid" % os.environ.get("PMI_RANK")), "w").write(str(os.getpid()))
        time.sleep(120)
    """)
    launcher_code = (f"import sys; from tensorrt_llm_ext.runtime.ranks import launch_command; "
                     f"sys.exit(launch_command(2, [sys.executable, '-c', {rank!r}], linger_s=1))")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        assert len(pids) == 2
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "a rank outlived its launcher"
    finally:
        launcher.kill()
        for p in tmp_path.glob("rank*.pid"):
            if _alive(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except (FileNotFoundError, ProcessLookupError):  # gone (reaped between the open and the read: ESRCH)
        return False


def test_the_launcher_passes_sighup_on_unless_it_is_ignored(monkeypatch):
    """``serve --tp N`` under ``nohup``: an ignored SIGHUP stays ignored (the job outlives the terminal, as at TP 1);
    otherwise the launcher drains the job on it like SIGTERM. ``launch_command`` itself, with mpiexec faked: a
    SIGHUP to this process while the job runs is passed on (or not) as SIGTERM (was: forwarded even when ignored)."""
    from tensorrt_llm_ext.runtime import ranks
    from tensorrt_llm_ext.runtime.ranks import launch_command, stop_signals

    class FakeJob:  # mpiexec: the launcher waits on it; a SIGHUP arrives while it runs
        def __init__(self, *args, **kwargs):
            self.sent = []

        def send_signal(self, sig):
            self.sent.append(sig)

        def wait(self):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)  # the handler (if any) runs here
            return 0

    jobs = []
    monkeypatch.setattr(ranks, "mpiexec_command", lambda: (["mpiexec"], {}))
    monkeypatch.setattr(ranks.subprocess, "Popen", lambda *a, **k: jobs.append(FakeJob()) or jobs[-1])
    old = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert stop_signals() == (signal.SIGTERM, signal.SIGINT)
        assert launch_command(2, ["serve"], linger_s=0) == 0
        assert jobs[-1].sent == []  # nothing passed on: the job serves on
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # and it is ignored again afterwards
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert stop_signals() == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        assert launch_command(2, ["serve"], linger_s=0) == 0
        assert jobs[-1].sent == [signal.SIGTERM]  # the terminal closed: the job drains
    finally:
        signal.signal(signal.SIGHUP, old)
