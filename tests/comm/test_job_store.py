"""The store of a ``tessera train --nprocs`` job: the launcher binds its port before any worker
starts and holds it, rank 0 serves the store on that very socket, and the other ranks join it."""

import datetime
import errno
import os
import socket

import pytest

from tessera.cli.launch import store_socket
from tessera.comm.group import STORE_FD, _job_store

TIMEOUT = datetime.timedelta(seconds=20)


def test_the_port_is_held_from_the_moment_it_is_chosen(monkeypatch):
    with store_socket() as sock:
        port = sock.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError) as e:
            other.bind(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        # the store owns the descriptor it serves on (as rank 0 owns the one it inherited): a
        # duplicate, so closing the socket here never closes a number this process reuses later
        monkeypatch.setenv(STORE_FD, str(os.dup(sock.fileno())))
        served = _job_store(0, 2, TIMEOUT)  # rank 0 serves the store on the inherited socket
        monkeypatch.setenv(STORE_FD, "rank 0")
        joined = _job_store(1, 2, TIMEOUT)
        assert served is not None and joined is not None
        joined.set("from rank 1", b"x")
        assert served.get("from rank 1") == b"x"
        assert served.port == joined.port == port  # type: ignore[attr-defined]
        del joined, served


def test_without_the_variable_ranks_use_torchs_env_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv(STORE_FD, raising=False)
    assert _job_store(0, 2, TIMEOUT) is None
