"""Chat templates: how a model formats a conversation, rendered into the prompt of ``/v1/chat/completions``.

A Hugging Face model folder keeps its template (Jinja) in ``chat_template.jinja`` or as the
``chat_template`` of ``tokenizer_config.json``; `ChatTemplate` loads either and renders it the way
``transformers``' ``apply_chat_template`` does: a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``, ``bos_token`` and
``eos_token``, and the helpers ``raise_exception`` and ``strftime_now``. The rendered text already
holds the model's special tokens: encode it without adding any (``add_special_tokens=False``).

Needs the ``serve`` extra (jinja2).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplateError(ValueError):
    """A conversation the template refuses (its ``raise_exception``), or malformed messages."""


def _token_text(value: Any) -> str:
    """A special token of ``tokenizer_config.json``: a string or an ``{"content": ...}`` object."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else ""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may name.

    Attributes:
      source: the template text.
      bos_token, eos_token: the strings ``bos_token`` / ``eos_token`` render as.

    Example::

        template = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\\n{% endfor %}"
                                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
        template.render([{"role": "user", "content": "Hi"}])   # '<|user|>Hi\\n<|assistant|>'
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self):
        _compile(self.source)  # a template that does not parse fails here, not at the first request

    @classmethod
    def from_path(cls, path: str) -> ChatTemplate:
        """From a model folder (`find`), a ``tokenizer_config.json``, or a Jinja file.

        Raises:
          ValueError: no template there.
        """
        if os.path.isdir(path):
            template = cls.find(path)
            if template is None:
                raise ValueError(f"chat template: {path} holds no {CHAT_TEMPLATE_FILE} and no chat_template in "
                                 f"{TOKENIZER_CONFIG_FILE}")
            return template
        if not os.path.isfile(path):
            raise ValueError(f"chat template: no such file {path!r}")
        if os.path.basename(path) == TOKENIZER_CONFIG_FILE:
            template = cls._from_config(path, None)
            if template is None:
                raise ValueError(f"chat template: {path} has no chat_template")
            return template
        with open(path, encoding="utf-8") as f:
            source = f.read()
        config = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG_FILE)
        return cls._from_config(config, source) if os.path.isfile(config) else cls(source)

    @classmethod
    def find(cls, folder: str) -> ChatTemplate | None:
        """The template of a Hugging Face model folder (``chat_template.jinja``, else the
        ``chat_template`` of ``tokenizer_config.json``; a list of named templates gives ``"default"``),
        with the config's ``bos_token`` / ``eos_token``; None when it has none."""
        jinja = os.path.join(folder, CHAT_TEMPLATE_FILE)
        source = None
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                source = f.read()
        config = os.path.join(folder, TOKENIZER_CONFIG_FILE)
        if os.path.isfile(config):
            return cls._from_config(config, source)
        return None if source is None else cls(source)

    @classmethod
    def _from_config(cls, path: str, source: str | None) -> ChatTemplate | None:
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"chat template: cannot read {path}: {err}") from None
        if not isinstance(config, dict):
            raise ValueError(f"chat template: {path} is not a JSON object")
        if source is None:
            source = config.get("chat_template")
            if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}, ...]``; a content may be a
        list of ``{"type": "text", "text": ...}`` parts), ending where the assistant's answer starts
        when ``add_generation_prompt``.

        Raises:
          ChatTemplateError: malformed messages, or the template refused them.
        """
        import jinja2

        messages = check_messages(messages)
        try:
            return _compile(self.source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from None


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` with each content as a string (text parts joined); ChatTemplateError otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("'messages' must be a non-empty list of {'role', 'content'} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ChatTemplateError(f"messages[{i}] must be an object with a 'role' in {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                            "are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
        checked.append({**message, "content": content})
    return checked


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template does not parse: {err}") from None
