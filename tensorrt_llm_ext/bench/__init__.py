"""Benchmarks run by ``trtllm-ext bench <name>``. Each module registers itself on import."""

# name -> module that registers it (imported lazily so one benchmark's imports never slow another)
BENCHMARK_MODULES = {
    "select": "tensorrt_llm_ext.bench.select",
    "markov": "tensorrt_llm_ext.bench.markov",
    "tail": "tensorrt_llm_ext.bench.tail",
    "drafter": "tensorrt_llm_ext.bench.drafter",
    "step": "tensorrt_llm_ext.bench.step",
    "tp": "tensorrt_llm_ext.bench.tp",
    "exchange": "tensorrt_llm_ext.bench.exchange",
    "verify": "tensorrt_llm_ext.bench.verify",
    "serve": "tensorrt_llm_ext.bench.serve",
    "acceptance": "tensorrt_llm_ext.bench.acceptance",
    "target": "tensorrt_llm_ext.bench.target",
    "prefill": "tensorrt_llm_ext.bench.prefill",
}
