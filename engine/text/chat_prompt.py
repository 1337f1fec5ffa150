"""Chat messages to prompt token ids where only the chat template places special tokens.

A tokenizer turns the text `<start_of_turn>` into its control token wherever it appears, so a user who
writes it into a message (or a tool result, or a system prompt) could forge turns. Here the template is
rendered with each message's content replaced by a sentinel, the template's own text between sentinels
is encoded with special tokens recognised, and each content with every control token split into plain
text. A control token is any added token whose text the vocabulary would not yield on its own, whatever its
`special` flag: Gemma 3's `<start_of_image>`, `<end_of_image>` and `[multimodal]` are not flagged special, and
`split_special_tokens` would leave them whole (its HTML tags such as `<b>` count as control too; its added
runs of whitespace are ordinary text, which the vocabulary yields anyway). Each piece is encoded alone, so a
conversation's next prompt extends its last one token for token (what the store's prefix cache needs), and for
text without control strings the ids are what `apply_chat_template(tokenize=True)` gives (tested on the real
model's tokenizer). The copy of the tokenizer that content is encoded with is made on first use (seconds for a
262k vocabulary): `encode_chat` once at start-up keeps that off the first request.

    ids = encode_chat(tokenizer, [{"role": "system", "content": ...}, {"role": "user", "content": ...}])

An image goes into a message's content as IMAGE_MARK, which an API puts there for each image part (and takes out
of clients' text). With `image_tokens`, each mark becomes `<start_of_image>`, `image_tokens` placeholders
(IMAGE_PLACEHOLDER, never a token id: `split_images` gives where they are and puts an id in their place) and
`<end_of_image>`, as Gemma 3's processor lays an image out.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

_SENTINEL = "\ue000{}\ue001"  # Unicode private-use characters: no template writes them
_SENTINELS = re.compile("\ue000(\\d+)\ue001")
ROLES = ("system", "user", "assistant")
IMAGE_MARK = "\ue002"  # an image's place in a message's content (private use: no client text holds it)
IMAGE_PLACEHOLDER = -1  # in encode_chat's ids: a position an image's encoder rows fill (split_images)
IMAGE_BOUNDS = ("<start_of_image>", "<end_of_image>")  # around an image's placeholders, where the vocabulary has them
_TEXT_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its copy for content
_IMAGE_BOUNDS_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> IMAGE_BOUNDS' ids


class ChatPromptError(ValueError):
    """Messages the chat template cannot render: the caller answers with a 400."""


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                image_tokens: int = 0) -> list[int]:
    """The prompt's token ids: the template's special tokens, every message's text as plain text. A last
    message `{"role": "assistant", "content": ..., "continue": True}` is a prefill: the reply continues it, so
    its turn is left open (no generation prompt, nothing of the template after its content). With
    `image_tokens`, each IMAGE_MARK in a content is an image of that many IMAGE_PLACEHOLDERs (module docstring)."""
    contents = _checked(messages)
    prefill = messages[-1].get("continue") is True
    trims = _template_trims(tokenizer)
    stand_ins = [{"role": m["role"], "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    try:
        rendered = tokenizer.apply_chat_template(stand_ins, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt and not prefill)
    except Exception as exc:  # the template's own refusals (e.g. roles that do not alternate) raise from Jinja
        raise ChatPromptError(f"the chat template refuses these messages: {exc}") from None
    pieces = _SENTINELS.split(rendered)  # template text, index, template text, index, ...
    if prefill:
        pieces = pieces[:-1]  # what closes the last turn (Gemma's <end_of_turn>): the reply goes on from its text
    order = [int(i) for i in pieces[1::2]]
    if order != list(range(len(messages))):
        raise ChatPromptError(f"the chat template placed the messages' contents as {order}, not once each in order")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            ids += _encode(tokenizer, piece, split_special=False)  # the template's: its control tokens
        else:
            content = contents[int(piece)]
            content = content.strip() if trims[messages[int(piece)]["role"]] else content
            texts = content.split(IMAGE_MARK) if image_tokens else [content]
            for j, text in enumerate(texts):
                if j:
                    ids += _image_run(tokenizer, image_tokens)
                ids += _encode_text(tokenizer, text)
    return ids


def _image_run(tokenizer: Any, image_tokens: int) -> list[int]:
    if tokenizer not in _IMAGE_BOUNDS_IDS:  # the vocabulary is copied whole: looked up once
        vocab = tokenizer.get_vocab()
        _IMAGE_BOUNDS_IDS[tokenizer] = tuple([vocab[name]] if name in vocab else [] for name in IMAGE_BOUNDS)
    start, end = _IMAGE_BOUNDS_IDS[tokenizer]
    return start + [IMAGE_PLACEHOLDER] * image_tokens + end


def split_images(ids: Sequence[int], image_tokens: int, placeholder_id: int = 0) -> tuple[list[int], list[int]]:
    """encode_chat's ids with `placeholder_id` at each image's placeholders (the model reads the image's rows
    there instead), and where each image's placeholders start, in order."""
    out, starts = list(ids), []
    i = 0
    while i < len(out):
        if out[i] == IMAGE_PLACEHOLDER:
            starts.append(i)
            out[i : i + image_tokens] = [placeholder_id] * image_tokens
            i += image_tokens
        else:
            i += 1
    return out, starts


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ChatPromptError("messages must be a non-empty list of {role, content} objects")
    contents = []
    for i, message in enumerate(messages):
        last_assistant = i == len(messages) - 1 and isinstance(message, Mapping) and message.get("role") == "assistant"
        if not isinstance(message, Mapping) or not {"role", "content"} <= set(message) <= \
                {"role", "content", *["continue"] * last_assistant}:
            raise ChatPromptError(f"message {i} must have exactly the fields role and content (and a last "
                                  "assistant message, continue)")
        if message["role"] not in ROLES:
            raise ChatPromptError(f"message {i}: role must be one of {ROLES}, got {message['role']!r}")
        if not isinstance(message["content"], str):
            raise ChatPromptError(f"message {i}: content must be a string")
        contents.append(message["content"])
    return contents


def _template_trims(tokenizer: Any) -> dict[str, bool]:
    """By role, whether the template strips a message's surrounding whitespace (Gemma trims user and model
    turns, not the system text it puts before the first user turn): the same must be done to the content
    encoded in its place."""
    roles = list(ROLES)
    probe = [{"role": role, "content": " " + _SENTINEL.format(i) + " "} for i, role in enumerate(roles)]
    try:
        rendered = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    except Exception:  # a template without a system role
        roles, probe = roles[1:], [{**m, "content": " " + _SENTINEL.format(i) + " "} for i, m in enumerate(probe[1:])]
        rendered = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    trims = {role: " " + _SENTINEL.format(i) + " " not in rendered for i, role in enumerate(roles)}
    return {"system": trims.get("system", trims["user"]), **trims}


def _encode(tokenizer: Any, text: str, split_special: bool) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    """A message's content as plain text: no control token, flagged special or not."""
    backend = _text_tokenizer(tokenizer)
    if backend is None:  # no fast tokenizer underneath: its special tokens are all it can tell apart
        return _encode(tokenizer, text, split_special=True)
    return backend.encode(text, add_special_tokens=False).ids if text else []


def _text_tokenizer(tokenizer: Any) -> Any:
    """A copy of the tokenizer's backend in which every control token is special and split, made once."""
    if tokenizer in _TEXT_TOKENIZERS:
        return _TEXT_TOKENIZERS[tokenizer]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    copy = None
    if backend is not None:
        from tokenizers import AddedToken, Tokenizer

        copy = Tokenizer.from_str(backend.to_str())
        control = [t for i, t in tokenizer.added_tokens_decoder.items() if not _is_text(backend, i, t.content)]
        copy.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                                            normalized=t.normalized, special=True) for t in control])
        copy.encode_special_tokens = True  # special tokens in the text are split into plain text
    _TEXT_TOKENIZERS[tokenizer] = copy
    return copy


def _is_text(backend: Any, token_id: int, content: str) -> bool:
    """Whether the vocabulary alone yields this added token from its text (Gemma's runs of newlines and spaces):
    then the match as an added token changes nothing a client could not write anyway."""
    normalized = backend.normalizer.normalize_str(content) if backend.normalizer is not None else content
    pieces = backend.pre_tokenizer.pre_tokenize_str(normalized) if backend.pre_tokenizer is not None else \
        [(normalized, None)]
    return [t.id for piece, _ in pieces for t in backend.model.tokenize(piece)] == [token_id]
