import pytest

from tensorrt_llm_ext.mapping import Mapping


def test_mapping_tp_layout():
    m = Mapping(world_size=8, rank=5, tp_size=4, pp_size=2)
    assert (m.tp_rank, m.pp_rank, m.tp_group) == (1, 1, (4, 5, 6, 7))
    assert m.is_plain_tp and not Mapping(world_size=2, rank=0, tp_size=2, enable_attention_dp=True).is_plain_tp
    assert not Mapping().has_tp


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=4, rank=0, tp_size=3), "does not divide"),
    (dict(world_size=4, rank=4, tp_size=4), "rank"),
    (dict(world_size=4, rank=0, tp_size=2, pp_size=1), "tp_size\\*pp_size"),
    (dict(world_size=0), "positive"),
])
def test_mapping_rejects_bad_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mapping(**kwargs)
