"""``train-drafter --feature-cache-gib``: the teacher pass's rows kept on the device (training/feature_cache.py).

The cache returns, for every sequence of a batch, exactly the rows the pass gives it at its own positions (zeros past
its end), runs the pass only for the sequences it does not hold, holds no more than its budget, and a training run
with it ends with the losses of the run without it (CPU: the pass is batch-invariant there, so exactly)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.testing.tiny_models import export_tiny_target
from tensorrt_llm_ext.training.feature_cache import FeatureCache
from tensorrt_llm_ext.training.trainer import TrainConfig, train_drafter

F, H = 6, 4
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # the storage and its gathers on the training device


def _pass(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in teacher pass: each row a function of the token and its position (causal like the real one)."""
    dev = tokens.device
    pos = torch.arange(tokens.shape[1], dtype=torch.float32, device=dev)[None, :, None]
    tok = tokens.float()[..., None]
    return ((tok * 10 + pos + torch.arange(F, device=dev)[None, None] / 8),
            (tok - pos * 3 + torch.arange(H, device=dev)[None, None] / 4))


@pytest.mark.parametrize("device", DEVICES)
def test_cached_rows_equal_the_pass_and_the_pass_runs_once_per_held_sequence(device):
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 9, 3, 7, 12, 4])
    tokens_all = torch.randint(1, 50, (6, 12), generator=g).to(device)
    # budget: (F + H) fp32 = 40 bytes a token; 1 zero row + 5 + 9 + 3 = 18 rows -> sequences 0..2 only
    cache = FeatureCache(lens, 40 * 18, torch.device(device))
    calls = []

    def counted(rows):
        calls.append(rows.shape[0])
        return _pass(rows)

    for batch in ([0, 3, 1], [1, 2, 4], [0, 1, 2], [5, 5, 0], [0, 3, 1, 4, 5]):
        idx = torch.tensor(batch)
        t = int(lens[idx].max())
        tokens = tokens_all[idx, :t]
        feats, final = cache.lookup(idx, tokens, counted)
        want_f, want_h = _pass(tokens)
        for j, i in enumerate(batch):
            n = int(lens[i])
            assert torch.equal(feats[j, :n], want_f[j, :n]) and torch.equal(final[j, :n], want_h[j, :n])
            if cache.offsets[i] >= 0:  # a held sequence's rows past its end are zeros
                assert not feats[j, n:].any() and not final[j, n:].any()
    # the pass ran for: batch 1 all three; batch 2 sequences 2 and 4 (1 held); batch 3 none; batch 4 sequence 5 twice;
    # batch 5 its three unheld sequences padded to four rows (a power of two: few shapes for the GPU's attention)
    assert calls == [3, 2, 2, 4]
    assert cache.offsets[:3] == [1, 6, 15] and cache.offsets[3:] == [-1, -1, -1]
    assert cache.features.shape == (18, F) and cache.features.device.type == device and cache.rows_computed == 10 and cache.rows_read == 7


def test_a_cache_that_holds_nothing_of_a_batch_returns_the_pass_itself():
    cache = FeatureCache(torch.tensor([30, 30]), 40 * 10, torch.device("cpu"))  # no sequence fits
    tokens = torch.arange(60).view(2, 30) % 50
    out = cache.lookup(torch.tensor([0, 1]), tokens, _pass)
    want = _pass(tokens)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert cache.offsets == [-1, -1] and cache.features.shape == (1, F)
    with pytest.raises(ValueError, match="budget must be > 0"):
        FeatureCache(torch.tensor([3]), 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return export_tiny_target(tmp_path_factory.mktemp("target") / "tiny")


def test_training_with_the_cache_ends_with_the_same_losses(tiny_target, tmp_path):
    knobs = TrainConfig(num_prompts=8, max_new_tokens=12, gen_batch=8, eval_prompts=0, num_layers=1, num_heads=2,
                        head_dim=8, latent_dim=16, intermediate_size=64, draft_len=3, steps=6, batch_seqs=3,
                        anchors=4, lr=3e-3, warmup=2, save_every=6)
    plain = train_drafter(tiny_target, tmp_path / "plain" / "drafter", knobs, progress=False)
    cached = train_drafter(tiny_target, tmp_path / "cached" / "drafter", knobs, progress=False,
                           feature_cache_gib=0.001)
    assert plain["feature_cache"] is None
    fc = cached["feature_cache"]
    assert fc["sequences_computed"] + fc["sequences_read"] == 6 * 3 and fc["sequences_read"] > 0
    assert fc["sequences_computed"] <= plain["sequences"] and not fc["disabled"]
    # the CPU's pass gives a sequence the same bits in any batch: the run is bitwise the one without the cache
    assert cached["last_losses"] == plain["last_losses"] and cached["first_losses"] == plain["first_losses"]
    with pytest.raises(ValueError, match="--feature-cache-gib must be a finite number >= 0"):
        train_drafter(tiny_target, tmp_path / "bad" / "drafter", knobs, progress=False, feature_cache_gib=-1.0)
