"""Probe: does ``trtllm-ext serve`` honour top-p under its default CUDA graphs?

Starts ``serve`` (extra arguments are passed through: ``--no-speculation``, ``--no-cuda-graph``, ``--config``,
``--tp N``) on a free loopback port, asks one greedy completion and ``--seeds`` completions at ``temperature 1,
top_p 1e-3`` of the same prompt (the top-p set is the argmax token whenever the vocabulary has at most 1000
tokens, as the embedded model's 1536 does in practice), and prints how many equal the greedy answer and how
many distinct answers there are. Exit 0 iff every seed equals greedy.

    python3 scripts/serve_top_p_probe.py [--seeds 12] [--max-tokens 32] [-- serve args ...]

Needs the serve stack (fastapi, uvicorn, httpx) on the machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx

from tensorrt_llm_ext.bench.server_process import start_server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default="5,17,300,42,7,7", help="token ids")
    p.add_argument("serve_args", nargs="*", help="arguments for `trtllm-ext serve` (after --)")
    args = p.parse_args()
    prompt = [int(t) for t in args.prompt.split(",")]
    log = Path(tempfile.mkdtemp(prefix="top_p_probe_")) / "serve.log"
    server = start_server(list(args.serve_args), str(log))
    try:
        def complete(**sampling) -> list[int]:
            r = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, **sampling})
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        greedy = complete(temperature=0.0)
        answers = [complete(temperature=1.0, top_p=1e-3, seed=s) for s in range(args.seeds)]
    finally:
        rc = server.stop(60)
    equal = sum(a == greedy for a in answers)
    graphs = [line for line in server.log().splitlines() if "captured" in line or "runs eagerly" in line]
    print(f"serve {' '.join(args.serve_args) or '(defaults)'}: T=1 top_p=1e-3, {equal} of {args.seeds} seeds equal "
          f"the greedy answer, {len({tuple(a) for a in answers})} distinct answers; server exit {rc}")
    for line in graphs:
        print(f"  log: {line.strip()}")
    return 0 if equal == args.seeds else 1


if __name__ == "__main__":
    sys.exit(main())
