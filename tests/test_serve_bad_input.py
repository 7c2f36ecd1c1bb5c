"""speculant serve against careless and hostile clients: huge prompts, bad JSON, stalled and
aborted connections, and a command line that would bind nothing or leave the server open.
Every refusal is one OpenAI-shaped error (or one line and exit 2 from the command), found before
any work it would waste: tokenizing, loading weights."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_serve import GOOD, TIMEOUT, engine, wait_for  # noqa: E402,F401  (module fixture)

from speculant.serve import create_app  # noqa: E402
from speculant.serve.background import serving  # noqa: E402

STALL_S = 1.5  # the header and body deadlines of the stalling server


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine, max_body_bytes=4 << 20, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def server(app):
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def stalling_server(engine):
    """Short deadlines for headers and bodies, for the tests of connections that stall."""
    with serving(create_app(engine, body_timeout=STALL_S, timeout=TIMEOUT), header_timeout=STALL_S) as url:
        yield url


def requests_counted(url, endpoint, status):
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    key = f'speculant_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    return next((float(line[len(key):]) for line in text.splitlines() if line.startswith(key)), 0.0)


def post(url, path, content):
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=TIMEOUT)


class Spy:
    """Wraps one tokenizer method: counts the calls and notes whether each ran on an event loop."""

    def __init__(self, owner, name, monkeypatch):
        self.real, self.on_loop = getattr(owner, name), []
        monkeypatch.setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)
        return self.real(*args, **kwargs)


# -- huge prompts ---------------------------------------------------------------------------------
def test_a_huge_prompt_is_refused_before_it_is_tokenized(app, server, monkeypatch):
    encode = Spy(app.state.server.prompts.tokenizer, "encode", monkeypatch)
    before = requests_counted(server, "completions", 400)
    t = time.monotonic()
    reply = httpx.post(server + "/v1/completions", json={**GOOD, "prompt": "x" * 1_000_000}, timeout=TIMEOUT)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "1000000 characters" in error["message"] and "2048 tokens" in error["message"]
    assert encode.on_loop == []  # refused by its length alone
    assert time.monotonic() - t < 10
    assert requests_counted(server, "completions", 400) == before + 1


def test_prompts_are_tokenized_off_the_event_loop(app, server, monkeypatch):
    """A prompt that may fit is tokenized in a thread: /health and every stream keep moving."""
    tokenizer = app.state.server.prompts.tokenizer
    encode = Spy(tokenizer, "encode", monkeypatch)
    render = Spy(tokenizer, "apply_chat_template", monkeypatch)
    assert httpx.post(server + "/v1/completions", json={**GOOD, "prompt": "def f(x):"}, timeout=TIMEOUT).is_success
    chat = {"model": "speculant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(server + "/v1/chat/completions", json=chat, timeout=TIMEOUT).is_success
    assert encode.on_loop == [False, False] and render.on_loop == [False]


def test_a_prompt_near_the_bound_is_still_tokenized_exactly(server):
    """The character bound only refuses what cannot fit: 2047 tokens of text get the exact count."""
    reply = httpx.post(server + "/v1/completions", json={**GOOD, "prompt": "x = 1\n" * 1000}, timeout=TIMEOUT)
    assert reply.status_code == 400
    assert "tokens but the model's context window is 2048" in reply.json()["error"]["message"]


# -- bodies the JSON reader refuses ---------------------------------------------------------------
JSON_BAD = [
    ("/v1/completions", rb'{"model": "speculant", "prompt": "def f(x):\ud800"}', "surrogate"),
    ("/v1/chat/completions", rb'{"model": "speculant", "messages": [{"role": "user", "content": "\udc00"}]}',
     "surrogate"),
    ("/v1/completions", b'{"model": "speculant", "prompt": "\xed\xa0\x80"}', "UTF-8"),  # a surrogate as bytes
    ("/v1/completions", b"[" * 10_000, "nested too deeply"),
    ("/v1/completions", b'{"prompt": ' * 5_000, "nested too deeply"),
]


@pytest.mark.parametrize("path,body,hint", JSON_BAD)
def test_unreadable_json_is_an_invalid_json_400_and_counted(server, path, body, hint):
    endpoint = "chat" if "chat" in path else "completions"
    before = requests_counted(server, endpoint, 400)
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_json" and hint in error["message"], error
    assert requests_counted(server, endpoint, 400) == before + 1
    assert httpx.get(server + "/health", timeout=TIMEOUT).status_code == 200


def test_an_integer_is_a_number_as_json_has_it(server):
    """The openai client sends ``temperature=1`` as ``1``: strict types must not refuse it."""
    reply = httpx.post(server + "/v1/completions", json={**GOOD, "temperature": 0, "top_p": 1}, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text


# -- stalled and aborted connections --------------------------------------------------------------
def connect(url):
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock, seconds=10.0):
    sock.settimeout(seconds)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock):
    """One whole response (head and Content-Length body) off a kept-alive connection; its head."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"])
def test_a_connection_that_stalls_before_its_headers_end_is_closed(stalling_server, sent):
    with connect(stalling_server) as sock:
        sock.sendall(sent)
        t = time.monotonic()
        assert read_until_closed(sock) == b""  # closed, not left open for ever
        assert time.monotonic() - t < STALL_S + 5


def test_a_kept_alive_connection_that_stalls_in_its_next_headers_is_closed(stalling_server):
    with connect(stalling_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # uvicorn's keep-alive timer stops at this byte
        t = time.monotonic()
        assert read_until_closed(sock) == b""
        assert time.monotonic() - t < STALL_S + 5


def test_a_body_that_stalls_gets_408_and_the_connection_closes(stalling_server):
    before = requests_counted(stalling_server, "completions", 408)
    with connect(stalling_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b'"code":"timeout"' in reply
    assert requests_counted(stalling_server, "completions", 408) == before + 1


def test_an_aborted_upload_is_a_499_without_a_traceback(stalling_server):
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    before = requests_counted(stalling_server, "completions", 499)
    try:
        with connect(stalling_server) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
            time.sleep(0.1)
        wait_for(lambda: requests_counted(stalling_server, "completions", 499) == before + 1, what="counting the abort")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING or r.exc_info] == []


# -- the command ----------------------------------------------------------------------------------
@pytest.fixture
def no_weights(monkeypatch):
    """The command must refuse before it loads anything: loading fails this test."""
    def load_engine(*args, **kwargs):
        raise AssertionError("the weights were loaded before the command line was checked")

    monkeypatch.setattr("speculant.api.load_engine", load_engine)
    monkeypatch.delenv("SPECULANT_API_KEY", raising=False)


def serve(capsys, *flags):
    from speculant.cli import main

    code = main(["serve", *flags])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield str(sock.getsockname()[1])


@pytest.mark.parametrize("flags,named", [
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "k3y\n"], "--api-key has spaces or a newline"),
    (["--api-key", " k3y"], "--api-key has spaces or a newline"),
    (["--port", "-1"], "--port -1"),
    (["--port", "70000"], "--port 70000"),
    (["--port", "0"], "--port 0"),
    (["--host", ""], "--host ''"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid'"),
    (["--host", "192.0.2.1"], "not an address of this machine"),
    (["--timeout", "nan"], "--timeout nan"),
    (["--timeout", "inf"], "--timeout inf"),
])
def test_the_command_refuses_in_one_line_before_loading(no_weights, capsys, flags, named):
    code, err = serve(capsys, *flags)
    assert code == 2 and named in err and len(err.splitlines()) == 1, err


def test_the_command_refuses_a_taken_port_and_an_empty_key_in_the_environment(no_weights, capsys, taken_port,
                                                                              monkeypatch):
    code, err = serve(capsys, "--port", taken_port)
    assert code == 2 and "Address already in use" in err and "--port" in err and len(err.splitlines()) == 1
    monkeypatch.setenv("SPECULANT_API_KEY", "")
    code, err = serve(capsys)
    assert code == 2 and "$SPECULANT_API_KEY is empty" in err


@pytest.mark.parametrize("options", [{"api_key": ""}, {"api_key": "k3y\n"}, {"timeout": float("nan")},
                                     {"body_timeout": float("inf")}])
def test_create_app_refuses_what_the_command_refuses(engine, options):
    with pytest.raises(ValueError, match=next(iter(options))):
        create_app(engine, **options)
