"""A ModelServer in a thread of the test process, for the server's tests and the others that
check an answer over HTTP."""

import http.client
import json
import threading

import tinyloop
from tinyloop.server import ModelServer


class Running:
    """A ModelServer on a free port in a thread, and a small JSON client for it."""

    def __init__(self, path, parallel=1, prompt_cache=None, batch_decode=None, batch_choices=True,
                 options=None):
        self.model = tinyloop.Model(path, threads=1)
        self.server = ModelServer(("127.0.0.1", 0), self.model, name="tiny", parallel=parallel,
                                  prompt_cache=prompt_cache, batch_decode=batch_decode,
                                  batch_choices=batch_choices, options=options)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def request(self, method, path, body=None, raw=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        return response.status, payload

    def post(self, path, body):
        status, payload = self.request("POST", path, body)
        return status, json.loads(payload)

    def events(self, path, body):
        status, payload = self.request("POST", path, body)
        assert status == 200, payload
        lines = [line for line in payload.decode().split("\n\n") if line]
        assert all(line.startswith("data: ") for line in lines)
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]]

    def close(self):
        if not self.server.stopping.is_set():
            self.server.shutdown()
            self.server.server_close()
        self.model.close()
