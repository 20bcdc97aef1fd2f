"""The fused RMS norm kernel (with and without the residual add) vs its eager twin, and its shape checks."""

import pytest
import torch

from tensorrt_llm_ext.kernels.rms_norm import rms_norm, rms_norm_reference

# Triton takes CPU tensors only under the interpreter (CPU machines); on a GPU machine test CUDA.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden", [(1, 7), (5, 96), (3, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_eager(device, dtype, rows, hidden, with_residual):
    g = torch.Generator().manual_seed(rows * 131 + hidden)
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    res = torch.randn(rows, hidden, generator=g).to(device, dtype) if with_residual else None
    out, res_out = rms_norm(x, w, 1e-6, residual=res)
    ref, ref_res = rms_norm_reference(x, w, 1e-6, residual=res)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if with_residual:
        # The residual sum is one fp32 add rounded once: exact, except that the CPU interpreter
        # truncates fp32->bf16 stores where the GPU rounds to nearest even (one ulp at most).
        if device == "cuda" or dtype == torch.float32:
            assert torch.equal(res_out, ref_res)
        else:
            torch.testing.assert_close(res_out, ref_res, atol=0, rtol=2 ** -7)
    else:
        assert res_out is None


def test_rms_norm_rejects_bad_shapes():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8), 1e-6, residual=torch.randn(3, 8))
    with pytest.raises(ValueError, match="rows, hidden"):
        rms_norm(torch.randn(8), torch.ones(8), 1e-6)

