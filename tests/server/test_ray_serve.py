"""`tinyloop serve --ray`: two CPU replicas of a tiny model on a local Ray cluster that
the command starts on this machine (loopback only, bounded in time), reached through
Ray's HTTP proxy on 127.0.0.1 with the official `openai` client and plain httpx: both
replicas answer, streams end with [DONE], errors keep OpenAI's shape, the API key holds,
and with --prefix-routing a prompt's family stays on one replica. Skipped, loudly, when
Ray Serve is not installed (pip install 'tinyloop-runtime[ray]')."""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import textmodel

if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
    pytest.skip("Ray Serve is not installed: the --ray path is NOT tested here "
                "(pip install 'tinyloop-runtime[ray]' to run it)", allow_module_level=True)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "sk-ray"
REPLICA = "x-tinyloop-replica"
STARTUP_S = 180     # Ray's processes, the proxy and two replicas
STOP_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "tiny.tinyloop"
    # a long context, so that a generation outlasts a client that leaves
    textmodel.make_text_model(path, chat_template=textmodel.CHATML, max_seq_len=4096)
    return path


@pytest.fixture(scope="module", params=["direct", "prefix"])
def ray_server(request, model_file, tmp_path_factory):
    """(base url, log path, the command's process) of `tinyloop serve --ray --replicas 2`."""
    port = _free_port()
    log = tmp_path_factory.mktemp("ray-log") / "serve.log"
    command = [sys.executable, "-m", "tinyloop", "serve", str(model_file), "--ray", "--replicas", "2",
               "--host", "127.0.0.1", "--port", str(port), "--name", "tiny", "--threads", "1",
               "--replica-cpus", "0.5", "--api-key", KEY, "--drain-timeout", "5"]
    if request.param == "prefix":
        command.append("--prefix-routing")
    # a local cluster of its own, on loopback, that reports nothing anywhere
    # (its files in a short folder of its own: Ray's socket paths have a length limit)
    temp = tempfile.mkdtemp(prefix="tl-ray-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_DEDUP_LOGS="0",
               RAY_TMPDIR=temp)
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_S
        while b"on Ray Serve at" not in log.read_bytes():
            assert process.poll() is None, f"the command ended ({process.returncode}):\n{_tail(log)}"
            assert time.monotonic() < deadline, f"not serving after {STARTUP_S} s:\n{_tail(log)}"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", log, process, request.param
    finally:
        _stop(process)
        shutil.rmtree(temp, ignore_errors=True)


def _tail(log, n: int = 4000) -> str:
    return log.read_bytes()[-n:].decode(errors="replace")


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_two_replicas_answer_completions_and_chat(ray_server):
    url, log, _, _ = ray_server
    client = _client(url)
    assert [m.id for m in client.models.list()] == ["tiny"]
    seen = set()
    for i in range(12):   # different prompts: either router spreads them over both replicas
        raw = client.completions.with_raw_response.create(model="tiny", prompt=f"{i} Hello", max_tokens=4,
                                                          temperature=0)
        done = raw.parse()
        assert done.object == "text_completion" and done.choices[0].finish_reason in ("stop", "length")
        assert done.usage.completion_tokens <= 4
        seen.add(raw.headers[REPLICA])
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": f"{i} hi"}], max_tokens=3, temperature=0)
        chat = raw.parse()
        assert chat.choices[0].message.role == "assistant" and chat.model == "tiny"
        seen.add(raw.headers[REPLICA])
        if len(seen) == 2 and i >= 3:
            break
    assert len(seen) == 2, f"one replica answered everything: {seen}\n{_tail(log)}"


def test_streams_end_with_done(ray_server):
    url, _, _, _ = ray_server
    client = _client(url)
    whole = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].text   # a greedy answer is the same on either replica
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["usage"]["completion_tokens"] <= 5
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_a_client_that_leaves_ends_its_generation(ray_server):
    url, log, _, shape = ray_server
    rid = f"leaves-{shape}"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4000, "stream": True, "depth": 4,
            "logit_bias": {str(textmodel.EOS): -100}}   # no end of its own before 4000 tokens
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": rid}) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i == 4:
                break
    # the replica's access log line (through Ray's log forwarding) counts what it generated
    deadline = time.monotonic() + 30
    while (line := next((x for x in _tail(log, 1 << 20).splitlines() if f"id={rid}" in x), None)) is None:
        assert time.monotonic() < deadline, f"no access log line for {rid}:\n{_tail(log)}"
        time.sleep(0.25)
    generated = int(line.split("completion=")[1].split()[0])
    assert generated < 4000, line


def _assert_openai_error(response, status: int, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def test_errors_keep_openai_shape(ray_server):
    url, _, _, _ = ray_server
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, timeout=30) as http:
        _assert_openai_error(http.post("/v1/completions", content=b"{not json", headers=auth), 400)
        _assert_openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1},
                                       headers=auth), 400)
        _assert_openai_error(http.post("/v1/chat/completions", json={"model": "other", "messages": []},
                                       headers=auth), 404, "model_not_found")
        _assert_openai_error(http.get("/v1/nothing", headers=auth), 404, "not_found")
        _assert_openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": "x"}), 401,
                             "invalid_api_key")
        _assert_openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                                       headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
        assert http.get("/health").json() == {"status": "ok"}   # the one route without the key
    with pytest.raises(openai.BadRequestError):
        _client(url).completions.create(model="tiny", prompt="x", max_tokens=2, temperature=3)


@pytest.mark.parametrize("ray_server", ["prefix"], indirect=True)
def test_prefix_routing_keeps_a_prompt_family_on_one_replica(ray_server):
    url, _, _, _ = ray_server
    client = _client(url)
    stem = "The looped transformer shares its weights across iterations, so "
    family = set()
    for tail in ("a", "b", "c", "d"):
        raw = client.completions.with_raw_response.create(model="tiny", prompt=stem + tail, max_tokens=2)
        family.add(raw.headers[REPLICA])
    assert len(family) == 1, family


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # Ray's own, on import
def test_config_file_args_and_routing_key(monkeypatch):
    """What a config file or RayService gives `build`, and the text a request routes by."""
    from ray import serve

    from tinyloop.server import ray_serve
    monkeypatch.setenv("TINYLOOP_API_KEY", "sk-env")
    spec, rest = ray_serve.parse_args({"model": "m.tinyloop", "threads": 2, "parallel": 3, "replicas": 4,
                                       "num_cpus": 2, "options": {"max_waiting": 8, "allowed_hosts": ["a"]}})
    assert (spec.model, spec.threads, spec.parallel) == ("m.tinyloop", 2, 3)
    assert (spec.options.max_waiting, spec.options.allowed_hosts, spec.options.api_key) == (8, ("a",), "sk-env")
    assert rest == {"replicas": 4, "num_cpus": 2}
    with pytest.raises(ValueError, match="unknown tinyloop Ray Serve args: replica"):
        ray_serve.parse_args({"replica": 2})
    assert isinstance(ray_serve.build({"model": "m.tinyloop", "prefix_routing": True}), serve.Application)
    text = ray_serve.routing_text
    assert text("/v1/completions", b'{"prompt": "abc"}') == "abc"
    assert text("/v1/completions", b'{"prompt": [["x"], [1, 2]]}') == "x"
    assert text("/v1/completions", b'{"prompt": [[5, 6], [1, 2]]}') == "5 6"
    assert text("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
                                        b'"text": "hi"}]}]}') == "user: hi\n"
    assert text("/v1/completions", b"{bad") == text("/v1/completions", b"[1]") == ""


def test_ray_flags_are_checked():
    from tinyloop.cli import main
    assert main(["serve", "--replicas", "2"]) == 1   # only with --ray
    assert main(["serve", "--ray", "--port", "0"]) == 1
    assert main(["serve", "--ray", "--min-replicas", "3", "--max-replicas", "2"]) == 1


def test_sigterm_stops_the_command(ray_server):
    """Last in the module: SIGTERM deletes the application and ends the command cleanly."""
    url, log, process, _ = ray_server
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(STOP_S) == 0, _tail(log)
    assert time.monotonic() - started < STOP_S
    assert b"stopping the replicas" in log.read_bytes()
