"""The OpenAI body checks of the producer's HTTP front, as FastAPI hands them their errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from producer_service.openai_api import ChatBody, CompletionBody, validation_message, validation_param

BAD = "a\udc00b"  # valid JSON ("a\\udc00b"), not text


def refused(cls, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as ei:
        cls.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in ei.value.errors()]  # FastAPI's loc
    return validation_message(errors), validation_param(errors)


@pytest.mark.parametrize("cls, body, param", [
    (CompletionBody, {"model": "m", "prompt": BAD}, "prompt"),
    (CompletionBody, {"model": BAD, "prompt": "hi"}, "model"),
    (CompletionBody, {"model": "m", "prompt": "hi", "stop": ["x", BAD]}, "stop.1"),
    (CompletionBody, {"model": "m", "prompt": "hi", "method_params": {"k": BAD}}, "method_params.k"),
    (ChatBody, {"model": "m", "messages": [{"role": "user", "content": BAD}]}, "messages.0.content"),
    (ChatBody, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "ok"},
                                                                        {"type": "text", "text": BAD}]}]},
     "messages.0.content.1.text"),
])
def test_a_string_that_is_not_text_is_refused_naming_its_field(cls, body, param):
    message, got = refused(cls, body)
    assert got == param
    assert message.startswith(f"{param} holds a character that is not valid Unicode text at position 1"), message


def test_a_key_that_is_not_text_is_refused_at_its_object():
    message, param = refused(CompletionBody, {"model": "m", "prompt": "hi", "method_params": {BAD: 1}})
    assert param == "method_params" and message.startswith("method_params holds"), message
    message, param = refused(CompletionBody, {"model": "m", "prompt": "hi", BAD: 1})
    assert param is None and message.startswith("the body holds"), message


def test_a_field_error_still_names_its_field():
    message, param = refused(ChatBody, {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]})
    assert param == "messages.0.role" and "messages.0.role" in message, message


def test_a_part_that_is_not_text_is_named_as_param_names_it():
    """The message said messages[0].content[1] while param said messages.0.content.1."""
    from producer_service.openai_api import chat_ids
    from shared.errors import InvalidRequest

    body = ChatBody.model_validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(InvalidRequest) as ei:
        chat_ids(object(), body, 10_000)
    assert ei.value.param == "messages.0.content.1"
    assert str(ei.value).startswith("messages.0.content.1 is a 'image_url' part"), str(ei.value)


def test_a_method_setting_given_as_null_is_not_given_and_a_key_is_a_name():
    """``"method_params": {"block_tokens": null}`` reached the method as the text "null" ("unable to
    parse string as a number"); an empty key was "'': not a known setting" with no param."""
    body = CompletionBody.model_validate({"model": "m", "prompt": "hi", "method_params": {"block_tokens": None,
                                                                                         "block_fit": "heads"}})
    assert body.method_params == {"block_fit": "heads"}
    message, param = refused(CompletionBody, {"model": "m", "prompt": "hi", "method_params": {" ": "1"}})
    assert param == "method_params" and "a key is a setting's name" in message, message
