"""KVClient serves StoreClient, the face engines and plug-ins take, and AsyncKVClient has the same calls.

mypy checks the types (the assignment at the end of kvstore/client/sync.py); these check what runs."""

import inspect

import pytest

from kvstore.client import AsyncKVClient, ClientConfig, KVClient, StoreClient

pytestmark = pytest.mark.unit

FACE = sorted(name for name in vars(StoreClient) if not name.startswith("_"))


def parameters(function) -> list[tuple[str, object, object]]:
    """Each parameter's name, kind and default (annotations are strings, spelled by each module)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def assert_same_call(face, concrete) -> None:
    """A property stays a property; a method takes the face's parameters, by name, kind and default."""
    if isinstance(face, property):
        assert isinstance(concrete, property)
    else:
        assert parameters(concrete) == parameters(face)


def test_the_face_lists_the_calls_engines_and_plug_ins_make():
    assert FACE == ["advise", "block_sources", "cancel_prefetch", "close", "delete", "get", "load", "lookup",
                    "prefetch", "present", "put", "save", "tokens_worth_loading", "write_behind"]


@pytest.mark.parametrize("name", FACE)
def test_kvclient_has_each_call_of_the_face_with_its_parameters(name):
    assert_same_call(inspect.getattr_static(StoreClient, name), inspect.getattr_static(KVClient, name))


@pytest.mark.parametrize("name", [name for name in FACE if name != "close"])
def test_the_async_client_has_the_same_calls(name):
    concrete = inspect.getattr_static(AsyncKVClient, name)
    assert_same_call(inspect.getattr_static(StoreClient, name), concrete)
    # what waits on a daemon is awaitable there; what never waits (queueing saves and prefetches, estimates,
    # load once the hit is known: start_load) is a plain call on both
    assert inspect.iscoroutinefunction(concrete) == (name in {"lookup", "present", "get", "load", "put", "delete",
                                                              "advise"})


def test_a_kvclient_is_a_store_client():
    with KVClient(ClientConfig(("127.0.0.1:1",))) as client:  # gRPC connects on a first call: none is made
        assert isinstance(client, StoreClient)
