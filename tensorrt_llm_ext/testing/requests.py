"""Requests written as flat dicts (test tables): :func:`make_request` puts the sampling fields into the
request's :class:`~tensorrt_llm_ext.contract.SamplingParams` (test support)."""

from __future__ import annotations

from dataclasses import fields

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request

_SAMPLING = {f.name for f in fields(SamplingParams)}


def make_request(**flat) -> Request:
    """``make_request(prompt_ids=[1, 2], max_new_tokens=4, temperature=0.7, seed=3)`` -> a :class:`Request`
    whose ``sampling`` holds ``temperature`` and ``seed``."""
    sampling = {k: flat.pop(k) for k in list(flat) if k in _SAMPLING}
    return Request(**flat, sampling=SamplingParams(**sampling))
