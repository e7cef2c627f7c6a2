"""Chat templates rendered as transformers' ``apply_chat_template`` renders them, without
transformers: the same sandboxed jinja environment (``trim_blocks``, ``lstrip_blocks``, loop
controls, ``{% generation %}`` blocks), the non-ASCII ``tojson`` filter, the
``raise_exception`` and ``strftime_now`` globals, the same variables, and the same
``continue_final_message`` handling. :class:`~.model_files.FileTokenizer` encodes the text.
"""

from __future__ import annotations

import json
from copy import deepcopy
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **variables: Any,
) -> str:
    """``messages`` rendered with ``template`` as transformers' ``render_jinja_template``
    renders one conversation: variables ``messages``, ``tools``, ``documents`` (None),
    ``add_generation_prompt`` and ``variables``; with ``continue_final_message`` the text
    ends inside the last message (its ``content``, or the field a string names). Tools
    must be JSON schemas (dicts): callables are not converted. Raises ValueError,
    ``jinja2.TemplateError`` or TypeError (a variable given twice)."""
    compiled = _compile(template)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError(
            "Tools should either be a JSON schema, or a callable function with type hints "
            "and a docstring suitable for auto-conversion to a schema."
        )
    chat = messages
    final_message: Any = None
    if continue_final_message:
        chat = deepcopy(messages)
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        if (final_message := chat[-1].get(field)) is None:
            raise ValueError(
                f'continue_final_message is set but the final message has no "{field}" to continue!'
            )
        if field not in template:
            raise ValueError(
                f'continue_final_message is set to "{field}" but this is not an accepted field '
                "in the chat_template"
            )
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError(
                    "continue_final_message is set but we could not find any text to continue "
                    "in the final message!"
                )
        else:
            chat[-1][field] = chat[-1][field] + _CONTINUE_TAG
    rendered = compiled.render(
        messages=chat,
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    if not continue_final_message:
        return rendered
    if final_message.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message. Please verify the chat template and final message "
            "in your chat to ensure they are compatible."
            f"Final message to continue: {final_message.strip()}\nRendered chat:\n{rendered}"
        )
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with
    it for training masks): rendered as its body, so templates using it compile."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters and non-ASCII; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)
