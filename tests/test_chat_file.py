"""`headway generate --chat-file`: a prompt file read into chat messages (the command as typed: test_cli.py)."""

import json

import pytest

from headway.chat_file import read_chat_file


def test_a_chat_file_is_a_message_list_one_message_a_record_or_text(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (tmp_path / "list.json").write_text(json.dumps(messages))
    (tmp_path / "record.json").write_text(json.dumps({"messages": messages}))
    (tmp_path / "sharegpt.json").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}))
    (tmp_path / "prompt.txt").write_text("[not json] hi\n")
    (tmp_path / "number.txt").write_text("42")
    assert read_chat_file(tmp_path / "list.json") == messages == read_chat_file(tmp_path / "record.json")
    assert read_chat_file(tmp_path / "sharegpt.json") == [{"role": "user", "content": "hi"}]
    assert read_chat_file(tmp_path / "prompt.txt") == [{"role": "user", "content": "[not json] hi\n"}]
    assert read_chat_file(tmp_path / "number.txt") == [{"role": "user", "content": "42"}]
    (tmp_path / "system.json").write_text(json.dumps([{"role": "system", "content": ""}, messages[1]]))
    assert read_chat_file(tmp_path / "system.json")[1] == messages[1]  # an empty system message is harmless
    (tmp_path / "one.json").write_text(json.dumps(messages[1]))  # one message, not in a list
    assert read_chat_file(tmp_path / "one.json") == [messages[1]]


@pytest.mark.parametrize("name, content, problem", [
    ("chat.json", '[{"role": "user", "content": "hi"}', "is not valid JSON: Expecting ',' delimiter (line 1, column 35)"),
    ("chat.json", '{"prompt": "hi"}', "holds an object, not a list"),
    ("chat.json", "", "is empty"),
    ("chat.txt", " \n", "is empty"),
    ("chat.json", '[{"role": "user"}]', "holds message 1 without content"),
    ("chat.json", "[]", "holds no messages"),
    ("chat.json", '[{"role": "wizard", "content": "hi"}]', ": unknown role 'wizard'"),
    ("chat.txt", b"x" * 128 + b"\x80\x81", "is not UTF-8 text (byte 128)"),
])
def test_a_bad_chat_file_names_itself(name, content, problem, tmp_path):
    chat = tmp_path / name
    chat.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as exc:
        read_chat_file(chat)
    assert str(exc.value).startswith(f"chat file {chat}") and problem in str(exc.value), str(exc.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_chat_file(tmp_path / "missing.json")
