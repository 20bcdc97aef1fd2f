"""``trtllm-ext bench exchange``: the CPU smoke says it cannot measure; a small GPU run fills its tables."""

import pytest
import torch

from tensorrt_llm_ext.cli import main


def test_bench_exchange_cpu_smoke_prints_no_numbers(capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU smoke; see test_bench_exchange_gpu_small")
    assert main(["bench", "exchange"]) == 1  # nothing measured: not exit 0
    captured = capsys.readouterr()
    assert captured.err.startswith("error: bench exchange: needs a CUDA GPU") and "Nothing was measured" in captured.err
    assert "µs" not in captured.out  # no table, no fake numbers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_exchange_gpu_small(capsys, tmp_path):
    out_file = tmp_path / "exchange.md"
    assert main(["bench", "exchange", "--worlds", "2,4", "--rows", "1,64", "--polls", "20000",
                 "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "WRONG" not in out and out.count("| ok") == 4
    assert "ns per poll" in out and out_file.read_text().count("###") == 2
