"""Instruction data: a conversation (``messages``) or a prompt/completion pair as token ids and a
loss mask (1 on the tokens the model learns to produce: the assistant's, the completion's).

A conversation is rendered by the model's own chat template (``chat_template.jinja`` or the
``chat_template`` of ``tokenizer_config.json`` beside the tokenizer, or ``--chat-template FILE``)
as transformers' ``apply_chat_template`` renders it: Jinja in an immutable sandbox (a template
from the Hub is untrusted: it can read no attribute Python hides and call nothing unsafe), with
``trim_blocks`` and ``lstrip_blocks``, the ``tojson`` filter, ``raise_exception`` and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...), then tokenized whole without
adding special tokens, so the ids are ``apply_chat_template(messages, tokenize=True)``'s. One
difference: ``strftime_now`` is not given, so a template that prints today's date prints its
fixed fallback and the tokens of a data set do not change with the day it is read.

The loss mask: the characters of assistant message ``i`` are those the template adds between the
conversation up to it with the generation prompt (``add_generation_prompt=True``) and the
conversation up to and including it, its end-of-turn marker included (what the model must learn
to emit to stop); a token is learned when it starts inside such a span. That needs a template
that renders a conversation's start as a prefix of the whole (LLaMA-3, Qwen2.5, Mistral and
ChatML templates do); one that does not (it rewrites earlier turns) is refused with one line.

A prompt/completion pair is ``ids(prompt) + ids(completion) + [eos]``, each part tokenized on its
own (as TRL does), the completion and the EOS learned.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding, Tokenizer

from medley.errors import MedleyInputError
from medley.fileio import read_user_bytes

ROLES = ("system", "user", "assistant", "tool")
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")
_TEMPLATE_BYTES = 1 << 20


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): its body
    is rendered as is (medley finds the assistant's characters itself)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with.

    Attributes:
        source: where the template came from (a file, for messages).
        template: the Jinja text.
        special: ``bos_token``, ``eos_token``, ... as ``tokenizer_config.json`` names them.
        digest: hash of the template and the special tokens (part of the cache key).
    """

    source: str
    template: str
    special: dict[str, str]
    digest: str

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        compiled = _compile(self.template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _special_tokens(config: dict) -> dict[str, str]:
    found = {}
    for name in _SPECIAL:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def load_chat_template(tokenizer_dir: Path, given: str | Path | None) -> ChatTemplate:
    """``given`` (``--chat-template``: a Jinja file), else the tokenizer directory's
    ``chat_template.jinja``, else its ``tokenizer_config.json``'s ``chat_template`` (a string,
    or a list of named templates: the one named ``default``)."""
    config_path = tokenizer_dir / "tokenizer_config.json"
    config: dict = {}
    if config_path.is_file():
        try:
            config = json.loads(read_user_bytes(config_path, what="tokenizer config", flag="--tokenizer"))
        except (ValueError, RecursionError):
            raise MedleyInputError(f"--tokenizer {config_path}: not JSON; fix the file") from None
        if not isinstance(config, dict):
            raise MedleyInputError(f"--tokenizer {config_path}: not a JSON object; fix the file")
    if given is not None:
        source, text = str(given), _read_template(Path(given), flag="--chat-template")
    elif (tokenizer_dir / "chat_template.jinja").is_file():
        source = str(tokenizer_dir / "chat_template.jinja")
        text = _read_template(Path(source), flag="--tokenizer")
    else:
        source, text = str(config_path), _config_template(config.get("chat_template"), config_path)
    special = _special_tokens(config)
    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as err:
        raise MedleyInputError(f"--chat-template {source}: not a Jinja template (line {err.lineno}: "
                               f"{err.message}); fix the template") from None
    digest = hashlib.sha256(json.dumps([text, special]).encode()).hexdigest()
    return ChatTemplate(source=source, template=text, special=special, digest=digest)


def _read_template(path: Path, *, flag: str) -> str:
    raw = read_user_bytes(path, what="chat template", flag=flag)
    if len(raw) > _TEMPLATE_BYTES:
        raise MedleyInputError(f"{flag} {path}: {len(raw)} bytes; a chat template is at most 1 MiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MedleyInputError(f"{flag} {path}: not UTF-8 text; give a Jinja chat template") from None


def _config_template(value: object, path: Path) -> str:
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if not isinstance(value, str):
        raise MedleyInputError(f"--data: conversations need a chat template, and {path} has none (no "
                               "chat_template.jinja beside it either); pass --chat-template FILE")
    return value


def _check_messages(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise MedleyInputError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES \
                or not isinstance(message.get("content"), str):
            roles = ", ".join(ROLES)
            raise MedleyInputError(f"{where}: message {number} must be {{\"role\": one of {roles}, "
                                   "\"content\": text}")
    if not any(m["role"] == "assistant" for m in messages):
        raise MedleyInputError(f"{where}: no assistant message, so nothing to learn; give conversations "
                               "with assistant turns")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_conversation(messages: object, *, template: ChatTemplate, tokenizer: Tokenizer,
                        where: str) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the rendered conversation and its loss mask (see the module docstring)."""
    chat = _check_messages(messages, where)
    try:
        text = template.render(chat)
        spans = []
        for index, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            before = template.render(chat[:index], add_generation_prompt=True)
            upto = template.render(chat[:index + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise MedleyInputError(
                    f"{where}: the chat template {template.source} does not render the start of a "
                    "conversation as the start of the whole, so medley cannot tell the assistant's tokens; "
                    "give prompt/completion data or another --chat-template")
            spans.append((len(before), len(upto)))
    except jinja2.TemplateError as err:
        raise MedleyInputError(f"{where}: the chat template {template.source} failed ({err}); fix the "
                               "conversation or the template") from None
    encoding = _encode(tokenizer, text, where)
    ids = np.asarray(encoding.ids, dtype=np.int64)
    starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return ids, mask


def encode_pair(prompt: object, completion: object, *, tokenizer: Tokenizer, eos_id: int,
                where: str) -> tuple[np.ndarray, np.ndarray]:
    """``ids(prompt) + ids(completion) + [eos]``; the completion and the EOS are learned."""
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise MedleyInputError(f"{where}: 'prompt' and 'completion' must both be text")
    head = _encode(tokenizer, prompt, where).ids
    tail = [*_encode(tokenizer, completion, where).ids, eos_id]
    return (np.asarray([*head, *tail], dtype=np.int64),
            np.asarray([0] * len(head) + [1] * len(tail), dtype=np.uint8))


def _encode(tokenizer: Tokenizer, text: str, where: str) -> Encoding:
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except Exception as err:  # noqa: BLE001 - tokenizers raises bare exceptions (a lone surrogate)
        raise MedleyInputError(f"{where}: the tokenizer refuses the text ({err}); fix the text") from None
