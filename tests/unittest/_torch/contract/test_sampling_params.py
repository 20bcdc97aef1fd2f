"""SamplingParams: one type for a request's sampling rules -- the effective temperature decided in fp32 as the
slot holds it, and the range checks every front end (HTTP, Request, CLI, benchmarks) words the same way."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tensorrt_llm_ext.contract import FP32_MAX, MIN_TEMPERATURE, MIN_TOP_P, SamplingParams, sampling_problem

FP32_MIN_TEMPERATURE = float(torch.tensor(MIN_TEMPERATURE, dtype=torch.float32))


def test_effective_temperature_is_greedy_exactly_where_the_fp32_slot_is_below_the_minimum():
    assert FP32_MIN_TEMPERATURE < MIN_TEMPERATURE  # so [FP32_MIN_TEMPERATURE, MIN_TEMPERATURE) is not empty
    near = [MIN_TEMPERATURE * (1 + d) for d in (-1e-3, -1e-7, -1e-8, -1e-9, 0.0, 1e-9, 1e-7)]
    for t in [0.0, 1e-45, 1e-38, FP32_MIN_TEMPERATURE, math.nextafter(FP32_MIN_TEMPERATURE, 0), *near, 0.5, 1.0,
              3.0e38]:
        s = SamplingParams(temperature=t)
        slot = torch.tensor([t], dtype=torch.float32)
        # the selection API refuses a positive slot temperature below the minimum: the rule never sends it one
        refused_on_device = bool(((slot > 0) & (slot < MIN_TEMPERATURE)).any())
        assert s.is_greedy == (t == 0 or refused_on_device), t
        assert s.effective_temperature == (0.0 if s.is_greedy else t)
    assert SamplingParams(temperature=MIN_TEMPERATURE * (1 - 1e-9)).effective_temperature > 0  # fp32 decides
    assert SamplingParams(temperature=MIN_TEMPERATURE * 0.99).effective_temperature == 0.0


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", 1e39),  # finite in float64, inf in the fp32 slot
    ("temperature", 10**400), ("temperature", True), ("temperature", "0.7"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_p", -0.1), ("top_p", False),
    ("seed", -1), ("seed", 2**63), ("seed", True), ("seed", 1.5),
], ids=lambda v: str(v)[:12])
def test_bad_values_are_refused_naming_the_field(field, value):
    problem = sampling_problem(field, value)
    assert problem is not None and repr(value) in problem
    assert problem.startswith("expected ") or problem.endswith(f"overflows fp32, the engine's precision (at most "
                                                                f"{FP32_MAX:.6g})")
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value}).check()
    assert str(err.value) == f"{field}: {problem}"


def test_good_values_and_the_top_p_set():
    s = SamplingParams(temperature=0.7, top_p=0.9, seed=2**63 - 1)
    assert (s.effective_temperature, s.is_greedy, s.restricts_top_p) == (0.7, False, True)
    assert not SamplingParams(temperature=0.0, top_p=0.5).restricts_top_p  # a greedy request ignores top_p
    assert not SamplingParams(temperature=1.0, top_p=1.0).restricts_top_p
    assert SamplingParams(temperature=2, top_p=1, seed=0).effective_temperature == 2.0  # ints are numbers
    # the fp32 boundary: the largest fp32 temperature is served; a top-p that is 0 in fp32 keeps the top token
    assert SamplingParams(temperature=FP32_MAX).effective_temperature == FP32_MAX
    assert SamplingParams(top_p=1e-46).effective_top_p == MIN_TOP_P == float(torch.tensor(MIN_TOP_P, dtype=torch.float32))
    assert SamplingParams(top_p=0.25).effective_top_p == 0.25
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.temperature = 1.0
    with pytest.raises(ValueError, match="expected a SamplingParams field"):
        sampling_problem("top_q", 3)


def test_host_fp32_rounding_and_packed_words_are_torch_bits():
    """The host's fp32 rounding of a sampling field (through ``struct``, asked several times an admission) and the
    fp32 fields packed two to an int64 word for one host-to-device copy: bit for bit what torch's fp32 conversion
    gives, on random doubles and bit patterns, subnormals, ties, infinities, NaN and the fp32 overflow edge."""
    import random
    import struct

    from tensorrt_llm_ext.contract import _fp32, fp32_words

    rng = random.Random(3)
    vals = [0.0, -0.0, 2.0 ** -149, 2.0 ** -150, 3 * 2.0 ** -151, 3.4028234663852886e38, 3.4028235677973366e38,
            3.5e38, -1e39, 1e308, float("inf"), -float("inf"), float("nan"), 0.1, 1 / 3, 5, 2 ** 100]
    vals += [rng.choice((1, -1)) * rng.random() * 2.0 ** rng.uniform(-160, 140) for _ in range(20000)]
    vals += [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(20000)]

    def bits(x: float) -> int:
        return torch.tensor(x, dtype=torch.float32).view(torch.int32).item()

    for v in vals:
        want = float(torch.tensor(float(v), dtype=torch.float32))
        got = _fp32(v)
        assert (math.isnan(got) and math.isnan(want)) or struct.pack("<d", got) == struct.pack("<d", want), v
    for n in (1, 2, 3, 8, 33):
        chunk = vals[:n] if n < 4 else rng.sample(vals, n)
        back = torch.tensor(fp32_words(chunk), dtype=torch.int64).view(torch.float32)[:n]
        assert back.view(torch.int32).tolist() == [bits(float(x)) for x in chunk], n
