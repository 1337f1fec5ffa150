"""What vLLM's KV connector stores of a hybrid model, and under which namespaces (no vLLM needed)."""

from __future__ import annotations

import json

import pytest
import xxhash

from kvstore.connectors.identity import checkpoint_identity
from kvstore.connectors.vllm_groups import PAGE_CPU, PAGE_NHD, StoredGroups, namespaces

pytestmark = pytest.mark.unit


def _groups(window_tokens: int = 512, block_tokens: int = 128, page: str = PAGE_CPU) -> StoredGroups:
    """Gemma 3 270M's layout under vLLM's hybrid manager: 3 full layers, 15 sliding-window ones."""
    full = tuple(f"l{i}" for i in (5, 11, 17))
    window = tuple(f"l{i}" for i in range(18) if i not in (5, 11, 17))
    group_of = {**dict.fromkeys(full, 0), **{name: 1 + i // 3 for i, name in enumerate(window)}}
    return StoredGroups(full, window if window_tokens else (), group_of, 1, 256, "bfloat16", block_tokens,
                        window_tokens, page)


def test_the_window_a_resume_reads_is_the_window_vllm_keeps():
    groups = _groups()
    # vLLM's SlidingWindowManager keeps cdiv(window - 1, block) blocks before a prefix-cache boundary
    assert groups.window_blocks == 4
    assert list(groups.window_range(16)) == [11, 12, 13, 14, 15], "a resume at 16 or at 15 blocks"
    assert list(groups.window_range(3)) == [0, 1, 2]
    assert _groups(window_tokens=129).window_blocks == 1 and _groups(window_tokens=130).window_blocks == 2
    assert list(_groups(window_tokens=0).window_range(16)) == []


def test_the_longest_resume_is_one_whose_window_is_stored():
    groups = _groups()
    stored = set(groups.window_range(16))  # a prompt of 16 full blocks was saved

    def present(begin: int, end: int) -> bool:
        return all(i in stored for i in range(begin, end))

    assert groups.best_resume(16, 0, present) == 16
    assert groups.best_resume(15, 0, present) == 15, "a repeated prompt stops one block short"
    assert groups.best_resume(14, 0, present) == 0, "its window [10, 14) is not all stored: no exact resume"
    # vLLM's own cache holds the first 12 blocks, and so their window: only [12, end) must be stored
    assert groups.best_resume(14, 12, present) == 14
    assert groups.best_resume(12, 12, present) == 12
    assert _groups(window_tokens=0).best_resume(9, 2, present) == 9, "no window layers: the full hit"


def test_a_callers_salt_is_keyed_apart_within_the_operators_tenant():
    groups = _groups()
    plain = namespaces(groups, "gemma@1", "team-a", None, 0, 1)
    salted = namespaces(groups, "gemma@1", "team-a", "team-a", 0, 1)
    other_tenant = namespaces(groups, "gemma@1", "team-b", None, 0, 1)
    assert plain.full.tenant == salted.full.tenant, "the block's owner is the operator's tenant either way"
    assert len({plain.full.digest, salted.full.digest, other_tenant.full.digest}) == 3
    # a salt cannot name another deployment's tenant: salt "team-a" without a tenant is not tenant "team-a"
    assert namespaces(groups, "gemma@1", "", "team-a", 0, 1).full.digest != plain.full.digest
    assert plain.window is not None and plain.window.digest != plain.full.digest
    assert plain.full.num_layers == 3 and plain.window.num_layers == 15


def test_page_layout_rank_and_window_are_in_the_namespace():
    cpu, nhd = _groups(page=PAGE_CPU), _groups(page=PAGE_NHD)
    digests = {namespaces(cpu, "m", "", None, 0, 1).full.digest, namespaces(nhd, "m", "", None, 0, 1).full.digest,
               namespaces(cpu, "m", "", None, 0, 2).full.digest, namespaces(cpu, "m", "", None, 1, 2).full.digest}
    assert len(digests) == 4
    assert namespaces(nhd, "m", "", None, 0, 1).full.model_id == "m", "the engine's page layout: its identity"
    window = {namespaces(_groups(window_tokens=w), "m", "", None, 0, 1).window.digest for w in (512, 1024)}
    assert len(window) == 2
    assert cpu.page_shape() == (1, 128, 512) and nhd.page_shape() == (2, 128, 1, 256)


def test_a_model_id_that_spells_a_qualifier_names_no_other_deployments_namespace():
    """An operator's model_id is free text: one that holds what a rank, a caller's salt or the window chain
    would append must still name a namespace of its own, else one deployment reads another's KV."""
    nhd = _groups(page=PAGE_NHD, window_tokens=0)
    # a hybrid of as many window layers as full ones: its two chains' layouts are alike
    hybrid = StoredGroups(("l0", "l2"), ("l1", "l3"), {"l0": 0, "l1": 1, "l2": 0, "l3": 1}, 1, 256, "bfloat16",
                          128, 512, PAGE_NHD)
    rank = namespaces(nhd, "m", "t", None, 0, 2).full
    salted = namespaces(nhd, "m", "t", "caller", 0, 1).full
    window = namespaces(hybrid, "m", "t", None, 0, 1).window
    cpu = namespaces(_groups(page=PAGE_CPU, window_tokens=0), "m", "t", None, 0, 1).full
    spelled = {rank: "m#tp0/2", window: "m|window=512", cpu: "m|page=cpu_attn",
               salted: f"m|cache_salt={xxhash.xxh3_128_hexdigest(b'caller')}"}
    for qualified, model_id in spelled.items():
        plain = namespaces(hybrid if qualified is window else nhd, model_id, "t", None, 0, 1).full
        assert plain.digest != qualified.digest, model_id
    # a model_id that spells one qualifier, under another: not the model qualified by both
    assert (namespaces(nhd, "m#tp0/2", "t", "caller", 0, 1).full.digest
            != namespaces(nhd, "m", "t", "caller", 0, 2).full.digest)
    with pytest.raises(ValueError, match="NUL"):
        namespaces(nhd, "m\0x", "t", None, 0, 1)


def test_the_checkpoint_identity_tells_files_apart_by_name_and_length(tmp_path):
    """The same bytes cut into other files, or under other names, are another checkpoint (a config padded
    into a weight file, a shard split elsewhere): each file enters the digest with its name and length."""
    def checkpoint(where: str, files: dict[str, bytes]) -> str:
        folder = tmp_path / where / "model"
        folder.mkdir(parents=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        return checkpoint_identity(folder)

    config = b'{"model_type": "gemma3_text"}'
    base = checkpoint("base", {"config.json": config, "a.safetensors": b"xy", "b.safetensors": b"z"})
    assert checkpoint("split", {"config.json": config, "a.safetensors": b"x", "b.safetensors": b"yz"}) != base
    assert checkpoint("renamed", {"config.json": config, "a.safetensors": b"xy", "c.safetensors": b"z"}) != base
    assert checkpoint("format", {"config.json": config, "a.bin": b"xy", "b.safetensors": b"z"}) != base
    assert checkpoint("config", {"config.json": config + b"x", "a.safetensors": b"y", "b.safetensors": b"z"}) != base
    assert checkpoint("again", {"config.json": config, "a.safetensors": b"xy", "b.safetensors": b"z"}) == base


def test_the_checkpoint_identity_follows_every_weight_byte(tmp_path):
    folder = tmp_path / "a" / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    (folder / "model.safetensors").write_bytes(bytes(1000))
    first = checkpoint_identity(folder)
    assert first.startswith("model@") and checkpoint_identity(folder) == first
    twin = tmp_path / "b" / "model"  # the same name, the same bytes: the same identity
    twin.mkdir(parents=True)
    (twin / "config.json").write_text((folder / "config.json").read_text())
    (twin / "model.safetensors").write_bytes(bytes(1000))
    assert checkpoint_identity(twin) == first
    (twin / "model.safetensors").write_bytes(bytes(999) + b"\x01")
    assert checkpoint_identity(twin) != first, "one weight byte"
    (twin / "model.safetensors").write_bytes(bytes(1000))
    (twin / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "sliding_window": 1}))
    assert checkpoint_identity(twin) != first, "the config"
    with pytest.raises(ValueError, match="config.json"):
        checkpoint_identity(tmp_path)
    (twin / "pytorch_model.bin").write_bytes(bytes(10))  # a checkpoint in another format counts too
    assert checkpoint_identity(twin) != first
    (twin / "model.safetensors").unlink(), (twin / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="no weight file"):  # a config alone names no checkpoint
        checkpoint_identity(twin)


def test_the_codec_is_in_both_chains_namespaces_and_cpu_pages_take_only_lossless_ones():
    nhd = _groups(page=PAGE_NHD)
    raw = namespaces(nhd, "m", "t", None, 0, 1)
    int8 = namespaces(nhd, "m", "t", None, 0, 1, nhd.check_codec("int8"))
    assert raw.full.digest != int8.full.digest and raw.window.digest != int8.window.digest
    assert int8.full.codec is not None and int8.window.codec is not None and raw.full.codec is None
    cpu = _groups(page=PAGE_CPU)
    assert cpu.check_codec("zstd") == "zstd"
    with pytest.raises(ValueError, match="interleave"):
        cpu.check_codec("int4")
    with pytest.raises(ValueError, match="one of"):
        nhd.check_codec("gzip")
