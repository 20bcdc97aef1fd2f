"""Chat messages as the server parses them (``openai_protocol.ChatMessage``)."""

from __future__ import annotations

import pytest

from tensorrt_llm_ext.runtime.openai_protocol import ChatMessage


def test_text_content_parts_reach_the_template_as_lines():
    """OpenAI content parts of one message: their texts joined by a newline, as vLLM joins them (they were joined
    with nothing: ``["Describe", "this"]`` reached the template as ``"Describethis"``)."""
    parts = [{"type": "text", "text": "Describe"}, {"type": "text", "text": "this"}]
    assert ChatMessage.model_validate({"role": "user", "content": parts}).content == "Describe\nthis"
    assert ChatMessage.model_validate({"role": "user", "content": parts[:1]}).content == "Describe"
    assert ChatMessage.model_validate({"role": "user", "content": "as sent"}).content == "as sent"
    with pytest.raises(ValueError, match="only text content parts"):
        ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_a_message_other_than_an_assistant_turn_needs_content(role):
    """OpenAI's schema requires ``content`` on user, system, developer and tool messages (a missing one was taken as
    an empty turn and answered); an assistant turn may leave it out (tool calls only), and an empty string is
    content."""
    with pytest.raises(ValueError, match=f"a {role} message needs content"):
        ChatMessage.model_validate({"role": role})
    assert ChatMessage.model_validate({"role": role, "content": ""}).content == ""
    assert ChatMessage.model_validate({"role": "assistant"}).content is None
