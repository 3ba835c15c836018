"""local_sockets keeps the digest of its sockets (count, sum of roster_hash) as they come and
go: the relay compares it with the roster's instead of sending every socket's id."""

from __future__ import annotations

import uuid

import pytest

from fleet.executors.fleet.delivery import local_sockets


@pytest.fixture(autouse=True)
def _forget_sockets():
    local_sockets.clear()
    yield
    local_sockets.clear()


async def _nothing(*_args) -> None:
    return None


def _socket(agent_id: uuid.UUID, generation: int, channel: str) -> local_sockets.LocalSocket:
    return local_sockets.LocalSocket(
        agent_id, 1, channel, generation, "json", None, _nothing, _nothing
    )


def _recomputed() -> tuple[int, int]:
    sockets = local_sockets.snapshot().values()
    return len(sockets), sum(local_sockets.roster_hash(s.agent_id, s.generation) for s in sockets)


def test_the_digest_follows_registrations_replacements_and_unregistrations():
    a, b = uuid.uuid4(), uuid.uuid4()
    assert local_sockets.digest() == (0, 0)
    local_sockets.register(_socket(a, 1, "a1"))
    local_sockets.register(_socket(b, 4, "b4"))
    assert local_sockets.digest() == _recomputed() != (0, 0)
    local_sockets.register(_socket(a, 2, "a2"))  # a newer socket of the same agent replaces it
    assert local_sockets.digest() == _recomputed()
    assert local_sockets.digest()[0] == 2
    assert not local_sockets.unregister(a, "a1")  # the older socket's goodbye changes nothing
    assert local_sockets.digest() == _recomputed()
    assert local_sockets.unregister(a, "a2") and local_sockets.unregister(b, "b4")
    assert local_sockets.digest() == (0, 0)


def test_the_keys_follow_registrations_replacements_and_unregistrations():
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    def keyed(agent_id: uuid.UUID, channel: str, key_id: int | None) -> local_sockets.LocalSocket:
        return local_sockets.LocalSocket(
            agent_id, 1, channel, 1, "json", key_id, _nothing, _nothing
        )

    def recomputed() -> set[int]:
        sockets = local_sockets.snapshot().values()
        return {s.key_id for s in sockets if s.key_id is not None}

    local_sockets.register(keyed(a, "a1", 7))
    local_sockets.register(keyed(b, "b1", 7))
    local_sockets.register(keyed(c, "c1", None))
    assert local_sockets.key_ids() == recomputed() == {7}
    local_sockets.register(keyed(a, "a2", 8))  # a newer socket, opened with another key
    assert local_sockets.key_ids() == recomputed() == {7, 8}
    assert not local_sockets.unregister(a, "a1")  # the older socket's goodbye changes nothing
    assert local_sockets.key_ids() == {7, 8}
    local_sockets.unregister(b, "b1")
    assert local_sockets.key_ids() == recomputed() == {8}
    local_sockets.unregister(a, "a2")
    assert local_sockets.key_ids() == set()
