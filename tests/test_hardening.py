"""Hostile and careless requests against a real server (scripts/attack's cases, each a test): no
client ends another's request, passes a limit by calling an internal model, fails a batch, wraps
an integer or reaches an administrative API; tritone-openai checks its key and body size first,
and comes back when it dies."""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time
import urllib.request

import pytest

from conftest import supervised_server
from tritone.launcher import free_port

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import attack  # noqa: E402

pytestmark = pytest.mark.integration

API_KEY = "hardening-key"


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    """A supervised server with tritone-openai behind a key."""
    yield from supervised_server(tmp_path_factory, "hardening", "--kv-cache-bytes", str(256 << 20),
                                 "--openai-port", str(free_port()), "--api-key", API_KEY)


@pytest.fixture(scope="module")
def target(guarded):
    a = guarded.args
    return attack.Target(f"{a.host}:{a.http_port}", f"{a.host}:{a.grpc_port}", f"{a.host}:{a.metrics_port}",
                         guarded.openai_url.removesuffix("/v1"), API_KEY, guarded.model_dir.name)


# The last case of each group checks what the others left behind: it runs last.
@pytest.mark.parametrize("group,name,case", attack.CASES, ids=[name for _, name, _ in attack.CASES])
def test_a_hostile_request_is_refused_and_hurts_no_one(target, group, name, case):
    case(target)


def test_the_attack_script_counts_its_cases(target, capsys):
    passed, failed = attack.run(target, ("triton",))
    out = capsys.readouterr().out
    assert failed == [] and f"{passed} passed, 0 failed" in out
    assert passed == sum(group == "triton" for group, _, _ in attack.CASES)


def test_no_secret_reaches_a_client_or_the_process_list(guarded, target):
    """The control key is in the environments of tritonserver and tritone-openai, never in their
    arguments, a model config or a response; the admin key is Triton's argument, not shown."""
    status, config = attack.http_json(target, "GET", "/v2/models/llm/config")
    assert status == 200 and guarded.control_key not in str(config)
    for pid in (guarded.process.pid, guarded.frontend.pid):
        assert guarded.control_key.encode() not in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        assert guarded.control_key.encode() in pathlib.Path(f"/proc/{pid}/environ").read_bytes()


def test_the_flow_board_is_private_to_the_servers_user(guarded):
    board = guarded.flow_dir / "board"
    assert board.is_file() and (board.stat().st_mode & 0o777) == 0o600
    assert (guarded.flow_dir.stat().st_mode & 0o777) == 0o700


def test_a_dead_tritone_openai_is_restarted(guarded, target):
    old = guarded.frontend.pid
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if guarded.frontend.pid != old:
            try:
                with urllib.request.urlopen(f"{target.openai}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
        time.sleep(0.2)
    assert guarded.frontend.pid != old and guarded.num_frontend_restarts == 1
    attack.openai_serves_after_all_this(target)
