"""``speculant chat``: turns typed on stdin, replies streamed to stdout, and from the second turn
on the prompt's earlier tokens come from the prefix cache; the replies are a cold session's."""

from __future__ import annotations

import io
import json
import re
import shutil


import speculant
from speculant.cli import main

CPU = ["--backend", "torch", "--device", "cpu", "--dtype", "float32", "--drafter", "none"]
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
LINES = ["def add(a, b):", "/reset", "def add(a, b):", "and now subtract"]


def chat(monkeypatch, capsys, target) -> tuple[str, str, list[tuple[int, int]]]:
    """(stdout, stderr, [(cached, prompt tokens) per turn])."""
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(LINES) + "\n"))
    assert main(["chat", "--target", str(target), *CPU, "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    turns = [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+) prompt tokens from the prefix cache", err)]
    return out, err, turns


def cold_replies(target, templated: bool) -> list[str]:
    """The same turns through engine.session() with the cache off."""
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)},
              "generation": {"max_new_tokens": 12}, "prefix_cache": {"max_bytes": 0}}
    engine, replies, session = speculant.load_engine(config), [], None
    for line in LINES:
        if session is None or line == "/reset":
            session = engine.session()
            if line == "/reset":
                continue
        if templated:
            replies.append(session.say(line).text)
        else:
            ids = engine.tokenizer.encode(line + "\n", add_special_tokens=not session.token_ids)
            replies.append(session.extend(ids).text)
    return replies


def test_chat_continues_the_text_without_a_template(tiny_target, monkeypatch, capsys):
    out, err, turns = chat(monkeypatch, capsys, tiny_target)
    assert "no chat template: each line continues the text" in err
    assert out == "".join(reply + "\n" for reply in cold_replies(tiny_target, templated=False))
    assert [cached > 0 for cached, _ in turns] == [False, True, True]  # /reset: a new conversation, same start
    assert turns[2][0] > turns[0][1]  # the third turn reuses the second's prompt and reply


def test_chat_uses_the_chat_template_and_the_cache(tiny_target, tmp_path, monkeypatch, capsys):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATE
    config_file.write_text(json.dumps(config))
    out, err, turns = chat(monkeypatch, capsys, target)
    assert "no chat template" not in err
    assert out == "".join(reply + "\n" for reply in cold_replies(target, templated=True))
    assert [cached > 0 for cached, _ in turns] == [False, True, True]
