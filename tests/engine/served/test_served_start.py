"""The server evalkit starts (endpoint.serve=true, evalkit/engine/served/start.py) and where an API key goes, without
vLLM: another process that takes the chosen port first and answers /health is found out before anything is sent
to it; a key bound for plain http:// to a host that is not this machine is said in one line.
Run: pytest tests/engine/served/test_served_start.py
"""

import os
import socket
import sys
import threading
from http.server import ThreadingHTTPServer

import pytest

from evalkit.config import compose_config
from evalkit.engine.served import start
from tests.engine.served.local_http import QuietHandler, answer_json, serve


class Healthy(QuietHandler):
    """Answers /health as a vLLM server does, and records what reached it."""

    seen: list[tuple[str, str | None]] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        Healthy.seen.append((self.path, self.headers.get("Authorization")))
        answer_json(self, 200 if self.path == "/health" else 404, b"{}")


def test_a_port_taken_by_another_process_before_the_server_is_refused_before_anything_is_sent(tmp_path, monkeypatch):
    """The free port chosen, another process (this test's listener, standing in for another user's) binds it
    first and would answer /health; the started process (a sleeper standing in for vLLM) never listens. The start
    stops its process group and fails in one line naming the port and the listener; nothing reached the listener,
    not even /health (which carries the run's key)."""
    impostor = serve(Healthy)
    try:
        monkeypatch.setattr(start, "free_port", lambda: impostor.server_port)
        monkeypatch.setattr(start, "server_command", lambda cfg, model_dir, port: [
            sys.executable, "-c", "import time; time.sleep(120)"])
        monkeypatch.setattr("evalkit.engine.machine.tuning.choices_for", lambda cfg, model_dir: [])
        Healthy.seen = []
        cfg = compose_config(["engine=served", "endpoint.serve=true", f"output_dir={tmp_path}"])
        with pytest.raises(start.ServerStartError) as raised:
            start.start_server(cfg, str(tmp_path), log=tmp_path / "server.log")
    finally:
        impostor.shutdown()
    message = str(raised.value)
    assert message.startswith(f"127.0.0.1:{impostor.server_port} is answered by a process evalkit did not start "
                              f"(pid {os.getpid()})") and "nothing was sent to it" in message, message
    assert Healthy.seen == []


def routable_address():
    """This machine's address on its network (what a remote host would be reached at), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the route decides the source address
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("remote", [True, False])
def test_a_key_bound_for_plain_http_to_another_host_is_said_in_one_line(tmp_path, monkeypatch, capsys, remote):
    """endpoint.url over http:// at this machine's routable address (a listener on every interface standing in for
    a remote host) with endpoint.api_key_env: one line says the key crosses the network unencrypted, before the
    first request; at 127.0.0.1 nothing is said."""
    from evalkit.engine.factory import start_served
    from evalkit.engine.served.probe import ServerRefused

    address = routable_address() if remote else "127.0.0.1"
    if address is None:
        pytest.skip("this machine has no address besides loopback")
    remote_host = ThreadingHTTPServer((address, 0), Healthy)
    threading.Thread(target=remote_host.serve_forever, daemon=True).start()
    monkeypatch.setenv("EVALKIT_TEST_KEY", "k")
    cfg = compose_config(["engine=served", f"endpoint.url=http://{address}:{remote_host.server_port}/v1",
                          "endpoint.api_key_env=EVALKIT_TEST_KEY", "endpoint.retries=0", f"output_dir={tmp_path}"])
    try:
        with pytest.raises(ServerRefused, match="did not answer /v1/models"):  # the listener serves no model
            start_served(cfg, str(tmp_path))
    finally:
        remote_host.shutdown()
    warned = [line for line in capsys.readouterr().err.splitlines() if "unencrypted" in line]
    if remote:
        assert warned == [f"evalkit: warning: the API key of endpoint.api_key_env=EVALKIT_TEST_KEY goes to {address} "
                          "over plain http://, unencrypted on the network: use https:// there"]
    else:
        assert warned == []


def test_a_link_planted_at_the_servers_log_is_refused_before_the_server_starts(tmp_path, monkeypatch):
    """The server's log has a predictable name (.servers/server-<port>.log in a shared output folder): a link
    planted there, to a file of the user who runs evalkit, is refused in one line before any process starts, and
    the file it points at is not appended to."""
    from evalkit.untrusted import PlantedFile

    started = []
    monkeypatch.setattr("evalkit.engine.machine.tuning.choices_for", lambda cfg, model_dir: [])
    monkeypatch.setattr(start.subprocess, "Popen", lambda *a, **k: started.append(a))
    victim = tmp_path / "victim.txt"
    victim.write_text("kept\n")
    log = tmp_path / "server.log"
    log.symlink_to(victim)
    cfg = compose_config(["engine=served", "endpoint.serve=true", f"output_dir={tmp_path}"])
    with pytest.raises(PlantedFile, match=f"^{log} is a link: evalkit writes nothing through it"):
        start.start_server(cfg, str(tmp_path), log=log)
    assert victim.read_text() == "kept\n" and started == []
