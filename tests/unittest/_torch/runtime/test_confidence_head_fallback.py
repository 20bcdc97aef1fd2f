"""A drafter's confidence head that cannot be used -- unreadable, an error without a message, tensors of
another shape -- leaves the drafter without confidences with one warning line, never a traceback."""

from __future__ import annotations

import logging

import pytest

from tensorrt_llm_ext.runtime import model_loader


class _Drafter:
    def __init__(self, error: str | None = None):
        self.error, self.head = error, None

    def load_confidence_head(self, head):
        if self.error is not None:
            raise ValueError(self.error)
        self.head = head


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("content", [b"", b"\xff" * 8 + b"x", b"\x10" + b"\x00" * 7 + b'{"a":1}'],
                         ids=["empty", "garbage", "bad_header"])
def test_an_unreadable_head_file_is_one_warning_line(tmp_path, caplog, content):
    (tmp_path / "confidence_head.safetensors").write_bytes(content)
    d = _Drafter()
    with caplog.at_level(logging.WARNING, logger="tensorrt_llm_ext"):
        assert model_loader.attach_confidence_head(d, str(tmp_path)) is False
    (w,) = _warnings(caplog)
    assert "unreadable" in w and "serving without confidences" in w and "\n" not in w and d.head is None


def test_an_error_without_a_message_and_a_head_of_another_shape_are_one_warning_line(tmp_path, caplog, monkeypatch):
    import safetensors.torch
    import torch

    f = tmp_path / "confidence_head.safetensors"
    safetensors.torch.save_file({"confidence.weight": torch.zeros(3), "confidence.bias": torch.zeros(1)}, str(f))
    with caplog.at_level(logging.WARNING, logger="tensorrt_llm_ext"):
        d = _Drafter("DSparkDrafter confidence head: confidence.weight must be (40,), got (3,)\nmore")
        assert model_loader.attach_confidence_head(d, str(tmp_path)) is False
        assert model_loader.attach_confidence_head(_Drafter(), str(tmp_path)) is True

        def raises_empty(path):
            raise OSError()
        monkeypatch.setattr(safetensors.torch, "load_file", raises_empty)
        assert model_loader.attach_confidence_head(_Drafter(), str(tmp_path)) is False
    shape, empty = _warnings(caplog)
    assert "does not fit this drafter (DSparkDrafter confidence head: confidence.weight must be (40,)" in shape
    assert "unreadable (OSError)" in empty and "\n" not in shape + empty
