"""A stand-in for llama.cpp's llama-server, for the bench peer's tests (no binary needed).

    python fake_llama_server.py --port P [--bodies FILE] [--unhealthy-polls N] [any llama args]

Answers GET /health with 503 for the first N polls (the model "loading"), then 200; POST
/completion streams, chunked, the events llama-server sends for `n_predict` tokens: a begin
event, one event per token (the third and fourth in one event, as after an incomplete UTF-8
character), then the final event. Each request body is appended to FILE as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--bodies")
    parser.add_argument("--unhealthy-polls", type=int, default=2)
    args, _ = parser.parse_known_args()
    lock = threading.Lock()
    polls = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args) -> None:
            pass

        def do_GET(self) -> None:
            with lock:
                polls[0] += 1
                healthy = polls[0] > args.unhealthy_polls
            body = b'{"status":"ok"}' if healthy else b'{"error":"loading"}'
            self.send_response(200 if healthy else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if args.bodies:
                with lock, open(args.bodies, "a") as out:
                    out.write(json.dumps(request) + "\n")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            n = request["n_predict"]
            prompt = len(request["prompt"])
            self._event({"content": "", "tokens": [], "stop": False, "tokens_predicted": 0})
            for k in range(1, n + 1):
                if k == 3 and n >= 4:
                    continue  # token 3 held back, sent with token 4
                self._event({"content": "x", "tokens": [k], "stop": False,
                             "tokens_predicted": k, "tokens_evaluated": prompt})  # fmt: skip
            self._event({"content": "", "stop": True, "stop_type": "limit",
                         "tokens_predicted": n, "tokens_evaluated": prompt,
                         "timings": {"cache_n": 0}})  # fmt: skip
            self.wfile.write(b"0\r\n\r\n")

        def _event(self, event: dict) -> None:
            data = f"data: {json.dumps(event)}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
