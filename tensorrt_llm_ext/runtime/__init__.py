"""Runtime: config, requests, caches, the batching engine, CUDA-graph capture, multi-rank launch."""
