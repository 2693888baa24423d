"""A fake Kubeflow Pipelines API server on a real loopback socket (http.server in a thread). It answers
the v2beta1 calls kfp.Client makes to upload a pipeline and start runs, and records every request
(method, path, query, headers, body) so the tests can check what the client sent."""

from __future__ import annotations

import email.parser
import email.policy
import itertools
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

API = "/apis/v2beta1"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def upload(self) -> tuple[str, bytes]:
        """(file name, content) of the multipart ``uploadfile`` field."""
        raw = b"Content-Type: " + self.headers["Content-Type"].encode() + b"\r\n\r\n" + self.body
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(raw)
        for part in msg.iter_parts():
            if part.get_param("name", header="content-disposition") == "uploadfile":
                return part.get_filename(), part.get_payload(decode=True)
        raise AssertionError(f"no uploadfile part in {self.path}")


@dataclass
class FakeKFP:
    requests: list[Request] = field(default_factory=list)
    pipelines: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> pipeline
    versions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # pipeline id -> versions
    experiments: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> experiment
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    fail: dict[str, tuple[int, str]] = field(default_factory=dict)  # path suffix -> (status, body)
    # the states a run reports to GET /runs/{id}, one more per read (the last one stays)
    run_states: tuple[str, ...] = ("RUNNING", "SUCCEEDED")
    _reads: dict[str, int] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def new_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}"

    def answer(self, req: Request) -> tuple[int, Any]:
        for suffix, (status, body) in self.fail.items():
            if req.path.endswith(suffix):
                return status, {"error": body, "message": body, "code": status}
        path, q = req.path.removeprefix(API), req.query
        if req.method == "GET" and path == "/healthz":
            return 200, {"multi_user": False}
        if req.method == "GET" and path == "/pipelines":
            return 200, self._list(self.pipelines.values(), q, "pipelines")
        if req.method == "POST" and path == "/pipelines/upload":
            pid = self.new_id("pipeline")
            name = q["name"][0]
            self.pipelines[pid] = {"pipeline_id": pid, "display_name": name}
            self.versions[pid] = [self._version(pid, name)]
            return 200, self.pipelines[pid]
        if req.method == "POST" and path == "/pipelines/upload_version":
            pid = q["pipelineid"][0]
            if pid not in self.pipelines:
                return 404, {"error": f"pipeline {pid} not found", "code": 5}
            self.versions[pid].append(self._version(pid, q["name"][0]))
            return 200, self.versions[pid][-1]
        if req.method == "GET" and path.startswith("/pipelines/") and path.endswith("/versions"):
            pid = path.split("/")[2]
            return 200, {"pipeline_versions": list(reversed(self.versions.get(pid, []))), "total_size": 1}
        if req.method == "GET" and path == "/experiments":
            return 200, self._list(self.experiments.values(), q, "experiments")
        if req.method == "POST" and path == "/experiments":
            eid = self.new_id("experiment")
            self.experiments[eid] = {**req.json(), "experiment_id": eid}
            return 200, self.experiments[eid]
        if req.method == "POST" and path == "/runs":
            rid = self.new_id("run")
            self.runs[rid] = {**req.json(), "run_id": rid, "state": "PENDING"}
            return 200, self.runs[rid]
        if req.method == "GET" and path.startswith("/runs/") and path.removeprefix("/runs/") in self.runs:
            rid = path.removeprefix("/runs/")
            n = self._reads[rid] = self._reads.get(rid, -1) + 1
            self.runs[rid]["state"] = self.run_states[min(n, len(self.run_states) - 1)]
            return 200, self.runs[rid]
        return 404, {"error": f"fake KFP: no route for {req.method} {req.path}", "code": 5}

    def _version(self, pid: str, name: str) -> dict[str, Any]:
        return {"pipeline_id": pid, "pipeline_version_id": self.new_id("version"), "display_name": name}

    @staticmethod
    def _list(items: Any, q: dict[str, list[str]], key: str) -> dict[str, Any]:
        """KFP's list call with its display_name EQUALS filter applied."""
        items = list(items)
        if "filter" in q:
            flt = json.loads(q["filter"][0])
            for p in flt.get("predicates", []):
                if p.get("key") == "display_name" and p.get("operation") in (1, "EQUALS"):
                    want = p.get("stringValue", p.get("string_value"))
                    items = [i for i in items if i["display_name"] == want]
        return {key: items, "total_size": len(items)}

    def serve(self) -> tuple[ThreadingHTTPServer, str]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                req = Request(
                    self.command,
                    url.path,
                    urllib.parse.parse_qs(url.query),
                    dict(self.headers.items()),
                    self.rfile.read(n) if n else b"",
                )
                fake.requests.append(req)
                status, body = fake.answer(req)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _handle

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server, f"http://127.0.0.1:{server.server_address[1]}"
