"""Logits processing (logit_bias, penalties, min_p, top_k) on the rows of a speculative step against the eager
full-vocabulary reference (``process_reference``: plain per-row loops): bitwise, on random logits with exact
ties, -inf entries, an odd vocabulary, drafts inside the block counted per position."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.speculative.logits_processing import SlotLogitsProcessors, process_reference

V, K = 37, 3
FIELDS = [
    SamplingParams(),  # a row without processing beside processed ones: unchanged
    SamplingParams(logit_bias=((3, 5.0), (36, -100.0), (0, 0.5))),
    SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3),
    SamplingParams(top_k=4),
    SamplingParams(min_p=0.3),
    SamplingParams(top_k=1, min_p=0.9, repetition_penalty=0.6, logit_bias=((5, 2.0),)),
    SamplingParams(top_k=V + 5, frequency_penalty=2.0),  # k beyond the vocabulary: no limit
]
TEMPS = [0.0, 1.0, 0.7, 1.3, 0.9, 2.0, 1.0]
# a slot's params carry the temperature its rows sample at, as SlotSampling assigns them (min_p / top_k act on
# sampled rows only, a host fact of the step variant)
FIELDS = [replace(f, temperature=t) for f, t in zip(FIELDS, TEMPS)]
PROMPTS = [[1, 2], [3], [4, 4, 9, 36], [2], [7, 8], [5, 6, 5], [0]]


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(len(FIELDS) * (K + 1), V, generator=g) * 3).round() / 2  # exact ties
    logits[1, 7] = float("-inf")
    history = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(0, 6, (len(FIELDS),),
                                                                                          generator=g)]
    drafts = torch.randint(0, V, (len(FIELDS), K), generator=g)
    drafts[2, :2] = torch.tensor([4, 4])  # a repeated draft inside the block
    return logits, history, drafts


def _reference(logits, history, drafts, temps):
    rows, fields, t, hist, prompts = [], [], [], [], []
    for b, f in enumerate(FIELDS):
        for j in range(K + 1):
            fields.append(f)
            t.append(temps[b])
            hist.append(history[b] + drafts[b, :j].tolist())
            prompts.append(PROMPTS[b])
    return process_reference(logits, fields, t, hist, prompts)


def _processors(history, width=V, start=0):
    slots = list(range(len(FIELDS)))
    proc = SlotLogitsProcessors(len(FIELDS) + 1, start, width, V, "cpu")
    proc.assign(slots, FIELDS, PROMPTS)
    for b, h in enumerate(history):  # the generated tokens so far, as the steps would have counted them
        if h:
            proc.record(slots, torch.tensor([b]), torch.tensor([h]), torch.tensor([len(h)]))
    return proc, slots


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step_rows_equal_the_full_vocabulary_reference(seed):
    logits, history, drafts = _case(seed)
    proc, slots = _processors(history)
    rows = torch.arange(len(FIELDS)).repeat_interleave(K + 1)
    temps = torch.tensor(TEMPS).repeat_interleave(K + 1)
    got = proc.apply(logits, slots, rows, temps, drafts)
    want = _reference(logits, history, drafts, TEMPS)
    assert torch.equal(got, want)
    assert torch.equal(got[:K + 1], logits[:K + 1])  # the row without processing is untouched
    # Each field acts: bias, penalties, top-k (4 kept, or more at ties) and min_p change their rows.
    for b in range(1, 6):
        assert not torch.equal(got[b * (K + 1):(b + 1) * (K + 1)], logits[b * (K + 1):(b + 1) * (K + 1)]), b
    top_k_rows = got[3 * (K + 1):4 * (K + 1)]
    assert ((top_k_rows > float("-inf")).sum(-1) >= 4).all()
    # Greedy rows (temperature 0) ignore min_p and top_k; the greedy-only worker passes no temperatures.
    greedy = proc.apply(logits, slots, rows, None, drafts)
    assert torch.equal(greedy, _reference(logits, history, drafts, [0.0] * len(FIELDS)))


def test_counts_follow_the_accepted_tokens_and_reset_on_assign():
    proc, slots = _processors([[], [], [], [], [], [], []])
    tokens = torch.tensor([[4, 4, 9, 1], [2, 3, 5, 6]])
    proc.record(slots, torch.tensor([2, 5]), tokens, torch.tensor([3, 1]), live=torch.tensor([True, True]))
    assert proc.counts[2, 4] == 2 and proc.counts[2, 9] == 1 and proc.counts[2, 1] == 0
    assert proc.counts[5, 2] == 1 and proc.counts[5].sum() == 1
    proc.record(slots, torch.tensor([2, 5]), tokens, torch.tensor([3, 1]), live=torch.tensor([False, True]))
    assert proc.counts[2].sum() == 3 and proc.counts[5, 2] == 2  # a dummy row counts nothing
    proc.assign([2], [FIELDS[2]], [[8]])
    assert proc.counts[2].sum() == 0 and proc.in_prompt[2].nonzero().view(-1).tolist() == [8]


@pytest.mark.parametrize("shards", [2, 3])
def test_shards_equal_full_rows_without_collectives_for_bias_and_penalties(shards):
    """Bias and penalties are per column: each shard of an (padded) odd vocabulary gives its columns of the
    full result; the min_p / top_k exchanges are tested over MPI (multi_gpu/test_logits_processing_tp.py)."""
    logits, history, drafts = _case(5)
    rows = torch.arange(len(FIELDS)).repeat_interleave(K + 1)
    temps = torch.zeros(len(FIELDS) * (K + 1))  # greedy: no min_p / top_k, so no collective is needed
    full, slots = _processors(history)
    want = full.apply(logits, slots, rows, temps, drafts)
    width = -(-V // shards)
    padded = torch.nn.functional.pad(logits, (0, width * shards - V), value=float("-inf"))
    for r in range(shards):
        proc, _ = _processors(history, width, r * width)
        got = proc.apply(padded[:, r * width:(r + 1) * width], slots, rows, temps, drafts)
        hi = min(V, (r + 1) * width)
        assert torch.equal(got[:, :hi - r * width], want[:, r * width:hi]), r


def test_bad_fields_name_themselves():
    for f, word in ((SamplingParams(top_k=-2), "top_k"), (SamplingParams(min_p=1.5), "min_p"),
                    (SamplingParams(presence_penalty=3.0), "presence_penalty"),
                    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
                    (SamplingParams(logit_bias=((V, 1.0),)), "logit_bias"),
                    (SamplingParams(logit_bias=((1, 1.0), (1, 2.0))), "distinct")):
        with pytest.raises(ValueError, match=word):
            f.check(V)


def _bitwise(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("seed", [3, 4])
def test_the_captured_step_needs_no_host_fact_of_its_rows(seed):
    """What a CUDA graph records: ``apply`` with no host knowledge of the rows (the capture's empty slot list)
    computes every row's reference bit for bit -- the ops do not depend on which fields the rows use. Rows with
    ``top_k`` above the captured exchange width are the one exception: the step says so (wide top-k) and sizes
    the exchange by its rows."""
    logits, history, drafts = _case(seed)
    logits[5, :] = float("-inf")  # a -inf row
    logits[9, 3] = float("nan")  # a NaN entry
    rows = torch.arange(len(FIELDS)).repeat_interleave(K + 1)
    temps = torch.tensor(TEMPS).repeat_interleave(K + 1)
    want = _reference(logits, history, drafts, TEMPS)
    proc, slots = _processors(history)
    assert not proc.wide_top_k(slots) and proc.top_k_width(slots) == proc.captured_top_k
    _bitwise(proc.apply(logits, [], rows, temps, drafts), want)
    narrow = SlotLogitsProcessors(len(FIELDS) + 1, 0, V, V, "cpu", captured_top_k=2)
    narrow.assign(slots, FIELDS, PROMPTS)
    for b, h in enumerate(history):
        if h:
            narrow.record(slots, torch.tensor([b]), torch.tensor([h]), torch.tensor([len(h)]))
    assert narrow.wide_top_k(slots) and narrow.top_k_width(slots) == 4  # top_k=4 > 2; top_k=V+5 limits nothing
    assert not narrow.wide_top_k([0, 1, 2, 4, 5, 6])
    _bitwise(narrow.apply(logits, slots, rows, temps, drafts), want)
    with pytest.raises(ValueError, match="captured_top_k"):
        SlotLogitsProcessors(2, 0, V, V, "cpu", captured_top_k=0)


def test_slots_without_penalties_ignore_their_counts():
    """Once the count tables exist every slot's tokens are counted (the step has no per-row branch); a slot
    without penalties reads them with identity values, so its row stays bit for bit unprocessed."""
    logits, _, drafts = _case(6)
    fields = [SamplingParams(), SamplingParams(logit_bias=((2, 1.0),)), SamplingParams(top_k=3)]
    proc = SlotLogitsProcessors(4, 0, V, V, "cpu")
    proc.assign([0, 1, 2], fields, [[1], [2], [3]])
    assert proc.counts is None  # no penalty yet: nothing counted, nothing allocated
    rows = torch.arange(3).repeat_interleave(K + 1)
    x = logits[:3 * (K + 1)]
    temps = torch.tensor([1.0, 0.5, 1.0]).repeat_interleave(K + 1)
    first = proc.apply(x, [], rows, temps, drafts[:3])
    assert proc.counts is not None  # the first processed step makes the tables (outside any capture)
    proc.record([0, 1, 2], torch.arange(3), torch.randint(0, V, (3, 6)), torch.tensor([6, 6, 6]))
    assert proc.counts.sum() == 18
    assert torch.equal(proc.apply(x, [], rows, temps, drafts[:3]), first)
    want = process_reference(x, [f for f in fields for _ in range(K + 1)], temps.tolist(),
                             [[]] * (3 * (K + 1)), [[]] * (3 * (K + 1)))
    assert torch.equal(first, want)


def test_a_penalty_given_as_a_huge_int_is_served_as_its_float():
    """A checked field may be a Python int past int64 (``repetition_penalty`` 10**30 from a JSON integer: in fp32's
    range, so legal): a slot takes it as the float it equals (was: torch's "Overflow when unpacking long long", the
    request refused in its prefill)."""
    logits, history, drafts = _case(3)
    rows = torch.arange(2).repeat_interleave(K + 1)
    temps = torch.ones(2 * (K + 1))
    out = []
    for big in (10**30, 1e30):
        fields = [SamplingParams(repetition_penalty=big, presence_penalty=2, frequency_penalty=-2, min_p=1),
                  SamplingParams(repetition_penalty=2**63)]
        proc = SlotLogitsProcessors(3, 0, V, V, "cpu")
        proc.assign([0, 1], fields, [[1, 2], [4, 4]])
        out.append(proc.apply(logits[:2 * (K + 1)], [0, 1], rows, temps, drafts[:2]))
    assert torch.equal(out[0], out[1])
    assert float(proc.repetition[1]) == float(2**63)


def test_repetition_penalties_at_their_bounds_keep_every_scaled_logit_finite():
    """At 2^-100 / 2^100 a seen logit of +-2000, scaled by the smallest temperature a draw takes, is finite (past them
    1e-38 made seen logits +inf: the exact top-p set dropped them, rejection sampling drew NaN weights); just past
    a bound the rule refuses the penalty by name."""
    from tensorrt_llm_ext.contract import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, MIN_TEMPERATURE

    x = torch.tensor([[2000.0, -2000.0, 1.0, -1.0]]).repeat(2, 1)
    proc = SlotLogitsProcessors(3, 0, 4, 4, "cpu")
    fields = [SamplingParams(temperature=1.0, repetition_penalty=p)
              for p in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)]
    proc.assign([0, 1], fields, [[0, 1, 2, 3]] * 2)
    y = proc.apply(x, [0, 1], torch.tensor([0, 1]), torch.full((2,), MIN_TEMPERATURE))
    assert bool(torch.isfinite(y / MIN_TEMPERATURE).all()), y
    for p in (MIN_REPETITION_PENALTY / 2, MAX_REPETITION_PENALTY * 2):
        with pytest.raises(ValueError, match="repetition_penalty: .* past fp32"):
            SamplingParams(repetition_penalty=p).check()


def test_sampling_only_fields_of_a_greedy_request_leave_the_step_variant_alone():
    """min_p / top_k act on sampled rows only: a greedy request carrying them (clients send top_k=50 / 200 by
    default) processes nothing, so its steps stay in the default variant -- was: processed for the whole batch,
    and a top_k past the captured width made every neighbour's step eager (wide-top-k, never captured). A sampled
    row with the same fields, and a greedy one with a bias or a penalty, still process."""
    proc = SlotLogitsProcessors(6, 0, V, V, "cpu", captured_top_k=8)
    params = [SamplingParams(top_k=20), SamplingParams(min_p=0.3, top_k=3), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=20), SamplingParams(logit_bias=((1, 2.0),), top_k=20),
              SamplingParams(repetition_penalty=1.5, min_p=0.2)]
    proc.assign(list(range(6)), params, [[1]] * 6)
    assert not proc.active([0, 1, 2]) and not proc.wide_top_k([0, 1, 2])
    assert proc.top_k_width([0, 1, 2]) == proc.captured_top_k
    assert proc.active([2, 3]) and proc.wide_top_k([2, 3]) and proc.top_k_width([0, 3]) == 20
    assert proc.active([4]) and not proc.wide_top_k([4]) and proc.active([5])
    proc.assign([0], [SamplingParams(temperature=1.0, top_k=V)], [[1]])  # a top_k of the whole vocabulary
    assert not proc.active([0, 2])
    # what the greedy rows get is unchanged: processing them is the identity (their row is the raw one)
    logits, _, _ = _case(7)
    x = logits[:3]
    assert torch.equal(proc.apply(x, [0, 1, 2], torch.arange(3), torch.zeros(3)), x.float())


def test_one_assign_of_many_slots_equals_one_per_slot():
    """An admission of several requests writes its slots' fields in one launch per field: every table ends as
    one assign per slot leaves it (a slot's earlier bias entries and -- where it has a penalty -- counts cleared,
    its prompt on this shard's columns only), the slots outside it untouched."""
    start, width = 5, 20  # a shard: columns 5 .. 24
    together = SlotLogitsProcessors(len(FIELDS) + 2, start, width, V, "cpu")
    apart = SlotLogitsProcessors(len(FIELDS) + 2, start, width, V, "cpu")
    for proc in (together, apart):  # earlier requests on the same slots: their bias and counts must go
        proc.assign([1, 5, 8], [FIELDS[1], FIELDS[5], FIELDS[2]], [[6, 7], [9], [10, 11]])
        proc.record([1, 5, 8], torch.tensor([1, 5, 8]), torch.tensor([[6], [9], [12]]), torch.tensor([1, 1, 1]))
    slots = [5, 0, 3, 1, 6, 2, 4]
    together.assign(slots, FIELDS, PROMPTS)
    for s, f, p in zip(slots, FIELDS, PROMPTS):
        apart.assign([s], [f], [p])
    for name in ("top_k", "min_p", "presence", "frequency", "repetition", "bias_cols", "bias_vals"):
        assert torch.equal(getattr(together, name), getattr(apart, name)), name
    # counts and prompt flags: equal on the slots with a penalty (the only ones that read them; an assign of
    # slots without one leaves theirs as they were, SlotLogitsProcessors.counting)
    counted = [s for s, f in zip(slots, FIELDS) if f.uses_counts] + [8]
    assert len(counted) == 4
    for name in ("counts", "in_prompt"):
        assert torch.equal(getattr(together, name)[counted], getattr(apart, name)[counted]), name
    assert together.counts[8].sum() == 1 and together.repetition[8] == FIELDS[2].repetition_penalty  # untouched
    assert not together.bias_vals[1].any() and together.counts[5].sum() == 0  # the earlier requests' state gone
    assert together.top_k[6] == FIELDS[4].top_k and together.min_p[6] == pytest.approx(FIELDS[4].min_p)
    assert together.in_prompt[0].nonzero().view(-1).tolist() == []  # slot 0's prompt [3] lies before the shard
    assert together.in_prompt[3].nonzero().view(-1).tolist() == [9 - start]  # [4, 4, 9, 36]: 36 past the shard
    assert together.in_prompt[2].nonzero().view(-1).tolist() == [0, 1]  # [5, 6, 5]


def test_step_variant_follows_each_assignment_of_a_slot():
    """The step variant's host facts (top-p set, processing, top-k width) are kept per slot at assignment (every
    step asks them for every row): a slot given to another request answers with the new request's, never the
    one before it -- sampled top-p -> greedy -> a bias -> plain."""
    from types import SimpleNamespace

    from tensorrt_llm_ext.speculative.slot_sampling import SlotSampling

    ss = SlotSampling(SimpleNamespace(ctx_lens=torch.zeros(4, dtype=torch.int32)), sampling=True)
    ss.bind_processors(SlotLogitsProcessors(4, 0, V, V, "cpu", captured_top_k=4))
    seq = [(SamplingParams(temperature=1.0, top_p=0.9, top_k=10), (True, True, True)),
           (SamplingParams(temperature=0.0, top_p=0.9, top_k=10), (False, False, False)),  # greedy: no top-p, no top-k
           (SamplingParams(logit_bias=((2, 1.0),)), (False, True, False)),
           (SamplingParams(temperature=1.0), (False, False, False))]
    for params, (top_p, processed, wide) in seq:
        ss.assign([2], [params], [[1]])
        need = ss.needs([0, 2])
        assert (need.top_p, need.processed, need.wide_top_k) == (top_p, processed, wide), params
        assert ss.needs([0, 1]) == ss.needs([3])  # the other slots keep their (default) params


def test_neutral_admissions_write_no_field_and_a_reused_slot_is_reset(monkeypatch):
    """Most requests process nothing: an admission whose requests and slots all hold the identity fields copies and
    writes none (each write was a launch from Python); a slot that held a request with fields is reset when a
    neutral request takes it, and the tables then equal a fresh table's -- and the sampling fields always follow."""
    import tensorrt_llm_ext.speculative.logits_processing as lp
    from types import SimpleNamespace

    from tensorrt_llm_ext.speculative.slot_sampling import SlotSampling

    fresh = SlotLogitsProcessors(4, 0, V, V, "cpu")
    proc = SlotLogitsProcessors(4, 0, V, V, "cpu")
    ss = SlotSampling(SimpleNamespace(ctx_lens=torch.zeros(4, dtype=torch.int32)), sampling=True)
    ss.bind_processors(proc)
    copies = []
    real = lp.host_to_device
    monkeypatch.setattr(lp, "host_to_device", lambda *a, **k: copies.append(a[0]) or real(*a, **k))
    plain = [SamplingParams(temperature=0.5, seed=7), SamplingParams(top_k=-1, repetition_penalty=1.0)]
    ss.assign([0, 2], plain, [[1], [2]])
    assert copies == [] and ss.seeds[0] == 7 and ss.temps[0] == 0.5 and ss.temps[2] == 0.0
    withfields = SamplingParams(temperature=1.0, top_k=5, min_p=0.1, logit_bias=((3, 2.0),))  # no counts
    ss.assign([2], [withfields], [[4]])
    assert proc.top_k[2] == 5 and proc.bias_vals[2, 0] == 2.0 and copies
    copies.clear()
    ss.assign([1, 2], plain, [[1], [2]])  # slot 2 held fields: both rows are written
    assert copies
    for name in ("top_k", "min_p", "presence", "frequency", "repetition", "bias_cols", "bias_vals"):
        assert torch.equal(getattr(proc, name), getattr(fresh, name)), name
    copies.clear()
    ss.assign([2, 3], plain, [[1], [2]])
    assert copies == [] and ss.seeds[2] == 7


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_assigned_rows_start_16_byte_aligned_and_equal_their_slots(rows):
    """``assign`` returns the rows' seeds, temperatures and top-ps as views of one packed copy: each starts on a
    16-byte boundary at every row count (the kernels that read them build a specialization per pointer alignment;
    one that followed the row count's parity was built while serving, on the first admission of each parity), and
    each equals its slots' state bit for bit."""
    from types import SimpleNamespace

    from tensorrt_llm_ext.speculative.slot_sampling import SlotSampling

    ss = SlotSampling(SimpleNamespace(ctx_lens=torch.zeros(8, dtype=torch.int32)), sampling=True)
    ss.bind_processors(SlotLogitsProcessors(8, 0, V, V, "cpu"))
    slots = list(range(8 - rows, 8))
    params = [SamplingParams(temperature=0.3 + 0.1 * i, top_p=0.5 + 0.05 * i, seed=1000 + i) for i in range(rows)]
    temps, seeds, top_p = ss.assign(slots, params, [[1]] * rows)
    assert [t.data_ptr() % 16 for t in (seeds, temps, top_p)] == [0, 0, 0]
    idx = torch.tensor(slots)
    assert torch.equal(seeds, ss.seeds[idx]) and seeds.tolist() == [1000 + i for i in range(rows)]
    assert torch.equal(temps, ss.temps[idx]) and torch.equal(top_p, ss.top_p[idx])
    assert temps.tolist() == [torch.tensor(p.effective_temperature).float().item() for p in params]
    assert top_p.tolist() == [torch.tensor(p.effective_top_p).float().item() for p in params]


def test_an_admission_without_penalties_resets_and_counts_nothing(monkeypatch):
    """Once the count tables exist (the processed graph's capture allocates them), an admission whose requests have
    no penalty neither resets its slots' counts nor walks its prompts (each was host work on every admission); one
    with a penalty does both, and its slot's counts then equal a fresh table's."""
    import tensorrt_llm_ext.speculative.logits_processing as lp

    proc = SlotLogitsProcessors(4, 0, V, V, "cpu")
    counts, _ = proc._tables()  # as after the processed graph's capture
    counts[1, 3] = 5  # a finished request's counts
    copies = []
    real = lp.host_to_device
    monkeypatch.setattr(lp, "host_to_device", lambda *a, **k: copies.append(a[0]) or real(*a, **k))
    proc.assign([1, 2], [SamplingParams(temperature=1.0), SamplingParams()], [[3, 4], [5]])
    assert copies == [] and not proc.counting([1, 2]) and proc.counts[1, 3] == 5  # nothing read it, nothing reset
    pen = SamplingParams(repetition_penalty=1.2)
    proc.assign([1], [pen], [[3, 4]])
    assert proc.counting([1]) and proc.counts[1].sum() == 0
    assert proc.in_prompt[1].nonzero().view(-1).tolist() == [3, 4]
