"""Speculative-decoding pieces: the contract types, token selection, the Markov chain, the spec tail, workers."""
