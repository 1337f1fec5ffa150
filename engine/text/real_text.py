"""Real-text workloads: multi-turn chat and agent sessions built from the standard library's docstrings.

    sessions = demo_sessions(tokenizer, 4)            # chat, agent, chat, agent; one shared opening
    prompt = sessions[0].next_prompt()                 # token ids of the whole conversation so far
    sessions[0].add_reply("It joins path components.")   # the model's reply; the next prompt extends it

Every prompt goes through the tokenizer's chat template (Gemma 3's puts the system prompt at the start
of the first user turn), so the special tokens sit only where the template writes them. Every session
opens with the same system prompt and one worked exchange. The text is what this Python ships
(`inspect.getdoc` of fixed standard-library objects), so a workload is the same on every run with this
interpreter, and never random token ids.

A prompt is the previous prompt plus what was said since: the template is rendered for the whole
conversation, the render must extend the previous one, and only the new text is tokenized and
appended. So turn n's token ids are a prefix of turn n + 1's, as an engine serving the conversation
sees them, and the store can serve the earlier turns.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

CHAT, AGENT = "chat", "agent"

# Objects whose docstrings make the user turns (chat) and the tool results (agent), in this order.
TOPICS = (
    "os.path.join", "json.dumps", "textwrap.wrap", "functools.lru_cache", "itertools.groupby",
    "collections.Counter", "re.sub", "subprocess.run", "shutil.copytree", "heapq.merge", "bisect.insort_left",
    "statistics.median", "dataclasses.dataclass", "contextlib.contextmanager", "zipfile.ZipFile",
    "logging.basicConfig",
)
# Reference text in the shared system prompt: about 1,800 tokens, so that a conversation's stored prefix
# soon passes 2R (R = 1,024 on Gemma 3), where the engine may rebuild a lost window by replay. The
# held-out sessions (`long_sessions`, for measuring) keep the first seven: a prompt of about 660 tokens.
SHORT_REFERENCE = 7
SYSTEM_REFERENCE = ("builtins.sorted", "builtins.str.split", "builtins.str.join", "builtins.dict.get",
                    "builtins.enumerate", "builtins.zip", "builtins.print", "builtins.open", "builtins.int",
                    "builtins.range", "builtins.min", "builtins.isinstance", "builtins.list.sort",
                    "builtins.bytes.decode", "builtins.round", "builtins.map", "builtins.filter",
                    "builtins.str.strip", "builtins.str.format", "builtins.dict.setdefault")
MAX_DOC_CHARS = 1200  # a docstring longer than this is cut at a paragraph boundary: turns of a few hundred tokens

SYSTEM_INSTRUCTIONS = (
    "You are a concise assistant for Python programmers. Answer from the standard library's documentation "
    "below and from what the user shows you; say so when the documentation does not answer the question. "
    "Keep answers short, give one example where it helps, and never invent functions or parameters."
)
# One worked exchange after the system prompt, shared by every session. The packaged Gemma 3 270M is the
# pretrained (base) model, not the instruction-tuned one: at the template's `<start_of_turn>model` it
# tends to repeat the user's turn, while after one example answer it answers in kind.
EXAMPLE_TOPIC = "builtins.len"
EXAMPLE_REPLY = ("`len(obj)` returns how many items a container holds: `len([1, 2, 3])` is 3. Use it to size "
                 "lists, strings, dicts and anything that defines `__len__`.")
AGENT_TASK = ("Task: write a small script that reads a folder of JSON files, counts the words in a text "
              "field, and writes a summary. Decide which standard-library functions to use; after each tool "
              "result, say which function you pick next and why.")


def docstring(qualified_name: str, max_chars: int = MAX_DOC_CHARS) -> str:
    """The docstring of a standard-library object named `module.attr[.attr]`, cut at a paragraph boundary."""
    module_name, _, attributes = qualified_name.partition(".")
    try:
        obj = importlib.import_module(module_name)
        for attribute in attributes.split(".") if attributes else ():
            obj = getattr(obj, attribute)
    except (ImportError, AttributeError):
        raise ValueError(f"real_text: {qualified_name!r} is not in this Python's standard library; "
                         "name a module and its attributes, e.g. 'json.dumps'") from None
    text = inspect.getdoc(obj)
    if not text:
        raise ValueError(f"real_text: {qualified_name!r} has no docstring; pick another object")
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n\n", 0, max_chars)
    return text[: cut if cut > 0 else max_chars].rstrip()


def system_prompt(reference_docs: int = len(SYSTEM_REFERENCE)) -> str:
    """The system prompt every session shares: instructions and the first `reference_docs` of
    SYSTEM_REFERENCE's documentation."""
    reference = "\n\n".join(f"## {name}\n{docstring(name)}" for name in SYSTEM_REFERENCE[:reference_docs])
    return f"{SYSTEM_INSTRUCTIONS}\n\nReference documentation:\n\n{reference}"


def chat_question(name: str) -> str:
    """A chat user turn: a question about a standard-library object, with its documentation."""
    return f"What does `{name}` do, and when would I use it? Its documentation says:\n\n{docstring(name)}"


def example_exchange() -> list[dict]:
    """The worked question and answer every session starts with, after the system prompt."""
    return [{"role": "user", "content": chat_question(EXAMPLE_TOPIC)},
            {"role": "assistant", "content": EXAMPLE_REPLY}]


class ChatTokenizer(Protocol):
    """What a session uses of a transformers tokenizer: its chat template rendered as text, and encoding."""

    def apply_chat_template(self, conversation: list[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool) -> str: ...

    def __call__(self, text: str, *, add_special_tokens: bool) -> Mapping[str, list[int]]: ...


@dataclass
class Session:
    """One conversation: a system prompt, then alternating user and assistant turns, as token ids.

    `next_prompt()` adds the next user turn and returns the whole prompt (ending in the template's
    generation prompt); `add_reply(text)` records the model's answer before the next user turn."""

    tokenizer: ChatTokenizer  # a transformers tokenizer with a chat template
    name: str
    kind: str  # CHAT or AGENT: also the store's traffic class
    topics: Sequence[str]  # docstrings for the user turns, in order
    system: str = field(default_factory=system_prompt)
    messages: list[dict[str, str]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the prompt so far
    _rendered: str = ""  # the template's text for `tokens`

    def __post_init__(self) -> None:
        if self.kind not in (CHAT, AGENT):
            raise ValueError(f"real_text: session kind must be {CHAT!r} or {AGENT!r}, got {self.kind!r}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("real_text: the tokenizer has no chat template; load it from the converted model "
                             "folder (engine.checkpoints.real_model.load_real_model)")
        if not self.messages:
            self.messages += [{"role": "system", "content": self.system}, *example_exchange()]

    @property
    def turn(self) -> int:
        """User turns so far, the worked example not counted."""
        return sum(1 for m in self.messages if m["role"] == "user") - 1

    def next_prompt(self) -> list[int]:
        """Add the next user turn; the token ids of the whole conversation, ready for the reply."""
        if self.messages[-1]["role"] == "user":
            raise ValueError(f"real_text: session {self.name} already awaits a reply; call add_reply first")
        self.messages.append({"role": "user", "content": self._user_turn(self.turn)})
        return self._extend(add_generation_prompt=True)

    def add_reply(self, text: str) -> None:
        """Record the assistant's reply to the last user turn."""
        if self.messages[-1]["role"] != "user":
            raise ValueError(f"real_text: session {self.name} has no user turn to reply to")
        self.messages.append({"role": "assistant", "content": text.strip() or "..."})

    def _user_turn(self, turn: int) -> str:
        name = self.topics[turn % len(self.topics)]
        if self.kind == CHAT:
            return chat_question(name)
        doc = docstring(name)
        if turn == 0:
            return f"{AGENT_TASK}\n\nTool result (help({name})):\n{doc}"
        return f"Tool result (help({name})):\n{doc}\n\nContinue with the task."

    def _extend(self, add_generation_prompt: bool) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(self.messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        if not rendered.startswith(self._rendered):
            raise ValueError(f"real_text: the chat template's render of session {self.name} does not extend "
                             "its previous turn; the template rewrites earlier turns, so prompts would not "
                             "share their prefix")
        new_text = rendered[len(self._rendered):]
        # the template writes the BOS itself, so the tokenizer must not add one
        self.tokens += self.tokenizer(new_text, add_special_tokens=False)["input_ids"]
        self._rendered = rendered
        return list(self.tokens)


def demo_sessions(tokenizer, count: int) -> list[Session]:
    """`count` sessions, chat and agent alternating, sharing one system prompt; each starts its topics at
    a different place, so the user turns differ from the first on."""
    system = system_prompt()
    sessions = []
    for number in range(count):
        kind = AGENT if number % 2 else CHAT
        start = (3 * number) % len(TOPICS)
        topics = TOPICS[start:] + TOPICS[:start]
        sessions.append(Session(tokenizer, f"{kind}{number}", kind, topics, system))
    return sessions


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Token ids that end a reply: the end of the model's turn and the end of sequence (sorted, distinct: as
    SamplingParams takes them)."""
    ids = {tokenizer.convert_tokens_to_ids("<end_of_turn>"), tokenizer.eos_token_id}
    return tuple(sorted(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id))


# Held-out text: standard-library modules that no demo topic, system reference or worked example comes
# from, so what is measured on it (bench/swa_replay_quality.py) is not tuned on what the demo shows.
HELD_OUT_MODULES = (
    "argparse", "calendar", "csv", "decimal", "difflib", "fractions", "inspect", "pathlib", "pickle", "random",
    "string", "tarfile", "tempfile", "threading", "typing", "uuid", "warnings", "weakref", "ipaddress", "pprint",
    "sched", "secrets", "socket", "gzip", "fnmatch", "glob", "queue", "enum", "copy", "operator", "locale",
    "codecs", "base64", "hashlib", "configparser", "shlex", "traceback", "types", "unittest", "doctest", "timeit",
    "smtplib", "ftplib", "abc", "datetime", "io", "struct", "ast", "dis", "tokenize", "mimetypes", "plistlib",
    "selectors", "platform", "cmd", "pdb", "pstats", "graphlib", "numbers", "fileinput", "filecmp", "reprlib",
    "gettext", "pkgutil", "runpy", "wave", "zipimport", "modulefinder", "linecache", "sysconfig", "mailbox",
    "imaplib", "poplib", "netrc", "code", "codeop", "trace", "profile", "symtable", "bdb", "optparse", "getopt",
)
MIN_HELD_OUT_CHARS = 300  # shorter docstrings make turns of a line or two


def held_out_topics(min_chars: int = MIN_HELD_OUT_CHARS) -> list[str]:
    """Public functions, classes and methods of HELD_OUT_MODULES whose docstring has `min_chars` or more,
    modules taken in turn so consecutive topics differ in module; the same list for one Python version."""
    used = {name.split(".")[0] for name in (*TOPICS, *SYSTEM_REFERENCE, EXAMPLE_TOPIC)}
    per_module = []
    for module_name in HELD_OUT_MODULES:
        if module_name in used:
            continue
        names = []
        for attribute, member in sorted(vars(importlib.import_module(module_name)).items()):
            if attribute.startswith("_") or _deprecated(member) or getattr(member, "__module__", None) != module_name:
                continue
            if inspect.isclass(member) or inspect.isfunction(member):
                names.append((f"{module_name}.{attribute}", member))
            if inspect.isclass(member):
                names += [(f"{module_name}.{attribute}.{method}", function)
                          for method, function in sorted(vars(member).items())
                          if not method.startswith("_") and inspect.isfunction(function)]
        per_module.append([name for name, obj in names if len(inspect.getdoc(obj) or "") >= min_chars])
    longest = max(map(len, per_module), default=0)
    return [names[i] for i in range(longest) for names in per_module if i < len(names)]


def _deprecated(member: object) -> bool:
    """Whether looking at `member` warns that it is deprecated (typing.io, typing.re): no topic for a user."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(member, "__doc__", None)
    return any(issubclass(w.category, DeprecationWarning) for w in caught)


@dataclass
class Transcript:
    """A conversation played to its end: its token ids and where each of its prompts ended (a reply began)."""

    name: str
    tokens: list[int]
    prompt_ends: list[int]
    topics: list[str]  # the user turns' docstrings, in order


def first_paragraph(name: str) -> str:
    """The first paragraph of a standard-library object's docstring: a reply of real text."""
    return docstring(name).split("\n\n")[0].strip()


def long_session(tokenizer, min_tokens: int, topics: Sequence[str], kind: str = CHAT, name: str = "long",
                 system: str | None = None) -> Transcript:
    """A session of at least `min_tokens` tokens, ending in a prompt: one user turn per topic, in order and
    each once (so no turn can be copied from an earlier one), with replies of real text, since the model
    writes thousands of tokens too slowly: in a chat the first paragraph of the asked docstring, as a
    summary; in an agent session, which function the agent looks up next and that one's first paragraph.
    Raises ValueError when the topics run out first."""
    session = Session(tokenizer, name, kind, topics, system if system is not None else system_prompt(SHORT_REFERENCE))
    ends: list[int] = []
    for turn, topic in enumerate(topics):
        ends.append(len(session.next_prompt()))
        if ends[-1] >= min_tokens:
            return Transcript(name, list(session.tokens), ends, list(topics[: turn + 1]))
        following = topics[turn + 1] if turn + 1 < len(topics) else topic
        session.add_reply(first_paragraph(topic) if kind == CHAT
                          else f"Next I look up `{following}`: {first_paragraph(following)}")
    raise ValueError(f"real_text: {len(topics)} topics make a session of {ends[-1] if ends else 0} tokens, "
                     f"{min_tokens} wanted; give more topics or ask for a shorter session")


def long_sessions(tokenizer, count: int, min_tokens: int, topics: Sequence[str] | None = None) -> list[Transcript]:
    """`count` sessions of at least `min_tokens` tokens, chat and agent alternating, on held-out topics
    (`held_out_topics()` unless given), no topic in two sessions. Raises ValueError when they run out."""
    pool = list(held_out_topics() if topics is None else topics)
    system, sessions = system_prompt(SHORT_REFERENCE), []
    for number in range(count):
        kind = AGENT if number % 2 else CHAT
        try:
            session = long_session(tokenizer, min_tokens, pool, kind, f"held_out_{kind}{number}", system)
        except ValueError:
            raise ValueError(f"real_text: the held-out topics make only {number} sessions of {min_tokens} tokens, "
                             f"{count} wanted; ask for fewer or shorter sessions") from None
        pool = pool[len(session.topics):]
        sessions.append(session)
    return sessions
