#!/usr/bin/env python3
"""Ablations of the train-drafter recipe: one knob changed at a time from a base, each run scored on the same
held-out sequences (the training-side greedy walk, which equals what `generate` measures step by step; see
tests/integration/test_drafter_train_serve_agreement.py).

    python3 scripts/drafter_ablation.py MODEL_DIR OUT_DIR [--base K=V ...] [--variant NAME K=V ... ...]
                                                          [--out table.md]

Without --variant it runs the built-in set (loss, Markov rank, drafter layers, data size, anchors per sequence).
Variants that keep the base's data knobs reuse the base's generated sequences (``data.pt`` / ``held_out.pt``
copied into their work directory, then ``--resume`` reads them), so they differ in training only. Prints a
markdown table: held-out acceptance length (K = draft_len, greedy walk), its first-position acceptance, the
held-out teacher-forced top-1 at block position 0, the last training TV, wall seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_ext.training.trainer import TrainConfig, train_drafter  # noqa: E402

# Knobs that shape the held-out sequences (held_out.pt) and, with the training-only ones, the training data (data.pt).
HELD_OUT_KNOBS = ("prompts", "max_prompt_tokens", "held_out_percent", "max_new_tokens", "eval_prompts", "seed")
DATA_KNOBS = HELD_OUT_KNOBS + ("num_prompts", "max_turns", "greedy_fraction", "gen_temperature", "gen_top_p")
BUILT_IN = {
    "base (0.9 TV + 0.1 CE)": {},
    "KL only": {"tv_weight": 0.0, "ce_weight": 0.0, "kl_weight": 1.0},
    "CE only": {"tv_weight": 0.0, "ce_weight": 1.0},
    "Markov rank 4": {"markov_rank": 4},
    "2 drafter layers": {"num_layers": 2},
    "1/4 of the prompts": {"num_prompts": None},  # filled from the base: num_prompts // 4
    "1/4 of the anchors": {"anchors": None},  # filled from the base: anchors // 4
}


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _pairs(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, val = item.partition("=")
        out[key.replace("-", "_")] = _value(val)
    return out


def run(model: Path, out: Path, base: dict, variants: dict[str, dict], data_from: Path | None = None) -> list[list]:
    """``data_from``: a work directory of an earlier run with the base's knobs whose sequences are reused."""
    rows = []
    base_work = data_from
    for name, change in variants.items():
        knobs = {**base, **change}
        d = out / f"v{len(rows)}"
        shutil.rmtree(d, ignore_errors=True)
        work = d / "work"
        work.mkdir(parents=True)
        reuse = [f for f, keys in (("data.pt", DATA_KNOBS), ("held_out.pt", HELD_OUT_KNOBS))
                 if base_work is not None and (base_work / f).is_file() and
                 all(knobs.get(k) == base.get(k) for k in keys)]
        for f in reuse:
            shutil.copy(base_work / f, work / f)
        t0 = time.time()
        s = train_drafter(model, d / "drafter", TrainConfig(**knobs), work_dir=work, resume=bool(reuse),
                          progress=False)
        if base_work is None and all(knobs.get(k) == base.get(k) for k in DATA_KNOBS):
            base_work = work
        acc, conf = s["held_out_greedy_acceptance"], s["held_out_confidence"] or {}
        rows.append([name, f"{acc['trained']:.3f}", f"{acc['by_position'][0]:.3f}",
                     f"{conf.get('teacher_forced_top1', [float('nan')])[0]:.3f}", f"{sum(s['last_tv']) / len(s['last_tv']):.3f}",
                     f"{time.time() - t0:.0f}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--base", nargs="*", default=[], metavar="KNOB=VALUE", help="TrainConfig fields of the base")
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME [KNOB=VALUE ...]")
    p.add_argument("--out-md", default=None, help="append the table to this markdown file")
    p.add_argument("--data-from", default=None, help="reuse data.pt / held_out.pt of this earlier work directory "
                                                     "(generated with the same --base)")
    args = p.parse_args()
    base = _pairs(args.base)
    if args.variant:
        variants = {v[0]: _pairs(v[1:]) for v in args.variant}
    else:
        variants = dict(BUILT_IN)
        tc = TrainConfig(**base)
        variants["1/4 of the prompts"] = {"num_prompts": max(1, tc.num_prompts // 4)}
        variants["1/4 of the anchors"] = {"anchors": max(1, tc.anchors // 4)}
    rows = run(Path(args.model), Path(args.out), base, variants, Path(args.data_from) if args.data_from else None)
    head = ["variant", "held-out acceptance length", "first position (walk)", "teacher-forced top-1 pos 0",
            "last TV", "wall s"]
    table = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                      ["| " + " | ".join(map(str, r)) + " |" for r in rows])
    print(f"base: {json.dumps(base)}\n{table}")
    if args.out_md:
        with open(args.out_md, "a") as f:
            f.write(f"base: `{json.dumps(base)}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
