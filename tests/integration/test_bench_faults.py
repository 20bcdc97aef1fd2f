"""Faults of ``trtllm-ext bench`` as a user runs it on a CPU (thirteenth session's fault hunt): signals that
must not leave servers behind, files that are whole or absent, exit codes that say whether anything was
measured."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


REPO = str(Path(__file__).resolve().parents[2])  # the child imports this checkout, not the editable install's


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_cell_stops_the_server_bench_serve_started(signum):
    # A stand-in server and a cell that receives the signal: the run must unwind and stop the server (Python's
    # default SIGTERM ended the process at once, leaving `trtllm-ext serve` children serving their ports;
    # Ctrl-C printed a KeyboardInterrupt traceback).
    r = _python(f"""
        import argparse, os, signal, sys
        import tensorrt_llm_ext.bench.serve as bs
        import tensorrt_llm_ext.bench.server_process as sp

        class FakeServer:
            url = "http://127.0.0.1:9"
            class proc:
                pid = os.getpid()
            def stop(self, timeout=60):
                print("server stopped", flush=True)
                return 0

        sp.start_server = lambda *a, **k: FakeServer()
        def cell(*a, **k):
            os.kill(os.getpid(), {int(signum)})
            raise AssertionError("the signal did not interrupt the cell")
        bs._cell = cell
        bs.asyncio.run = lambda coro: coro
        args = argparse.Namespace(stub_engine=True, concurrency=[1], requests_per_client=1, max_tokens=2,
                                  shared_prefix=0, tp=1, stub_step_ms=0.0, stub_host_ms=0.0, max_seconds=5.0,
                                  stub_stream_interval=1, rounds=1, tokenizer=["embedded"], out=None, prompt_set="random", prompt_file=None)
        sys.exit(bs.run(args))
    """)
    assert r.returncode == 128 + signum, (r.returncode, r.stderr[-2000:])
    assert "server stopped" in r.stdout
    assert r.stderr.strip() == (f"error: bench serve: interrupted (signal {int(signum)}); every server it started "
                                "is stopped")


class _FakeServer:
    """What bench serve drives, without a process: every stop is counted."""

    url = "http://127.0.0.1:9"

    class proc:
        pid = os.getpid()

        @staticmethod
        def poll():
            return None

    def __init__(self):
        self.stops = 0

    def stop(self, timeout=60):
        self.stops += 1
        return 0


def _stub_args(**over):
    import argparse

    base = dict(stub_engine=True, concurrency=[1, 2], requests_per_client=1, max_tokens=2, shared_prefix=0, tp=1,
                stub_step_ms=0.0, stub_host_ms=0.0, stub_stream_interval=1, rounds=1, max_seconds=5.0,
                tokenizer=["embedded"],
                out=None, config=None,
                model=None, decodes=["speculative", "target_only"], prompt_set="random", prompt_file=None,
                prefix_caching="off", no_cuda_graph=False, disable_overlap_scheduler=False)
    return argparse.Namespace(**{**base, **over})


def test_a_cell_that_served_no_request_is_exit_1_naming_the_servers_reason(monkeypatch, capsys):
    import tensorrt_llm_ext.bench.serve as bs
    import tensorrt_llm_ext.bench.server_process as sp

    server = _FakeServer()
    monkeypatch.setattr(sp, "start_server", lambda *a, **k: server)

    async def cell(url, bodies, concurrency, deadline):
        if concurrency == 1:
            return [(0.01, 0.001, 2)], []
        return [], ["HTTP 400: max_tokens exceeds max_model_len"] * len(bodies)

    monkeypatch.setattr(bs, "_cell", cell)
    assert bs.run(_stub_args()) == 1
    err = capsys.readouterr().err
    assert "no request served (embedded, concurrency 2: 2 failed, the first with HTTP 400: max_tokens" in err
    assert "concurrency 1" not in err and server.stops == 1
    # Every cell served: exit 0.
    monkeypatch.setattr(bs, "_cell", lambda *a: cell(a[0], a[1], 1, a[3]))
    assert bs.run(_stub_args()) == 0



@pytest.mark.parametrize("argv, named", [
    (("verify", "--top-p", "nan"), "argument --top-p: expected a number in (0, 1], got nan"),
    (("verify", "--temperature", "-1"), "argument --temperature: expected a number in [0, 1e+06], got -1"),
    (("verify", "--logit-scale", "inf"), "argument --logit-scale: expected a number in (0, 1e+06], got inf"),
    (("verify", "--block-size", "0"), "argument --block-size: expected an integer >= 1, got 0"),
    (("verify", "--num-splits", "-2"), "argument --num-splits: expected an integer >= 1, got -2"),
    (("verify", "--acceptance", "--temperatures", "0.7,x"), "argument --temperatures: expected a number, got 'x'"),
    (("verify", "--acceptance", "--seeds", "0"), "argument --seeds: expected an integer >= 1, got 0"),
    (("verify", "--acceptance", "--max-new-tokens", "0"), "argument --max-new-tokens: expected an integer >= 1"),
    (("verify", "--one-pass-stats", "--stats-configs", "4/x/0"), "argument --stats-configs: expected WARPS/"),
    (("exchange", "--polls", "0"), "argument --polls: expected an integer >= 1, got 0"),
], ids=["top-p-nan", "temperature", "logit-scale", "block-size", "num-splits", "temperatures", "seeds",
        "max-new-tokens", "stats-configs", "polls"])
def test_bench_flags_no_run_can_use_are_usage_errors(argv, named, capsys):
    # Were: a table labelled "top-p nan" and exit 0, a ValueError traceback, zero requests measured with exit 0,
    # or (on a GPU) a division by zero polls.
    from tensorrt_llm_ext.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and named in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, named", [
    (("--timeout", "0"), "argument --timeout: expected seconds in (0, 1e+09], got 0"),
    (("--timeout", "nan"), "argument --timeout: expected seconds in (0, 1e+09], got nan"),
    (("--reps", "0"), "argument --reps: expected an integer >= 1, got 0"),
    (("--calls-per-rep", "-1"), "argument --calls-per-rep: expected an integer >= 1, got -1"),
], ids=["timeout-0", "timeout-nan", "reps", "calls-per-rep"])
def test_bench_tp_bounds_are_usage_errors_before_any_rank_starts(argv, named, capsys):
    # Were: ranks started, then a RankJobError traceback ("no result within 0s"); or, on a GPU, the median of
    # no repetition (StatisticsError) on every rank.
    from tensorrt_llm_ext.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "tp", "--tiny", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and named in err, err


def test_a_failed_bench_tp_rank_job_is_an_error_line_and_exit_1(monkeypatch, capsys):
    import tensorrt_llm_ext.bench.tp as bench_tp
    from tensorrt_llm_ext.cli import main
    from tensorrt_llm_ext.runtime.ranks import RankJobError

    def fail(args, pool=None):
        raise RankJobError("rank 1 exited with 9", [], "/tmp/rank_logs_x")

    monkeypatch.setattr(bench_tp, "run_tp", fail)
    assert main(["bench", "tp", "--tiny"]) == 1
    err = capsys.readouterr().err
    assert "error: bench tp: the 2-rank job failed: rank 1 exited with 9" in err and "/tmp/rank_logs_x" in err
    assert "Traceback" not in err


def test_bench_serve_config_and_server_start_failures_are_one_line(tmp_path, monkeypatch, capsys):
    # Were: a ConfigError traceback (exit 1) for a missing --config / --model, and a RuntimeError traceback with
    # the server log's tail for a server that refused its arguments or failed to load.
    import tensorrt_llm_ext.bench.serve as bs
    import tensorrt_llm_ext.bench.server_process as sp

    missing = tmp_path / "no.yaml"
    assert bs.run(_stub_args(stub_engine=False, config=str(missing), model=None)) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: bench serve: cannot read config file {missing}: No such file or directory"

    for rc, want in ((2, 2), (1, 1), (None, 1)):
        def refuse(*a, rc=rc, **k):
            raise sp.ServerStartError(f"serve exited with {rc}: --tokenizer x: no tokenizer there (log: L)", rc,
                                      "a long log tail\n" * 50)

        monkeypatch.setattr(sp, "start_server", refuse)
        assert bs.run(_stub_args()) == want
        err = capsys.readouterr().err
        assert err.strip() == f"error: bench serve: serve exited with {rc}: --tokenizer x: no tokenizer there (log: L)"


def test_bench_serve_prompt_set_sends_bench_acceptances_prompts(tmp_path, monkeypatch, capsys):
    """--prompt-set mt_bench --prompt-file FILE: every request's prompt is one of the set's prompts as bench acceptance
    renders them (cycled over the requests); --prompt-file with random prompts, or a file without the set, is one
    line and exit 2 before any server starts."""
    import collections
    import gzip
    import json

    import tensorrt_llm_ext.bench.serve as bs
    import tensorrt_llm_ext.bench.server_process as sp
    from tensorrt_llm_ext.bench.acceptance import prompt_set_ids
    from tensorrt_llm_ext.configs.tiny_model import tiny_model
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.export import export_model

    model = tmp_path / "ckpt"
    export_model(load_config(**tiny_model()), model)
    file = tmp_path / "prompts.jsonl.gz"
    with gzip.open(file, "wt") as f:
        for i in range(3):
            f.write(json.dumps({"set": "mt_bench", "source": "mt_bench",
                                "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n")
    started, sent = [], []
    monkeypatch.setattr(sp, "start_server", lambda *a, **k: started.append(a) or _FakeServer())

    async def cell(url, bodies, concurrency, deadline):
        sent.extend(b["prompt"] for b in bodies)
        return [(0.01, 0.001, 2)] * len(bodies), []

    monkeypatch.setattr(bs, "_cell", cell)
    monkeypatch.setattr(bs, "_scrape", lambda url: collections.defaultdict(float))  # no /metrics to read
    args = dict(stub_engine=False, model=str(model), concurrency=[2], requests_per_client=2, max_tokens=2,
                decodes=["target_only"], prompt_set="mt_bench", prompt_file=str(file))
    want = prompt_set_ids(str(model), 517, "mt_bench", prompt_file=str(file), num_prompts=4)
    assert len(want) == 3
    rc = bs.run(_stub_args(**args))
    assert rc == 0, capsys.readouterr().err
    assert sent and all(p in want for p in sent) and len({tuple(p) for p in sent}) == 3
    started.clear()
    assert bs.run(_stub_args(**{**args, "prompt_set": "random"})) == 2
    assert "--prompt-file: needs --prompt-set held_out, mt_bench or humaneval" in capsys.readouterr().err
    assert bs.run(_stub_args(**{**args, "prompt_set": "humaneval"})) == 2
    assert "error: bench serve: --prompt-set humaneval: no humaneval prompts found" in capsys.readouterr().err
    assert started == []


def test_bench_serve_rounds_alternate_fresh_servers_and_report_each_cells_spread(monkeypatch, capsys):
    """--rounds 3: a fresh server per decode per round, the decodes in turns; the main table's rows per round, then
    each cell's median / min / max TPOT and tokens/s over the rounds."""
    import collections

    import tensorrt_llm_ext.bench.serve as bs
    import tensorrt_llm_ext.bench.server_process as sp

    started, tpots = [], iter([0.004, 0.001, 0.002] * 8)
    monkeypatch.setattr(sp, "start_server", lambda args, *a, **k: started.append("--no-speculation" in args)
                        or _FakeServer())

    async def cell(url, bodies, concurrency, deadline):
        return [(0.01, next(tpots), 2)] * len(bodies), []

    monkeypatch.setattr(bs, "_cell", cell)
    monkeypatch.setattr(bs, "_scrape", lambda url: collections.defaultdict(float))
    assert bs.run(_stub_args(stub_engine=False, concurrency=[1], rounds=3)) == 0
    assert started == [False, True] * 3  # speculative, target-only, in turns, each round a fresh server
    out = capsys.readouterr().out
    assert "speculative r1" in out and "target_only r3" in out  # the main table: a row per cell per round
    summary = out[out.index("each cell over 3 rounds"):]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in summary.splitlines()
            if line.startswith("| speculative") or line.startswith("| target_only")]
    assert len(rows) == 4  # 2 decodes x 2 samplings, one cell each
    # every cell saw 4, 1 and 2 ms in some order over its rounds (the fake's cycle)
    assert all(r[4:8] == ["2.00", "1.00", "4.00", "4.00"] for r in rows), rows


def test_a_server_that_exits_while_starting_names_its_last_log_line(tmp_path):
    import pytest as _pytest

    from tensorrt_llm_ext.bench.server_process import ServerStartError, start_server

    log = tmp_path / "server.log"
    with _pytest.raises(ServerStartError) as exc:
        start_server(["--tokenizer", str(tmp_path / "none")], str(log),
                     command=("-c", "import sys; print('loading'); sys.exit('error: --tokenizer: no tokenizer there')"))
    assert exc.value.returncode == 1
    assert exc.value.headline == (f"serve exited with 1 before answering /health: error: --tokenizer: no tokenizer "
                                  f"there (log: {log})")


def test_out_gets_the_tables_of_every_benchmark_once(tmp_path, capsys):
    # Was: `--out` (a flag of every benchmark) left an empty file for tail, select, verify, markov and drafter.
    from tensorrt_llm_ext.cli import main

    out = tmp_path / "tail.md"
    assert main(["bench", "tail", "--batch-sizes", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    text = out.read_text()
    assert text.count("### Spec tail") == 1 and text.strip() in printed

    # A benchmark that appends its own tables (bench acceptance) is not appended twice.
    import argparse

    from tensorrt_llm_ext.bench.harness import _appending_out, print_table

    def own(args):
        with open(args.out, "a") as f:
            f.write(print_table("own", ["a"], [[1]]))

    own_out = tmp_path / "own.md"
    _appending_out(own)(argparse.Namespace(out=str(own_out)))
    assert own_out.read_text().count("### own") == 1


def test_a_server_that_dies_mid_cell_is_one_line_with_its_exit_and_log(tmp_path, monkeypatch, capsys):
    # Was (model servers): the /metrics scrape after the cell raised httpx.ConnectError, a traceback; (stub) exit 1
    # blaming the requests, not the server.
    import tensorrt_llm_ext.bench.serve as bs
    import tensorrt_llm_ext.bench.server_process as sp

    class KilledProc:
        pid, returncode = os.getpid(), -9

        def poll(self):
            return -9

    log = tmp_path / "server.log"
    log.write_text("stub server ready\nKilled\n")
    monkeypatch.setattr(sp, "start_server", lambda *a, **k: sp.ServerProcess(KilledProc(), "http://127.0.0.1:9",
                                                                             str(log)))

    async def cell(url, bodies, concurrency, deadline):
        return [], ["RemoteProtocolError: peer closed connection"] * len(bodies)

    monkeypatch.setattr(bs, "_cell", cell)
    assert bs.run(_stub_args(concurrency=[1])) == 1
    assert capsys.readouterr().err.strip() == (f"error: bench serve: serve exited with -9 during the cell embedded, "
                                               f"concurrency 1: Killed (log: {log})")


def test_bench_tp_whose_paths_disagree_is_exit_1(monkeypatch, capsys):
    # Was: a table with "ids equal: NO" and exit 0.
    import tensorrt_llm_ext.bench.tp as bench_tp
    from tensorrt_llm_ext.bench.harness import print_table
    from tensorrt_llm_ext.cli import main

    verdict = {"equal": "yes"}

    def tables(args, pool=None):
        print_table("bench tp: vp vs gathered selection", ["rows", "ids equal"], [[1, "yes"], [3, verdict["equal"]]])
        return []

    monkeypatch.setattr(bench_tp, "run_tp", tables)
    assert main(["bench", "tp", "--tiny"]) == 0
    verdict["equal"] = "NO"
    assert main(["bench", "tp", "--tiny"]) == 1
    assert ("error: bench tp: the paths gave different ids in 'bench tp: vp vs gathered selection' (rows marked NO)"
            in capsys.readouterr().err)


def test_max_tokens_past_the_served_model_is_a_usage_error_before_any_server(monkeypatch, capsys):
    # Was: both servers started, every request refused with a 400, exit 0 (a table of zeros).
    import tensorrt_llm_ext.bench.serve as bs
    import tensorrt_llm_ext.bench.server_process as sp

    def no_server(*a, **k):
        raise AssertionError("a server was started")

    monkeypatch.setattr(sp, "start_server", no_server)
    monkeypatch.setattr(bs.torch.cuda, "is_available", lambda: False)  # the small CPU config: max_seq_len 40
    assert bs.run(_stub_args(stub_engine=False, config=None, model=None, max_tokens=40)) == 2
    assert capsys.readouterr().err.strip() == ("error: bench serve: --max-tokens 40: expected at most max_seq_len - 1 "
                                               "= 39 (a prompt needs a token)")


def test_verify_acceptance_that_no_request_fits_is_a_usage_error(capsys):
    # Was: every request rejected by the engine, a row of '-' and exit 0.
    from tensorrt_llm_ext.cli import main

    assert main(["bench", "verify", "--acceptance", "--max-new-tokens", "124", "--seeds", "1",
                 "--temperatures", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: bench verify: --max-new-tokens 124: expected at most 123 (max_seq_len 160" in err


def test_verify_acceptance_row_without_a_step_is_exit_1(monkeypatch, capsys):
    import tensorrt_llm_ext.runtime.engine as engine_mod
    from tensorrt_llm_ext.cli import main

    class NoSteps:
        def __init__(self, cfg):
            pass

        def generate(self, reqs, mode):
            class Stats:
                mean_acceptance_length = float("nan")

            return None, Stats()

    monkeypatch.setattr(engine_mod, "Engine", NoSteps)
    assert main(["bench", "verify", "--acceptance", "--max-new-tokens", "2", "--seeds", "1",
                 "--temperatures", "1"]) == 1
    assert "error: bench verify --acceptance: no step measured at T=1" in capsys.readouterr().err
