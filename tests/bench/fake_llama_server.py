"""A stand-in for llama-server in tests: /health, and a streamed /completion that answers with
prompt[-1] + 1, + 2, ... (an end-of-generation token 2 when the prompt ends with 7) and timings with
draft counters when started with -md. Started as an executable by the method under test."""

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
speculative = "-md" in args
if "--fail" in args or "-m" not in args:
    print("error: failed to load model", flush=True)
    sys.exit(1)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, n = body["prompt"], body["n_predict"]
        eos = prompt[-1] == 7
        tokens = [prompt[-1] + 1 + i for i in range(n if not eos else 3)]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t in tokens:
            self.wfile.write(f"data: {json.dumps({'content': 'x', 'tokens': [t], 'stop': False})}\n\n".encode())
        timings = {"predicted_n": len(tokens), "predicted_per_second": 100.0}
        if speculative:
            timings |= {"draft_n": len(tokens), "draft_n_accepted": len(tokens) // 2}
        last = {"content": "", "tokens": [], "stop": True, "stop_type": "eos" if eos else "limit", "timings": timings}
        self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
