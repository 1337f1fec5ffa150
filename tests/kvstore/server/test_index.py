"""Index entries as LMDB holds them, including those written by earlier versions."""

import struct

import pytest

from kvstore.server.index import Entry, tenant_id_of

pytestmark = pytest.mark.unit

FIXED = struct.Struct("<IQIIQQH")  # the fields every version wrote
PARENT = bytes(range(16))


def test_an_entry_round_trips_with_its_parent_policy_class_and_tenant():
    entry = Entry(3, 4096, 120, 65536, 10**12, 10**12 - 5, 1, PARENT, 83, 65535)
    assert Entry.unpack(entry.pack()) == entry
    assert tenant_id_of(entry.pack()) == 65535
    no_parent = Entry(3, 4096, 120, 65536, 10**12, 10**12 - 5, 1, b"", 0, 7)
    assert Entry.unpack(no_parent.pack()) == no_parent


@pytest.mark.parametrize("raw, parent", [
    (FIXED.pack(3, 4096, 120, 65536, 10**12, 10**12 - 5, 1), b""),  # before parents were kept
    (FIXED.pack(3, 4096, 120, 65536, 10**12, 10**12 - 5, 1) + PARENT, PARENT),  # before policy classes
    (FIXED.pack(3, 4096, 120, 65536, 10**12, 10**12 - 5, 1) + PARENT + b"\x00", PARENT),  # before tenants
], ids=["no-parent", "parent-only", "no-tenant"])
def test_entries_of_earlier_versions_read_as_class_0(raw, parent):
    entry = Entry.unpack(raw)
    fields = (entry.segment, entry.payload_len, entry.parent, entry.policy_class, entry.tenant_id)
    assert fields == (3, 65536, parent, 0, 0)
    assert Entry.unpack(entry.pack()) == entry, "and rewritten in the new form without loss"
