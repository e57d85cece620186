"""Where a checkpoint's chat template is found, and prompts with BOS exactly once."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.model_runtime.chat_template import DEFAULT_CHAT_TEMPLATE, find_chat_template
from pdserve.model_runtime.checkpoint import Checkpoint
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.chat import ChatMessage, ChatTemplate


def test_search_order(tmp_path: Path) -> None:
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "chat_template": "tc"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    found = find_chat_template(tmp_path, "embedded", "m.gguf")
    assert (found.template, found.bos_token, found.eos_token) == ("tc", "<s>", "</s>")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "cj"}))
    assert find_chat_template(tmp_path).template == "cj"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    found = find_chat_template(tmp_path)
    assert found.template == "jinja" and found.origin.endswith("chat_template.jinja") and found.found


def test_named_templates_use_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert find_chat_template(tmp_path).template == "plain"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[:1]}))
    assert not find_chat_template(tmp_path).found


def test_embedded_then_built_in(tmp_path: Path) -> None:
    assert find_chat_template(tmp_path, "embedded", "m.gguf (tokenizer.chat_template)").origin.startswith(
        "m.gguf"
    )
    fallback = find_chat_template(tmp_path, bos="<s>")
    assert fallback.template == DEFAULT_CHAT_TEMPLATE and not fallback.found and fallback.bos_token == "<s>"


def test_bos_once_whatever_the_template(tmp_path: Path) -> None:
    tok = TextTokenizer.load(resolve_model("tiny"))
    assert tok is not None
    bos = tok.encode("x")[0]
    assert tok.encode("x", add_special_tokens=False)[0] != bos  # the tokenizer adds BOS to plain text
    messages = [ChatMessage("user", "hi")]
    ids = ChatTemplate.of(tok).prompt_ids(messages)
    assert ids[0] == bos and ids.count(bos) == 1
    # A template that writes BOS itself gets one BOS too (nothing is added around it).
    (tmp_path / "t").mkdir()
    model = resolve_model("tiny").path
    for f in model.iterdir():
        (tmp_path / "t" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "t" / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    own = TextTokenizer.load(Checkpoint.at(tmp_path / "t"))
    assert own is not None
    ids = ChatTemplate.of(own).prompt_ids(messages)
    assert ids == [bos, *tok.encode("hi", add_special_tokens=False)]


def test_the_environment_transformers_renders_in() -> None:
    from pdserve.model_runtime.chat_template import ChatTemplateSource

    source = ChatTemplateSource(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] | tojson }}"
        "{% endfor %}|{{ strftime_now('%Y') | length }}\n",
        "test",
    )
    out = ChatTemplate(source).render([ChatMessage("user", "<b>é</b>"), ChatMessage("user", "second")])
    assert out == '"<b>é</b>"|4'  # no HTML escaping, no ASCII escaping; the trailing newline dropped
