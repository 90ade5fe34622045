"""``mugrpo serve``'s start: a port in use or out of range exits 2 naming ``--port``, before any model loads."""
import socket

import pytest

from mugrpo.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.unit
def test_a_port_in_use_exits_2_naming_the_port(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The model folder does not exist: the port is checked first, so the error is the port's.
        assert main(["serve", "--engine", "hf", "--model", "/nonexistent", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "already in use" in err and "--port 0" in err


@pytest.mark.unit
def test_a_port_out_of_range_exits_2(capsys):
    assert main(["serve", "--engine", "hf", "--model", "/nonexistent", "--port", "70000"]) == 2
    assert "--port 70000: a TCP port is 0..65535" in capsys.readouterr().err
