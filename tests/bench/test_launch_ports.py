"""`free_port` hands out ports that cannot collide before their servers bind them."""

from __future__ import annotations

import socket

from bench.launch import free_port


def test_free_port_never_repeats_within_a_process(monkeypatch) -> None:
    # a worker's range of one port: a second call may not hand it out again
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr("bench.launch._candidate_port", lambda: port)
    assert free_port() == port
    try:
        free_port()
    except RuntimeError as e:
        assert "no free port" in str(e)
    else:
        raise AssertionError("free_port handed out the same port twice")


def test_free_ports_drawn_before_binding_are_distinct() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
