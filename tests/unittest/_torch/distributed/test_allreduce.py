"""The all-reduce on one rank: no communication, and the fused residual + RMS norm epilogue equals the eager twin."""

import pytest
import torch

from tensorrt_llm_ext.distributed import AllReduce, AllReduceFusionOp, AllReduceParams
from tensorrt_llm_ext.kernels.rms_norm import rms_norm_reference
from tensorrt_llm_ext.mapping import Mapping


def test_allreduce_single_rank_epilogue():
    ar = AllReduce(Mapping())
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.rand(32) + 0.5
    assert torch.equal(ar(x.clone()), x)
    out, res_out = ar(x.clone(), AllReduceParams(AllReduceFusionOp.RESIDUAL_RMS_NORM, residual=r, norm_weight=w))
    ref, ref_res = rms_norm_reference(x, w, 1e-6, residual=r)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(res_out, ref_res)
    with pytest.raises(ValueError, match="norm_weight"):
        ar(x, AllReduceParams(AllReduceFusionOp.RMS_NORM))
