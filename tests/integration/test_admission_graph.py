"""The speculative prefill's first block on static rows (``DSparkWorker.draft_first_block``), replayed per row count
from CUDA graphs by the engine (``Engine._capture_admissions``): padded with dummy rows, or replayed, it leaves every
admitted slot as the eager block over exactly its rows does -- the verify block (first token + drafts), the drafter
context (``ctx_len``, the latent of position ``n - 1``), the stored draft distribution of sampled rows and the
confidences -- and it touches no other request's state."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.models.dspark_drafter import confidence_head_shapes
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.testing.tiny_models import tiny_model

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CFG = {"model.target.vocab_size": 301, "max_batch_size": 8, "max_seq_len": 64,
       "speculative_config.use_rejection_sampling": True}
PROMPTS = [[5, 17, 42], list(range(30, 49)), [7], list(range(100, 133))]  # 3 / 19 / 1 / 33 tokens: page edges


def _engine(graphs: bool = False) -> Engine:
    eng = Engine(load_config(**tiny_model(**CFG)), **({"use_cuda_graph": True} if graphs else {}))
    g = torch.Generator().manual_seed(3)
    shapes = confidence_head_shapes(eng.drafter.config)
    eng.drafter.load_confidence_head({n: torch.randn(s, generator=g) * 0.3 for n, s in shapes.items()})
    return eng


def _requests():
    # greedy and sampled rows together (a sampled row's draft distribution is stored per slot)
    return [Request(list(p), max_new_tokens=4, sampling=SamplingParams(0.8 * (i % 2), seed=11 + i))
            for i, p in enumerate(PROMPTS)]


def _admit(eng: Engine, slots: list[int]) -> list[int]:
    reqs = _requests()
    for s, r in zip(slots, reqs):
        eng.validate(r)
        eng.reserve(s, r)
    return eng.prefill_slots(slots, reqs)


def _slot_state(eng: Engine, slots: list[int]) -> dict[str, torch.Tensor]:
    """What an admission leaves per slot: its verify block, ctx_len, its latent pages, its stored draft
    distribution and the confidences of its drafts."""
    st, w = eng.state, eng.worker()
    idx = torch.tensor(slots, device=st.ctx_lens.device)
    pages = st.block_table[idx].long().clamp(min=0)  # the slots' own latent pages (unallocated -> page 0: same)
    # clones: on a CPU .cpu() returns the tensor itself, and a snapshot must not follow the live buffers
    return {"slot_tokens": st.slot_tokens[idx].cpu().clone(), "ctx_lens": st.ctx_lens[idx].cpu().clone(),
            "latents": st.latent_pool[:, pages].cpu().clone(),
            "draft_logits": w.metadata.draft_logits[idx].float().cpu().clone(),
            # the confidences the slot's next step reports (the engine keeps them per slot: the worker's
            # draft_confidences rows are the last drafting call's, whichever slots it ran)
            "confidences": torch.tensor([eng._pending_confidences[s] for s in slots])}


def _assert_same(a: dict, b: dict, exact_drafts: bool = True) -> None:
    """Bit for bit; with ``exact_drafts=False`` (the same rows in launches of another row count on a GPU, whose
    drafter GEMMs take tiles by the row count) the draft distributions and confidences within fp32 rounding and the
    drafts themselves not compared (a near tie may flip), all the rest bit for bit."""
    for name in a:
        if exact_drafts:
            assert torch.equal(a[name], b[name]), name
        elif name in ("draft_logits", "confidences"):
            torch.testing.assert_close(a[name], b[name], msg=name)
        elif name == "slot_tokens":
            assert torch.equal(a[name][:, 0], b[name][:, 0]), name  # the first token
        else:
            assert torch.equal(a[name], b[name]), name


class _PaddedRunner:
    """A runner that pads the admission to ``extra`` more rows than it holds (dummy rows), as a replayed graph of
    a larger row count does, and runs it eagerly on the CPU."""

    def __init__(self, worker, extra: int):
        self.worker, self.extra, self.calls = worker, extra, []

    def step(self, slots):
        b = len(slots) + self.extra
        self.calls.append(b)
        self.worker.set_admission_rows(list(slots), b)
        return self.worker.admission_draft(b)


def test_padded_first_block_equals_the_block_over_its_rows():
    """Padded with dummy rows (what a replay of a larger graph runs) the first block leaves each admitted slot
    bit for bit as the block over exactly its rows, and a request already running on another slot untouched."""
    slots = [2, 0, 5, 3]
    plain = _engine()
    padded = _engine()
    w = padded.worker()
    # a request running on slot 1 before the admission: its state must not move
    for eng in (plain, padded):
        eng.runner("speculative")  # builds the admission runner too (graphs off: eager at the admission's rows)
        r = Request([9, 8, 7, 6, 5], max_new_tokens=4)
        eng.validate(r)
        eng.reserve(1, r)
        eng.prefill_slots([1], [r])
    before = _slot_state(padded, [1])
    assert w.admission_runner is not None and not w.admission_runner.enabled
    w.admission_runner = _PaddedRunner(w, extra=3)
    firsts = _admit(padded, slots)
    assert w.admission_runner.calls == [len(slots) + 3]
    assert firsts == _admit(plain, slots)
    # on a CPU rows are computed independently of their neighbours (bit for bit); on a GPU within rounding
    _assert_same(_slot_state(padded, slots), _slot_state(plain, slots), exact_drafts=not torch.cuda.is_available())
    _assert_same(_slot_state(padded, [1]), before)
    assert (padded.state.slot_tokens[slots] != 0).any()  # drafts were written (a block of zeros would pass too)


def test_first_block_rows_checked():
    w = _engine().worker()
    with pytest.raises(ValueError, match="do not fit"):
        w.set_admission_rows([0, 1, 2], 2)
    with pytest.raises(ValueError, match="request slots"):
        w.set_admission_rows([w.state.dummy_slot], 1)
    w.set_admission_rows([0, 1], 4)
    with pytest.raises(ValueError, match="prepared 4"):
        w.admission_draft(2)


def test_rows_written_slots_then_dummies():
    """A step's and an admission's rows: the slots first, the dummy slot after them, flagged; a later call over
    fewer rows rewrites every row of its batch size (a stale slot left in a padded row would step a request twice)."""
    w = _engine().worker()
    dummy = w.state.dummy_slot
    for write, ids, flags in ((w.set_rows, w.slot_ids, w.is_dummy),
                              (w.set_admission_rows, w.admit_slot_ids, w.admit_is_dummy)):
        write([4, 0, 6], 4)
        assert ids[:4].tolist() == [4, 0, 6, dummy] and flags[:4].tolist() == [False, False, False, True]
        write([2], 4)
        assert ids[:4].tolist() == [2, dummy, dummy, dummy] and flags[:4].tolist() == [False, True, True, True]
        write([1, 3], 2)
        assert ids[:2].tolist() == [1, 3] and flags[:2].tolist() == [False, False]


@cuda_only
def test_gpu_replayed_first_block_equals_eager():
    """On CUDA: the first block captured per row count at engine start and replayed for admissions of 4 and 1 rows
    (graphs of their own row count: every admitted slot's state bit for bit the eager block's) and of 3 (padded to
    the graph of 4: the drafter's GEMMs take another tile, so its draft distributions within rounding), and greedy
    generation continues from it with the eager engine's tokens."""
    graphed = _engine(graphs=True)
    eager = _engine(graphs=True)
    eager.runner("speculative")
    eager.worker().admission_runner = None  # the eager block over the admission's rows
    graphed.runner("speculative")
    runner = graphed.worker().admission_runner
    assert runner is not None and runner.captured() == list(graphed.batch_sizes)
    for slots in ([4, 1, 6, 7], [2], [5, 0, 3]):
        for eng in (graphed, eager):
            reqs = _requests()[:len(slots)]
            for s, r in zip(slots, reqs):
                eng.validate(r)
                eng.reserve(s, r)
            eng.prefill_slots(slots, reqs)
        _assert_same(_slot_state(graphed, slots), _slot_state(eager, slots), exact_drafts=len(slots) != 3)
        for eng in (graphed, eager):
            for s in slots:
                eng.pages.free(s)
    assert sum(runner.replays.values()) == 3 and runner.eager_steps == 0
    greedy = [Request(list(p), max_new_tokens=6) for p in PROMPTS]
    want = [r.output_ids for r in eager.generate(greedy)[0]]
    assert [r.output_ids for r in graphed.generate(greedy)[0]] == want
