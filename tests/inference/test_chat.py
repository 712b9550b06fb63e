"""Chat templates: found where Hugging Face keeps them, rendered as transformers renders them (sandboxed
Jinja with trim_blocks/lstrip_blocks, bos/eos tokens, raise_exception), bad messages refused."""

import json

import pytest

pytest.importorskip("jinja2")

from mtjax.inference.chat import ChatTemplate, ChatTemplateError  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compiles")

# Llama 3's template, shortened to its structure.
LLAMA3 = ("{{ bos_token }}{% for message in messages %}"
          "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
          "+ '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CHATML = ("{% for message in messages %}\n"
          "{% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
          "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}\n"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"}]


def write_config(folder, **fields):
    (folder / "tokenizer_config.json").write_text(json.dumps(fields))


def test_renders_from_tokenizer_config_with_its_special_tokens(tmp_path):
    write_config(tmp_path, chat_template=LLAMA3, bos_token={"content": "<|begin_of_text|>"}, eos_token="<|eot_id|>")
    template = ChatTemplate.find(str(tmp_path))
    assert template.bos_token == "<|begin_of_text|>" and template.eos_token == "<|eot_id|>"
    assert template.render(MESSAGES) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not template.render(MESSAGES, add_generation_prompt=False).endswith("\n\n")
    assert ChatTemplate.from_path(str(tmp_path / "tokenizer_config.json")) == template


def test_block_whitespace_is_trimmed_and_text_parts_are_joined(tmp_path):
    template = ChatTemplate(CHATML)
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template.render(messages) == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ChatTemplateError, match="refused the messages: no tools here"):
        template.render([{"role": "tool", "content": "{}"}])


def test_jinja_file_and_named_templates(tmp_path):
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
                 eos_token="</s>")
    assert ChatTemplate.find(str(tmp_path)).source == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")  # the file wins, the config's tokens stay
    template = ChatTemplate.find(str(tmp_path))
    assert template.render(MESSAGES) == "J</s>"
    assert ChatTemplate.from_path(str(tmp_path / "chat_template.jinja")) == template
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ChatTemplate.find(str(empty)) is None
    with pytest.raises(ValueError, match="holds no chat_template.jinja"):
        ChatTemplate.from_path(str(empty))


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"content": "hi"}], "role"),
    ([{"role": "user", "content": 3}], "string or a list"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
])
def test_bad_messages(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(CHATML).render(messages)


def test_a_template_that_does_not_parse_fails_when_loaded():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        ChatTemplate("{{ messages[0].content.nope() }}").render(MESSAGES)
