"""The distillation loss's layouts (training/fused_loss.py): a teacher row per block row ("rows"), the draft logits as
one GEMM each way ("joint") and the teacher's logits once per teacher position ("dedup") give the eager objective,
whatever the rows' order, the chunking and the vocabulary size."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.kernels.common import triton_runs_on
from tensorrt_llm_ext.kernels.block_loss import block_loss_rows, block_loss_rows_reference, teacher_stats
from tensorrt_llm_ext.training.fused_loss import eager_block_loss, fused_block_loss


def _inputs(n=23, h=16, v=301, r=4, positions=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid, rows_m = torch.randn(n, h, generator=g), torch.randn(n, r, generator=g)
    w2, head = torch.randn(v, r, generator=g) / 2, torch.randn(v, h, generator=g) / 2
    teacher_u = torch.randn(positions, h, generator=g)
    # every position used, several rows per position, rows in random order
    index = torch.cat([torch.arange(positions), torch.randint(0, positions, (n - positions,), generator=g)])
    index = index[torch.randperm(n, generator=g)]
    y = torch.randint(0, v, (n,), generator=g)
    c_tv, c_ce, c_kl = (torch.rand(n, generator=g) for _ in range(3))
    c_tv[3] = c_ce[3] = c_kl[3] = 0.0  # a row that does not count still reports its TV
    return hid, rows_m, w2, head, teacher_u, index, y, c_tv, c_ce, c_kl


def _eager_and_fused_agree(inputs, eager_teacher, fused_teacher, fused_kw: dict) -> list:
    """The loss, per-row TV / CE / agreement and the three gradients of the eager objective and of
    fused_block_loss (``fused_kw``) on the same rows, equal within 2e-5; returns the eager run's."""
    hid, rows_m, w2, head, y, c_tv, c_ce, c_kl = inputs
    outs = []
    for fn, teacher, kw in ((eager_block_loss, eager_teacher, {}), (fused_block_loss, fused_teacher, fused_kw)):
        x = [t.clone().requires_grad_() for t in (hid, rows_m, w2)]
        loss, tv, ce, agree = fn(*x, head, teacher, y, c_tv, c_ce, c_kl, **kw)
        loss.backward()
        outs.append([loss.detach(), tv, ce, agree.float()] + [t.grad for t in x])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    return outs[0]


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("layout", ["rows", "joint", "dedup"])
@pytest.mark.parametrize("v", [301, 257])
def test_loss_layouts_equal_the_eager_objective(kernel, layout, v):
    """Loss, per-row TV / CE / top-1 agreement (in the caller's row order) and the gradients w.r.t. the hidden
    states, the W1 rows and W2: the eager objective's, with rows sharing teacher positions, several chunks of 5
    rows, a row of coefficient 0, KL included, odd vocabularies (one and several column blocks of the kernel)."""
    if kernel and not triton_runs_on(torch.zeros(1)):
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    hid, rows_m, w2, head, teacher_u, index, y, c_tv, c_ce, c_kl = _inputs(v=v)
    shared = layout == "dedup"  # one teacher row per position, read through the index
    eager = _eager_and_fused_agree((hid, rows_m, w2, head, y, c_tv, c_ce, c_kl), teacher_u[index],
                                   teacher_u if shared else teacher_u[index],
                                   {"rows": 5, "kernel": kernel, "joint": layout != "rows",
                                    "teacher_index": index if shared else None})
    assert eager[2].std() > 0 and eager[4].abs().sum() > 0  # rows differ; gradients flow


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("rows", [4, 9, 100])
def test_grouped_teacher_rows_equal_the_eager_objective(kernel, rows):
    """``teacher_groups``: rows in groups of G reading their own W teacher rows (the trainer's grid), chunked in
    whole groups whatever ``rows`` asks (fewer than a group, two groups and a part, all of them): the eager
    objective's loss, per-row values and gradients, with no sort of the rows."""
    if kernel and not triton_runs_on(torch.zeros(1)):
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    groups, per_group, width = 5, 6, 4
    hid, rows_m, w2, head, _, _, y, c_tv, c_ce, c_kl = _inputs(n=groups * per_group, v=257)
    g = torch.Generator().manual_seed(5)
    teacher = torch.randn(groups * width, hid.shape[1], generator=g)
    local = torch.randint(0, width, (groups * per_group,), generator=g)
    index = torch.arange(groups).repeat_interleave(per_group) * width + local
    _eager_and_fused_agree((hid, rows_m, w2, head, y, c_tv, c_ce, c_kl), teacher[index], teacher,
                           {"rows": rows, "kernel": kernel, "joint": True, "teacher_index": index,
                            "teacher_groups": (per_group, width)})
    with pytest.raises(ValueError, match="whole groups"):
        fused_block_loss(hid[:-1], rows_m[:-1], w2, head, teacher, y[:-1], c_tv[:-1], c_ce[:-1],
                         teacher_index=index[:-1], teacher_groups=(per_group, width))


def test_row_kernel_reads_shared_teacher_rows_and_their_stats():
    """block_loss_rows with t_index (one teacher row per position, its log-sum-exp / argmax precomputed by
    teacher_stats) equals the torch twin over the gathered rows, ragged column blocks and an argmax tie included."""
    if not triton_runs_on(torch.zeros(1)):
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(1)
    c, u, v = 9, 4, 300
    z, t = torch.randn(c, v, generator=g) * 3, torch.randn(u, v, generator=g) * 3
    t[2, 5] = t[2, 250] = 40.0  # a tie in the teacher: the first maximum, as torch.argmax
    idx = torch.tensor([2, 0, 2, 3, 1, 2, 0, 3, 1])
    y = torch.randint(0, v, (c,), generator=g)
    a_tv, a_ce, a_kl = (torch.rand(c, generator=g) for _ in range(3))
    lse, arg = teacher_stats(t, block=128)
    torch.testing.assert_close(lse, torch.logsumexp(t, -1))
    assert arg.tolist() == t.argmax(-1).tolist() and arg[2] == 5
    want = block_loss_rows_reference(z.clone(), t[idx], y, a_tv, a_ce, a_kl, True)
    zk = z.clone()
    got = block_loss_rows(zk, t, y, a_tv, a_ce, a_kl, True, block=128, t_index=idx, t_stats=(lse, arg))
    for a, b in zip(want, (*got, zk)):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tensorrt_llm_ext.testing.tiny_models import export_tiny_target

    d = export_tiny_target(tmp_path_factory.mktemp("target") / "tiny")
    return d


def _tiny_drafter(model_dir, **knobs):
    """``(trainer module, TrainConfig, drafter config, target, LM head, weights)`` of a 1-layer drafter on the tiny
    target: the embedding init with a random Markov ``W2`` (so the bias term is not zero)."""
    from tensorrt_llm_ext.training import trainer

    tc = trainer.TrainConfig(num_layers=1, num_heads=2, head_dim=8, latent_dim=8, intermediate_size=16, markov_rank=4,
                             draft_len=3, batch_seqs=2, anchors=8, **knobs)
    dcfg, layers = trainer.drafter_config(model_dir, tc)
    target = trainer.load_target(model_dir, layers, torch.device("cpu"), torch.float32)
    init = trainer.initial_weights(dcfg, {"embed_tokens.weight": target.embed_tokens.weight.detach()}, 1, "embedding")
    init["markov_w2"] = torch.randn(init["markov_w2"].shape, generator=torch.Generator().manual_seed(3)) * 0.1
    return trainer, tc, dcfg, target, target.lm_head.weight.detach(), init


def test_trainer_loss_is_the_same_in_every_layout(tiny_target, monkeypatch):
    """distillation_loss on a batch whose anchors wrap (each teacher position read by several block rows): the
    loss, the metrics and every trainable gradient agree between the eager objective and the chunked layouts
    (rows, joint, dedup; dedup with the row kernel under the interpreter too); TLLM_EXT_LOSS_LAYOUT picks the
    default and a bad one is refused."""
    trainer, tc, dcfg, target, head, init = _tiny_drafter(tiny_target, kl_weight=0.3)
    params = {n: t.requires_grad_(n not in trainer.FROZEN) for n, t in init.items()}
    trainable = [p for n, p in params.items() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    data = {"tokens": torch.randint(0, 500, (2, 14), generator=g, dtype=torch.int32), "lens": torch.tensor([14, 11]),
            "prompt_lens": torch.tensor([4, 5])}
    batch = trainer._batch(data, torch.arange(2), torch.device("cpu"), target)
    anchors = trainer.sample_anchors(batch, tc.anchors, torch.Generator().manual_seed(0))
    runs = [{"fused": False}, {"layout": "rows", "kernel": False}, {"layout": "joint", "kernel": False},
            {"layout": "dedup", "kernel": False}]
    if triton_runs_on(torch.zeros(1)):
        runs.append({"layout": "dedup", "kernel": True})
    outs = []
    for kw in runs:
        loss, m = trainer.distillation_loss(params, dcfg, head, batch, anchors, tc.draft_len, tc, **kw)
        grads = torch.autograd.grad(loss, trainable, allow_unused=True)
        outs.append([loss.detach(), m["tv"], m["ce"], m["top1"], m["accept_est"]]
                    + [x if x is not None else torch.zeros(()) for x in grads])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert outs[0][0] > 0 and sum(float(x.abs().sum()) for x in outs[0][5:]) > 0
    # dedup reads nothing on the host mid-step: its teacher rows are a grid of the batch's known width
    with monkeypatch.context() as mp:
        def no_host_read(*_a, **_k):
            raise AssertionError("a host read in the dedup layout")

        mp.setattr(torch, "unique", no_host_read)
        mp.setattr(torch.Tensor, "tolist", no_host_read)
        mp.setattr(torch.Tensor, "item", no_host_read)
        loss, _ = trainer.distillation_loss(params, dcfg, head, batch, anchors, tc.draft_len, tc, layout="dedup",
                                            kernel=False)
    torch.testing.assert_close(loss.detach(), outs[0][0], atol=2e-5, rtol=2e-5)
    from tensorrt_llm_ext import _env

    monkeypatch.delenv("TLLM_EXT_LOSS_LAYOUT", raising=False)
    assert _env._read().loss_layout is None  # none forced: the trainer times every layout at its first step
    monkeypatch.setenv("TLLM_EXT_LOSS_LAYOUT", "dedup")
    read = _env._read()
    assert read.loss_layout == "dedup" and not read.errors
    monkeypatch.setattr(_env, "ENV", read)
    assert trainer.loss_layout() == "dedup"
    monkeypatch.setenv("TLLM_EXT_LOSS_LAYOUT", "per-token")  # refused at start (the CLI prints it and exits 2)
    assert any("TLLM_EXT_LOSS_LAYOUT='per-token'" in e for e in _env._read().errors)
    with pytest.raises(ValueError, match="loss layout 'per-token'"):
        trainer.distillation_loss(params, dcfg, head, batch, anchors, tc.draft_len, tc, layout="per-token")


@pytest.mark.parametrize("layout", ["eager", "dedup"])
def test_masked_anchor_slots_add_no_loss(tiny_target, layout):
    """--anchor-fill mask: the slots past a sequence's candidates (anchor len - 1) add nothing -- the batch's loss,
    with the confidence term off, is the two sequences' own losses weighted by their valid position weights, each
    sequence trained alone on exactly its drawn anchors -- and a wrong filler (len - 2, whose first block position
    has a teacher) would change it."""
    trainer, tc, dcfg, target, head, init = _tiny_drafter(tiny_target, confidence_weight=0.0)
    g = torch.Generator().manual_seed(0)
    data = {"tokens": torch.randint(0, 500, (2, 16), generator=g, dtype=torch.int32), "lens": torch.tensor([16, 11]),
            "prompt_lens": torch.tensor([4, 5])}  # 11 and 5 candidates: the second sequence fills 3 of 8 slots
    kw = {"fused": False} if layout == "eager" else {"layout": "dedup", "kernel": False}
    batch = trainer._batch(data, torch.arange(2), torch.device("cpu"), target)
    anchors = trainer.sample_anchors(batch, tc.anchors, torch.Generator().manual_seed(0), fill="mask")
    assert anchors.shape == (2, 8) and anchors[1, 5:].tolist() == [10, 10, 10]

    def loss_of(b, a):
        return float(trainer.distillation_loss(init, dcfg, head, b, a, tc.draft_len, tc, **kw)[0])

    def weight_of(b, a):  # the valid position weights' sum (the loss is their weighted mean)
        pos = a[:, :, None] + torch.arange(tc.draft_len)
        w = trainer.position_weights(tc.draft_len, tc.position_decay)
        return float((w * (pos <= (b["lens"][:, None, None] - 2))).sum())

    whole = loss_of(batch, anchors)
    parts = []
    for i, live in ((0, 8), (1, 5)):
        one = trainer._batch(data, torch.tensor([i]), torch.device("cpu"), target)
        a = anchors[i:i + 1, :live]
        parts.append((loss_of(one, a), weight_of(one, a)))
    expect = sum(l * w for l, w in parts) / sum(w for _, w in parts)
    assert whole == pytest.approx(expect, rel=1e-5, abs=1e-6)
    wrong = anchors.clone()
    wrong[1, 5:] = 9  # len - 2: its first block position is trained
    assert loss_of(batch, wrong) != pytest.approx(expect, rel=1e-4)
