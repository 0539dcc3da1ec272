"""The cloud's rooms as a reader relies on them: no import cycle among them (not even one hidden
inside a function or under ``TYPE_CHECKING``), each mirrored operation handled by exactly one
handler registered for its record type, each request message answered by exactly one server
method registered for its type, and no room or function too long to read at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import transports
from splitft.cloud import handlers
from splitft.cloud.dispatch import answer_names, answers
from splitft.cloud.rank_server import RankServer
from splitft.cloud.server import CloudServer
from splitft.errors import ProtocolError
from splitft.wire import operations as o
from splitft.wire import protocol
from tests.conftest import start_cloud, stop
from tests.import_graph import runtime_cycles
from tests.test_faults import MLP
from tests.test_trust import hello

ROOT = Path(__file__).resolve().parent.parent
CLOUD = ROOT / "splitft" / "cloud"
#: The messages only the cloud sends: an edge sending one is refused.
REPLIES = {protocol.Welcome, protocol.Redirect, protocol.Output, protocol.InputGrads, protocol.Ack, protocol.Error,
           protocol.Pong, protocol.Handoff, protocol.Probed}


# ---------------------------------------------------------------- import cycles


@pytest.mark.parametrize("deferred, typing", [(False, False), (True, False), (True, True)],
                         ids=["at-load", "inside-functions", "for-type-checkers"])
def test_the_cloud_rooms_import_each_other_without_a_cycle(deferred, typing):
    assert runtime_cycles(ROOT / "splitft", "splitft.cloud", deferred=deferred, typing=typing) == []


def test_the_cycle_finder_sees_cycles_at_load_inside_functions_and_for_type_checkers(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\nfrom .c import thing\n")
    (package / "b.py").write_text("import pkg.a\n")
    (package / "c.py").write_text("thing = 1\n\ndef later():\n    from .d import other\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import thing\n"
                                  "other = 2\n")
    assert runtime_cycles(package) == [["pkg.a", "pkg.b"]]
    assert runtime_cycles(package, deferred=True) == [["pkg.a", "pkg.b"]]  # c -> d, but d -> c is for types
    assert runtime_cycles(package, deferred=True, typing=True) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    assert runtime_cycles(package, "pkg.c", deferred=True, typing=True) == []  # c alone


# ---------------------------------------------------------------- operations: one handler per record


def test_every_operation_record_has_exactly_one_handler_and_nothing_else_has_one():
    assert set(handlers.HANDLERS) == set(o.OPERATIONS.values())
    assert len(set(handlers.HANDLERS.values())) == len(handlers.HANDLERS)  # no handler serves two records
    for name, record in o.OPERATIONS.items():
        assert record.NAME == name and callable(handlers.handler_for(record))


def test_a_second_handler_for_a_record_is_refused_when_it_is_registered():
    with pytest.raises(TypeError, match="Step already has a handler: step"):
        handlers.handles(o.Step)(lambda session, op: None)
    assert handlers.HANDLERS[o.Step] is handlers.step


def test_a_record_without_a_handler_is_a_typed_refusal_naming_the_operations_the_cloud_applies():
    class Unknown(o.Operation):
        NAME = "unknown"

    with pytest.raises(ProtocolError, match="applies no operation 'unknown'.*step"):
        handlers.handler_for(Unknown)


# ---------------------------------------------------------------- messages: one answer per request type


@pytest.mark.parametrize("server", [CloudServer, RankServer])
def test_every_request_type_has_exactly_one_answer_and_no_reply_type_has_one(server):
    names = answer_names(server)
    assert set(names) == set(protocol.MESSAGES.values()) - REPLIES
    assert names[protocol.Hello] == "_on_hello" and names[protocol.Ping] == "_on_ping"
    assert {names[t] for t in (protocol.Forward, protocol.Backward, protocol.Sync, protocol.Bye)} == {"_on_request"}


def test_a_subclass_answers_with_its_override_and_two_answers_for_one_type_are_refused():
    assert vars(RankServer)["_on_hello"] is not vars(CloudServer)["_on_hello"]  # the rank's own front door
    assert answer_names(RankServer)[protocol.Hello] == "_on_hello"  # looked up on the instance: the override

    class Twice(CloudServer):
        @answers(protocol.Ping)
        def _pong_again(self, peer, msg, seq):
            return protocol.Pong()

    with pytest.raises(TypeError, match="Ping messages have two handlers: _on_ping and _pong_again"):
        answer_names(Twice)


def test_a_real_cloud_refuses_each_reply_type_it_would_only_send(tmp_path):
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", MLP)
    conn = transports.connect(address)
    try:
        conn.send(protocol.encode(protocol.Ack()))
        lost = protocol.decode(conn.recv(30.0))
        assert isinstance(lost, protocol.Error) and lost.code == "session" and "got ack" in lost.message
        conn.send(protocol.encode(hello()))
        assert isinstance(protocol.decode(conn.recv(30.0)), protocol.Welcome)
        for reply in (protocol.Ack(), protocol.Pong(), protocol.Error(code="internal", message="x")):
            conn.send(protocol.encode(reply))
            answer = protocol.decode(conn.recv(30.0))
            assert isinstance(answer, protocol.Error) and answer.code == "protocol", answer
            assert f"a {reply.TYPE} message is not a request the cloud answers" in answer.message
        conn.send(protocol.encode(protocol.Ping()))
        assert isinstance(protocol.decode(conn.recv(30.0)), protocol.Pong)  # the session is fine after all three
    finally:
        conn.close()
        stop(proc)


# ---------------------------------------------------------------- sizes


def test_no_cloud_room_is_over_500_lines_and_no_function_over_60():
    for path in sorted(CLOUD.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 500, f"{path.name} has {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"{path.name}: {node.name} has {length} lines"


def test_a_process_that_builds_a_cloud_server_and_ends_at_once_exits_cleanly():
    """The server warms torch's dispatch modes up on a thread of its own; a process ending while that
    import ran on a daemon thread aborted (std::terminate, exit status 134)."""
    import subprocess
    import sys

    script = ("import transports\nfrom splitft.cloud import CloudServer\n"
              "CloudServer(transports.InprocListener(), ['tests.models:mlp'])\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "terminate" not in done.stderr, done.stderr
