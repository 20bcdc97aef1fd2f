"""``trtllm-ext bench step``: one DSpark decode step split into stages, this module's path vs the stock path.

Per batch size B (every row a live generation request, K drafts), on one rank:

* ``target fwd``: the target's verification forward + its LM head GEMM (identical in both paths);
* ``select``: the target's tokens from the ``[B*(K+1), V]`` logits -- this module's selection kernel
  (one launch, exact ``torch.argmax`` order, keyed Gumbel ready) vs the stock gathered ``torch.argmax``;
* ``tail``: strict acceptance + paged-latent bookkeeping + context-latent store -- the fused kernels vs
  their eager chains (a capturable eager store: masked rows go to the scratch page);
* ``draft fwd``: context latents + the drafter's block decode + its LM head GEMM (identical);
* ``chain``: the Markov draft chain -- the worker's :class:`MarkovChain` (configured mode) vs the eager
  reference chain;
* ``outside target`` = select + tail + draft fwd + chain, and the whole step (``worker.forward`` vs the
  same step assembled from the stock pieces), each captured in a CUDA graph.

Every stage is captured in its own CUDA graph and replayed (median of many); the inputs are one set
(the logits at B >= 8 and the weights already exceed the 60 MiB L2; small B may be flattered equally for
both paths). On CPU: a smoke run of a tiny model (timings meaningless, printed as "-").
"""

from __future__ import annotations

import argparse

from tensorrt_llm_ext.runtime.launch import ensure_triton_interpreter

ensure_triton_interpreter()  # before any kernel module is imported (a CPU smoke run needs the interpreter)

import torch  # noqa: E402

from tensorrt_llm_ext.bench.harness import BenchTimer, fmt, print_table, register_benchmark  # noqa: E402
from tensorrt_llm_ext.runtime.config import load_config  # noqa: E402
from tensorrt_llm_ext.runtime.engine import Engine  # noqa: E402
from tensorrt_llm_ext.contract import DrafterBlockInputs, PagedLatentCache  # noqa: E402
from tensorrt_llm_ext.speculative.markov_chain import markov_chain_logits_reference  # noqa: E402
from tensorrt_llm_ext.kernels.paged_latent import paged_latent_step, paged_latent_step_reference, store_context_latents
from tensorrt_llm_ext.kernels.strict_accept import strict_accept, strict_accept_reference
from tensorrt_llm_ext.speculative.vocab_parallel import gumbel_sample  # noqa: E402

GPU_MODEL = {
    "model.dtype": "bfloat16", "model.drafter_init": "random", "model.target.vocab_size": 128256,
    "model.target.hidden_size": 1024, "model.target.num_layers": 2, "model.target.num_heads": 8,
    "model.target.num_kv_heads": 8, "model.target.head_dim": 128, "model.target.intermediate_size": 2816,
    "model.target.capture_layers": [0, 1], "model.drafter.num_layers": 1, "model.drafter.num_heads": 8,
    "model.drafter.head_dim": 64, "model.drafter.latent_dim": 256, "model.drafter.intermediate_size": 2816,
    "speculative_config.markov_rank": 256, "max_seq_len": 256, "kv_cache_config.tokens_per_block": 64,
}
CPU_MODEL = {
    "model.drafter_init": "random", "model.target.vocab_size": 517, "model.target.hidden_size": 32,
    "model.target.head_dim": 8, "model.target.num_layers": 2, "model.target.capture_layers": [0, 1],
    "model.target.intermediate_size": 64, "model.drafter.num_layers": 1, "model.drafter.latent_dim": 16,
    "model.drafter.head_dim": 8, "model.drafter.intermediate_size": 64, "speculative_config.markov_rank": 8,
    "max_seq_len": 48, "kv_cache_config.tokens_per_block": 8,
}


def _add_args(p: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64" if cuda else "1,2")
    p.add_argument("--draft-len", type=int, default=7 if cuda else 3)
    p.add_argument("--vocab", type=int, default=128256 if cuda else 517)
    p.add_argument("--prompt-len", type=int, default=64 if cuda else 8)
    p.add_argument("--markov-mode", choices=["exact", "fused", "auto"], default="auto")


def _stock_store(latents, pages, offsets, mask, pool):
    """Capturable eager store: rows not to be written go to the scratch (last) page of the pool."""
    scratch = pool.shape[1] - 1
    ok = mask & (pages >= 0)
    pc = torch.where(ok, pages.long(), torch.full_like(pages, scratch, dtype=torch.long))
    pool[:, pc, offsets.long()] = latents.transpose(0, 1).to(pool.dtype)


class _StepBench:
    """One engine with ``B`` live requests, the inputs of every stage, and both paths' stage callables."""

    def __init__(self, eng: Engine, batch: int, prompt_len: int):
        self.eng, self.b = eng, batch
        w = eng.worker()
        self.w = w
        st = eng.state
        k = eng.draft_len
        v = eng.vocab_size
        for slot in range(batch):
            eng.pages.allocate(slot, eng.pages.max_pages_per_slot)
            prompt = [(slot * 7919 + i * 104729) % v for i in range(prompt_len)]
            w.prefill(slot, prompt, 0.0, slot)
        w.set_rows(list(range(batch)), batch)
        dev = eng.device
        self.slots = w.slot_ids[:batch]
        sl = self.slots.long()
        self.tokens = st.slot_tokens[sl].clone()
        self.positions = st.ctx_lens[sl].long()[:, None] + w.cols
        out = eng.target(self.tokens, self.positions, self.slots, st.kv_cache)
        self.hidden, self.captured = out.hidden_states, out.captured
        self.logits = eng.target.logits(self.hidden)
        rows = batch * (k + 1)
        self.temps = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.offsets = (self.positions + 1).reshape(-1)
        self.sel_out = torch.empty(rows, dtype=torch.int64, device=dev)
        self.targets = gumbel_sample(self.logits, self.temps, self.seeds, self.offsets, 0, v)
        self.drafts = self.tokens[:, 1:].contiguous()
        self.dummy = w.is_dummy[:batch]
        self.acc_out = (torch.empty(batch, k + 1, dtype=torch.int64, device=dev),
                        torch.empty(batch, dtype=torch.int32, device=dev))
        self.tail = w.tail_buffers(batch)
        self.latents = eng.drafter.compute_context_latents(self.captured)
        accepted, n_acc = strict_accept(self.drafts, self.targets.view(batch, k + 1), 0, out=self.acc_out)
        ctx = st.ctx_lens.clone()
        self.kwargs = dict(num_contexts=0, page_size=st.page_size, draft_len=k, max_ctx_len=st.max_ctx_len,
                           mask_token_id=w.mask_token_id)
        paged_latent_step(accepted, n_acc, self.slots, self.dummy, st.ctx_lens, st.block_table, out=self.tail,
                          **self.kwargs)
        st.ctx_lens.copy_(ctx)
        self.base = self._draft_fwd()
        # Stages that advance ctx_len restore it first, so thousands of replays never run past the caches.
        self.ctx0 = st.ctx_lens.clone()
        sel = w.vocab_parallel
        self.w1 = w.markov.weights.markov_w1
        self.w2 = w.markov.weights.markov_w2
        self.chain_vocab = (w.markov.weights.vocab_start, w.markov.weights.vocab_size)
        assert sel is not None

    # -- shared stages ---------------------------------------------------------------------------------
    def target_fwd(self):
        st = self.eng.state
        out = self.eng.target(self.tokens, self.positions, self.slots, st.kv_cache)
        return self.eng.target.logits(out.hidden_states)

    def _draft_fwd(self):
        st = self.eng.state
        lat = self.eng.drafter.compute_context_latents(self.captured)
        cache = PagedLatentCache(pool=st.latent_pool, block_table=st.block_table)
        hidden = self.eng.drafter.forward_block(DrafterBlockInputs(self.tail.block_input_ids, self.slots,
                                                                   self.tail.placement, cache))
        del lat
        return self.eng.drafter.lm_head(hidden)

    def draft_fwd(self):
        return self._draft_fwd()

    # -- this module -----------------------------------------------------------------------------------
    def select_ours(self):
        return gumbel_sample(self.logits, self.temps, self.seeds, self.offsets, 0, self.eng.vocab_size,
                             out=self.sel_out)

    def tail_ours(self):
        st = self.eng.state
        st.ctx_lens.copy_(self.ctx0)
        accepted, n_acc = strict_accept(self.drafts, self.targets.view(self.b, -1), 0, out=self.acc_out)
        t = paged_latent_step(accepted, n_acc, self.slots, self.dummy, st.ctx_lens, st.block_table, out=self.tail,
                              **self.kwargs)
        store_context_latents(self.latents, t.latent_pages.view(-1), t.latent_offsets.view(-1),
                              t.latent_write_mask.view(-1), st.latent_pool)

    def chain_ours(self):
        return self.w.markov(self.base, self.tail.bonus_tokens)

    def step_ours(self):
        self.eng.state.ctx_lens.copy_(self.ctx0)
        return self.w.forward(self.b)

    # -- stock ---------------------------------------------------------------------------------------
    def select_stock(self):
        return torch.argmax(self.logits, dim=-1)

    def tail_stock(self):
        st = self.eng.state
        st.ctx_lens.copy_(self.ctx0)
        accepted, n_acc = strict_accept_reference(self.drafts, self.targets.view(self.b, -1), 0)
        t = paged_latent_step_reference(accepted, n_acc, self.slots, self.dummy, st.ctx_lens, st.block_table,
                                        **self.kwargs)
        _stock_store(self.latents, t.latent_pages.view(-1), t.latent_offsets.view(-1), t.latent_write_mask.view(-1),
                     st.latent_pool)

    def chain_stock(self):
        start, vocab = self.chain_vocab
        return markov_chain_logits_reference(self.base, self.tail.bonus_tokens, self.w1, self.w2, vocab_start=start,
                                             vocab_size=vocab)

    def step_stock(self):
        """The whole step from stock pieces: gathered argmax, eager tail, eager chain."""
        eng, st, b = self.eng, self.eng.state, self.b
        st.ctx_lens.copy_(self.ctx0)
        sl = self.slots.long()
        tokens = st.slot_tokens[sl]
        positions = st.ctx_lens[sl].long()[:, None] + self.w.cols
        out = eng.target(tokens, positions, self.slots, st.kv_cache)
        targets = torch.argmax(eng.target.logits(out.hidden_states), dim=-1)
        accepted, n_acc = strict_accept_reference(tokens[:, 1:], targets.view(b, -1), 0)
        t = paged_latent_step_reference(accepted, n_acc, self.slots, self.dummy, st.ctx_lens, st.block_table,
                                        **self.kwargs)
        lat = eng.drafter.compute_context_latents(out.captured)
        _stock_store(lat, t.latent_pages.view(-1), t.latent_offsets.view(-1), t.latent_write_mask.view(-1),
                     st.latent_pool)
        cache = PagedLatentCache(pool=st.latent_pool, block_table=st.block_table)
        hidden = eng.drafter.forward_block(DrafterBlockInputs(t.block_input_ids, self.slots, t.placement, cache))
        start, vocab = self.chain_vocab
        _, drafts = markov_chain_logits_reference(eng.drafter.lm_head(hidden), t.bonus_tokens, self.w1, self.w2,
                                                  vocab_start=start, vocab_size=vocab)
        st.slot_tokens[sl] = torch.cat((t.bonus_tokens.long()[:, None], drafts), dim=1)

    def release(self):
        for slot in range(self.b):
            self.eng.pages.free(slot)


@register_benchmark("step", "one DSpark decode step by stage: this module vs the stock path (CUDA graphs)",
                    add_args=_add_args)
def run(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    model = dict(GPU_MODEL if cuda else CPU_MODEL)
    model.update({"model.target.vocab_size": args.vocab, "speculative_config.max_draft_len": args.draft_len,
                  "speculative_config.markov_chain_mode": args.markov_mode, "max_batch_size": max(sizes)})
    cfg = load_config(**model)
    timer = BenchTimer()
    rows, notes = [], []
    eng = Engine(cfg)
    for b in sizes:
        bench = _StepBench(eng, b, args.prompt_len)
        snapshot = [t.clone() for t in eng.state.mutable_tensors()]
        t = {}
        for name in ("target_fwd", "draft_fwd", "select_ours", "select_stock", "tail_ours", "tail_stock",
                     "chain_ours", "chain_stock", "step_ours", "step_stock"):
            t[name] = timer.time_graph([getattr(bench, name)])
            for dst, src in zip(eng.state.mutable_tensors(), snapshot):  # every stage starts from the same state
                dst.copy_(src)
        ours = t["select_ours"] + t["tail_ours"] + t["draft_fwd"] + t["chain_ours"]
        stock = t["select_stock"] + t["tail_stock"] + t["draft_fwd"] + t["chain_stock"]
        pair = lambda a, s: f"{fmt(t[a])} / {fmt(t[s])}"  # noqa: E731
        rows.append([b, fmt(t["target_fwd"]), pair("select_ours", "select_stock"), pair("tail_ours", "tail_stock"),
                     fmt(t["draft_fwd"]), pair("chain_ours", "chain_stock"), f"{fmt(ours)} / {fmt(stock)}",
                     fmt(stock / ours, 2) if ours == ours else "-", pair("step_ours", "step_stock")])
        bench.release()
    sel = eng.worker().selection.describe()
    notes += [f"model: vocab {cfg.model.target.vocab_size}, hidden {cfg.model.target.hidden_size}, "
              f"K={cfg.draft_len}, r={cfg.speculative_config.markov_rank}, markov mode "
              f"{cfg.speculative_config.markov_chain_mode}, dtype {eng.target.dtype}; {sel}",
              "times in us, median of CUDA-graph replays; 'ours / stock'; outside target = select + tail + "
              "draft fwd + chain (draft fwd is the same model in both paths); stock select = torch.argmax on the "
              "gathered logits, stock tail/chain = the eager reference chains"]
    text = print_table("bench step: DSpark decode step by stage, this module / stock",
                       ["B", "target fwd", "select", "tail", "draft fwd", "chain", "outside target", "gain x",
                        "whole step"], rows, notes)
    if getattr(args, "out", None):
        with open(args.out, "a") as f:
            f.write(text + "\n")
