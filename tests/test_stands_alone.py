"""The project stands alone: a clone has every document it points at, and none outside it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".git", ".venv", ".venvs", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", ".cache"}
TEXT = {".py", ".md", ".toml", ".proto", ".txt", ".json", ".yaml", ".yml", ".sh", ".cfg", ".ini"}
# spelt in pieces, so that this file does not match itself
OUTSIDE = re.compile("|".join([re.escape("../" + "shared"), re.escape("/work/" + "shared"), "DESIGN" + r"\.md"]))
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a markdown link's target
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)  # code blocks and spans: their brackets are no links

pytestmark = pytest.mark.unit


def _skipped(name: str) -> bool:
    return name in SKIP or name.endswith(".egg-info")


def _files(root: Path = ROOT) -> list[Path]:
    """The project's own text files. Skipped folders are pruned, not walked and filtered: after
    `make test-connectors` .venvs/ holds gigabytes of third-party files."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if not _skipped(name)]
        for name in names:
            path = Path(folder) / name
            if (path.suffix in TEXT or name in ("Makefile", "run")) and path.is_file():
                found.append(path)
    return found


def test_no_file_points_outside_the_repository():
    files = _files()
    assert len(files) > 100 and ROOT / "README.md" in files  # the walk found the project
    offenders = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
                 for path in files for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                 if OUTSIDE.search(line)]
    assert not offenders, "\n".join(offenders)


def test_every_relative_link_in_the_docs_resolves():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*/README.md"))]
    broken = []
    for doc in docs:
        for target in LINK.findall(CODE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or a heading of the same page
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists() or ROOT not in path.parents:
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)


def test_the_walk_skips_environments(tmp_path):
    for folder in (".venv", ".venvs/vllm/lib", "kvstore.egg-info", "docs"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "x.md").write_text("x")
    assert _files(tmp_path) == [tmp_path / "docs" / "x.md"]


def test_the_checks_see_what_they_look_for():
    assert LINK.findall("see [the design](docs/design.md#3) and [site](https://example.org)") == [
        "docs/design.md#3", "https://example.org"]
    assert not LINK.findall(CODE.sub("", "```\nx = layers[0](hidden)\n```\nand `f[0](x)`"))
    assert OUTSIDE.search("read " + "../" + "shared/data") and not OUTSIDE.search("docs/design.md")
