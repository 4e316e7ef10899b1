"""A rank whose collective broke names the peers it lost (``tessera.comm.group.lost_peers``):
hosts that do not answer first, else ranks that exited; nothing when every peer answers."""

from __future__ import annotations

import socket

import pytest

from tessera.comm import group
from tessera.comm.group import Peer, lost_peers


@pytest.fixture
def beacons():
    """Two listening sockets on 127.0.0.1 (live peers) and a port nothing listens on."""
    live = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        live.append(s)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    yield [s.getsockname()[1] for s in live], closed
    for s in live:
        s.close()


def _table(monkeypatch, peers: list[Peer]) -> None:
    monkeypatch.setattr(group, "_peers", peers)


def test_every_peer_answers_names_none(monkeypatch, beacons):
    (a, b), _ = beacons
    _table(monkeypatch, [Peer(0, "h0", "127.0.0.1", a), Peer(1, "h0", "127.0.0.1", b)])
    assert lost_peers(0) is None


def test_an_exited_peer_is_named_with_its_host(monkeypatch, beacons):
    (a, _), closed = beacons
    _table(monkeypatch, [Peer(0, "h0", "127.0.0.1", a), Peer(1, "h1", "127.0.0.1", closed)])
    assert lost_peers(0) == "rank 1 on host h1 has exited"


def test_an_unreachable_host_is_named_before_exited_ranks(monkeypatch):
    # a real cut link is in tests/parallel/test_multihost_faults.py; here the probe's answers are given
    states = {1: "exited", 2: "unreachable", 3: "unreachable"}
    monkeypatch.setattr(group, "_probe", lambda peer, timeout_s: states[peer.rank])
    far = [Peer(2, "h1", "10.0.0.2", 9), Peer(3, "h1", "10.0.0.2", 10)]
    _table(monkeypatch, [Peer(0, "h0", "10.0.0.1", 7), Peer(1, "h0", "10.0.0.1", 8), *far])
    said = lost_peers(0, timeout_s=0.5)
    assert (
        said == "host h1 is unreachable (ranks 2, 3 at 10.0.0.2 gave no answer within 0.5 s); this rank is on host h0"
    )


def test_no_table_names_none(monkeypatch):
    _table(monkeypatch, [])
    assert lost_peers(0) is None
