"""Chat templates: a Hugging Face checkpoint's Jinja template (chat_template.jinja, or
tokenizer_config.json's), rendered as transformers' apply_chat_template renders it, in jinja2's
immutable sandbox under a time and size limit; each assistant turn's span in the rendering and,
once tokenized (tokenizer.py), the runs of its tokens labelled (what the loss is taken on); and
the check of the messages a built-in chat format renders.
"""

import json
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from itertools import groupby
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from files import UsageError, read_json

# {"role": "system" | "user" | "assistant", "content": ...} and any other fields the data gives
# (Qwen3's "reasoning_content"), which a chat template reads as transformers passes them.
Message = dict[str, object]
# A rendered conversation as runs of token ids, each with whether its tokens are labels.
Segments = list[tuple[list[int], bool]]


def find_chat_template(
    directory: Path, given: Path | None, tokens: dict[str, str]
) -> "ChatTemplate | None":
    """`given`, else chat_template.jinja, else tokenizer_config.json's ("default" of a list)."""
    if given is not None and not given.is_file():
        raise UsageError(f"chat template file {given} not found")
    path = given or directory / "chat_template.jinja"
    if path.is_file():
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), tokens, str(path))
        except UnicodeDecodeError as e:
            raise UsageError(f"chat template {path} is not UTF-8 text ({e})") from e
    config_path = directory / "tokenizer_config.json"
    source = read_json(config_path).get("chat_template") if config_path.is_file() else None
    if isinstance(source, list):
        named = [t for t in source if isinstance(t, dict) and t.get("name") == "default"]
        source = named[0].get("template") if named else None
    if source is None:
        return None
    if not isinstance(source, str):
        raise UsageError(
            f"{config_path}: chat_template is {type(source).__name__}, expected a template "
            f"(a string) or a list of named ones"
        )
    return ChatTemplate(source, tokens, f"{config_path} chat_template")


class ChatTemplate:
    """A HF chat template, rendered as apply_chat_template renders it. It is a downloaded file's
    code, run in jinja2's immutable sandbox: it reaches only what is passed in, and changes none."""

    def __init__(self, source: str, special_tokens: dict[str, str], name: str):
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        try:
            with _time_limit(self.RENDER_SECONDS):  # compiling folds constants: 7 ** (7 ** 11)
                self._template = environment.from_string(source)
        except _TimeUp:
            raise UsageError(
                f"chat template {name}: still compiling after {self.RENDER_SECONDS:g} s"
            ) from None
        except jinja2.TemplateSyntaxError as e:
            raise UsageError(f"chat template {name} line {e.lineno}: {e.message}") from e
        self.source, self.name, self._tokens = source, name, special_tokens

    # A conversation renders in milliseconds. The sandbox bounds what a template reaches, not
    # how long it runs: one that loops for longer than this is stopped and named.
    RENDER_SECONDS = 10.0
    # Nor how much it writes: a template writes the messages' content (some twice) and a few
    # words of its own per turn. Past this many characters per character of content, plus a
    # million, it writes text of its own making ('x' * 10**9), which aborts tiktoken after it.
    RENDER_CHARS_PER_CONTENT = 4

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        try:
            with _time_limit(self.RENDER_SECONDS):
                text = self._template.render(
                    messages=messages,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **self._tokens,
                )
        except _TimeUp:
            raise UsageError(
                f"chat template {self.name}: still rendering a conversation of "
                f"{len(messages)} messages after {self.RENDER_SECONDS:g} s"
            ) from None
        except Exception as e:  # noqa: BLE001 - any error of the template's code is its own
            kind = "" if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: "
            raise UsageError(f"chat template {self.name}: {kind}{e}") from e
        content = sum(len(message["content"]) for message in messages)
        if len(text) > self.RENDER_CHARS_PER_CONTENT * content + 1_000_000:
            raise UsageError(
                f"chat template {self.name}: renders a conversation of {content:,} characters of "
                f"content as {len(text):,} characters, more than "
                f"{self.RENDER_CHARS_PER_CONTENT} per character of content + 1,000,000"
            )
        return text

    def assistant_spans(
        self, messages: list[Message], turn_ends: tuple[re.Pattern | None, ...]
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text, rendered once, and each assistant turn's span in it (character
        offsets), which the loss is taken on. A turn starts where the turns before it with the
        generation prompt end; that text must begin the whole conversation's. It ends with the last
        match in it of the first of `turn_ends` that has one (special tokens, then added ones)
        when rendered last (ChatML's "\\n" after <|im_end|>, Gemma's after <end_of_turn> are not
        in it), else with that text's end. A template may
        render a turn otherwise once later turns follow (Qwen3's drops earlier answers'
        reasoning): the turn then runs from its start through as
        many end-of-turn tokens of the whole text, and must end as its last-turn rendering does
        (only its start may be dropped). Anything else is refused."""
        text = self.render(messages, add_generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1], add_generation_prompt=False)
            start = len(before)
            if not (through.startswith(before) and text.startswith(before)):
                raise UsageError(
                    f"the chat template {self.name} does not render messages[:{i}] with the "
                    f"generation prompt as the beginning of messages[:{i + 1}] and of the "
                    f"whole conversation, so where its assistant turn messages[{i}] starts "
                    f"cannot be found: give a template that renders the turns before an answer "
                    f"alike with --chat-template FILE"
                )
            turn = through[start:]
            found = (list(p.finditer(turn)) for p in turn_ends if p is not None)
            closings = next((c for c in found if c), [])
            end = start + len(turn)
            if closings:
                turn, closing = turn[: closings[-1].end()], closings[-1].group()
                end = start
                for _ in range(turn.count(closing)):
                    found = text.find(closing, end)
                    end = len(text) + 1 if found < 0 else found + len(closing)
            if not (end <= len(text) and turn.endswith(text[start:end])):
                raise UsageError(
                    f"the chat template {self.name} renders the assistant turn messages[{i}] "
                    f"in the whole conversation as {text[start:end][:80]!r}, which is not how "
                    f"it ends when the turn is the last one ({turn[-80:]!r}), so its tokens "
                    f"cannot be found: give a template that renders earlier answers alike or "
                    f"only drops what they start with, with --chat-template FILE"
                )
            spans.append((start, end))
        return text, spans


class _TimeUp(BaseException):  # not an Exception: the template's own handling misses it
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raises _TimeUp in the block after `seconds`, by SIGALRM; unbounded outside the main
    thread (only it receives signals) or while someone else's timer (one per process) runs."""
    if threading.current_thread() is not threading.main_thread() or any(
        signal.getitimer(signal.ITIMER_REAL)
    ):
        yield
        return
    armed = True

    def expire(signum, frame):
        if armed:  # not once the block is done: an alarm landing as it ends is no error
            raise _TimeUp

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}` renders as its body: assistant spans are found alike in every template."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: Jinja's own escapes HTML characters, which templates do not want.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def check_role_and_content_only(messages: list[Message], chat_format: str) -> None:
    """A built-in chat format renders role and content only: another field ("tool_calls") is
    refused, not dropped from training, unless null or empty (a table as JSONL has every key)."""
    for i, message in enumerate(messages):
        for key, value in message.items():
            if key not in ("role", "content") and value not in (None, "", [], {}):
                raise UsageError(
                    f"messages[{i}].{key}: {chat_format} renders a message's role and "
                    f"content only; remove the field, or give a tokenizer whose chat template "
                    f"renders it"
                )


def labelled_runs(
    ids: np.ndarray, lengths: np.ndarray, spans: list[tuple[int, int]], bos_id: int | None
) -> Segments:
    """Runs of `ids`, labels where a token's `lengths` bytes meet an assistant turn's span (a
    token straddling the turn's start too, as in transformers' assistant mask)."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    is_label = np.zeros(len(ids), dtype=bool)
    for begin, end in spans:
        is_label[(starts < end) & (ends > begin)] = True
    if bos_id is not None and ids[:1].tolist() != [bos_id]:
        # A template writing no BOS: documents start at one all the same.
        ids = np.concatenate([[bos_id], ids])
        is_label = np.concatenate([[False], is_label])
    runs = groupby(zip(ids.tolist(), is_label.tolist(), strict=True), key=lambda t: t[1])
    return [([i for i, _ in run], label) for label, run in runs]
