"""The store answers in its own terms (outcomes.py); the transports translate, and only they speak protobuf."""

import ast
from pathlib import Path

import pytest

import kvstore.server
from kvstore.proto import pb
from kvstore.server.outcomes import MissStatus, PutResult
from kvstore.server.protocol_map import part_status, put_response

pytestmark = pytest.mark.unit
STORE_MODULES = ("store", "retention", "accounting", "access_times", "block_reader", "names", "outcomes",
                 "recovery", "hot_tier", "index")


def test_every_outcome_has_its_protocol_value():
    assert list(put_response(PutResult).results) == [pb.STORED, pb.EXISTS]
    assert list(put_response([PutResult.EXISTS, PutResult.STORED]).results) == [pb.EXISTS, pb.STORED]
    assert {status: part_status(status) for status in MissStatus} == {
        MissStatus.MISSING: pb.MISSING, MissStatus.EXPIRED: pb.EXPIRED, MissStatus.CORRUPT: pb.CORRUPT,
        MissStatus.UNAVAILABLE: pb.UNAVAILABLE}


def test_an_untranslated_outcome_is_refused_by_protobuf_not_sent_as_a_number():
    with pytest.raises(TypeError):
        pb.PutResponse(results=[PutResult.STORED])


@pytest.mark.parametrize("module", STORE_MODULES)
def test_the_store_and_its_helpers_do_not_import_the_protocol(module):
    tree = ast.parse((Path(kvstore.server.__file__).parent / f"{module}.py").read_text())
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not [name for name in imported if name.startswith("kvstore.proto")]
