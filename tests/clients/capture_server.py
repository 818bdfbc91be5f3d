"""A tiny HTTP server that records what the coding clients send.

Two modes:

- **fake** (default): answers the three wire APIs the clients use with minimal valid
  replies, streaming or not: OpenAI Responses (`POST /v1/responses`, Codex CLI), Anthropic
  Messages (`POST /v1/messages`, Claude Code), Chat Completions (`POST /v1/chat/completions`,
  opencode and aider), plus `GET /v1/models`. With ``tool_calls`` set it answers a request
  that declares a listed tool, and holds no tool result yet, with a call of that tool, so
  the client runs it and sends the result back (a scripted tool round trip).
  ``drop_events`` leaves named SSE events out of the streams, to find out which ones a
  client needs before it treats a reply as complete.
- **proxy** (``upstream`` set): forwards every request to a real server (`lodestar serve`)
  and streams its reply back unchanged (kept in the entry as ``reply_status`` and ``reply``).
  With ``tool_calls`` too, the scripted tool call answers the first request and the rest go
  to the server: a tool round trip at the protocol level, whatever the model would do.
  ``body_defaults`` adds fields a client leaves out (e.g. temperature) before forwarding;
  the entry keeps the body as the client sent it and lists what was added under ``added``.

In both modes every request is written whole (method, path, query, headers, body) to
``<log_dir>/NNN-<method>-<path>.json``. Standard library only, so it runs beside any venv.

    python tests/clients/capture_server.py --port 9100 --log-dir /tmp/cap --tool-calls
    python tests/clients/capture_server.py --port 9100 --log-dir /tmp/cap --upstream http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# The tool each fake API calls when the client declares it, first match wins.
# "{cwd}" becomes the client's working directory (``workdir``); the clients take absolute paths.
DEFAULT_TOOL_CALLS: dict[str, list[tuple[str, dict]]] = {
    "responses": [("exec_command", {"cmd": "cat hello.txt"}),
                  ("shell_command", {"command": "cat hello.txt"}),
                  ("shell", {"command": ["cat", "hello.txt"]})],
    "messages": [("Read", {"file_path": "{cwd}/hello.txt"}),
                 ("Bash", {"command": "cat hello.txt", "description": "Show hello.txt"})],
    "chat": [("read", {"filePath": "{cwd}/hello.txt"}),
             ("bash", {"command": "cat hello.txt", "description": "Show hello.txt"})],
}


@dataclass
class CaptureConfig:
    log_dir: Path
    upstream: str | None = None          # proxy mode when set
    reply: str = "hello"
    tool_calls: bool = False             # fake mode: script one tool call per conversation
    tool_table: dict = field(default_factory=lambda: DEFAULT_TOOL_CALLS)
    workdir: str = "."
    drop_events: frozenset[str] = frozenset()
    stall_after: str | None = None       # fake mode: send events up to this one, then hold the stream open
    stall_seconds: float = 600.0
    stall_keepalive: float = 0.0         # fake mode: while stalled, send an SSE comment this often (0: never)
    stall_keepalive_event: str | None = None  # ... or this event (as {"type": name}) instead of a comment
    timestamps: bool = False             # proxy mode: prefix each logged reply chunk with its arrival time
    body_defaults: dict = field(default_factory=dict)  # proxy mode: fields added to a generation request without them
    patch_events: dict = field(default_factory=dict)   # fake mode: event type -> JSON merged into its data (null deletes)


def _chat_kind(data) -> str | None:
    """A name for a Chat Completions SSE frame, so that ``drop_events`` can name it too."""
    if data == "[DONE]":
        return "[DONE]"
    if isinstance(data, dict):
        if not data.get("choices") and data.get("usage"):
            return "usage"
        if any(c.get("finish_reason") for c in data.get("choices") or []):
            return "finish"
        return "delta"
    return None


def api_of(path: str) -> str | None:
    """Which wire API a POST path is: "responses", "messages", "chat" or None."""
    if path.endswith("/responses"):
        return "responses"
    if path.endswith("/messages"):
        return "messages"
    if path.endswith("/chat/completions"):
        return "chat"
    return None


def declared_tools(api: str, body: dict) -> set[str]:
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    if api == "chat":
        return {(t.get("function") or {}).get("name") for t in tools}
    return {t.get("name") for t in tools}


def has_tool_result(api: str, body) -> bool:
    """Whether a request carries the result of a tool call (the second half of a round trip)."""
    if not isinstance(body, dict):
        return False
    if api == "responses":
        items = body.get("input") if isinstance(body.get("input"), list) else []
        return any(isinstance(i, dict) and str(i.get("type", "")).endswith("_call_output") for i in items)
    msgs = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    if api == "messages":
        return any(isinstance(m.get("content"), list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in m["content"]) for m in msgs)
    return any(m.get("role") == "tool" for m in msgs)


def _merge(base: dict, patch: dict) -> dict:
    """``base`` with ``patch`` merged in, recursively; a None value deletes the key."""
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CaptureServer

    def log_message(self, fmt, *args):  # quiet: the JSON files are the log
        pass

    # -- recording --------------------------------------------------------------------------
    def _record(self, body: bytes) -> dict:
        url = urllib.parse.urlsplit(self.path)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        entry = {"time": time.time(), "method": self.command, "path": url.path,
                 "query": url.query, "headers": dict(self.headers.items()), "body": parsed}
        self.server.record(entry)
        return entry

    def _read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            return self.rfile.read(n)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return b""

    def _handle(self):
        body = self._read_body()
        entry = self._record(body)
        cfg = self.server.config
        api = api_of(entry["path"]) if self.command == "POST" else None
        scripted = bool(api and isinstance(entry["body"], dict) and self._pick_tool(api, entry["body"]))
        entry["scripted"] = scripted
        try:
            if cfg.upstream and not scripted:
                if api and cfg.body_defaults and isinstance(entry["body"], dict):
                    added = {k: v for k, v in cfg.body_defaults.items() if k not in entry["body"]}
                    if added:
                        entry["added"] = added
                        body = json.dumps({**entry["body"], **added}).encode()
                self._proxy(body, entry)
            else:
                self._fake(entry)
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _handle

    # -- proxy mode -------------------------------------------------------------------------
    def _proxy(self, body: bytes, entry: dict):
        up = urllib.parse.urlsplit(self.server.config.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port or 80, timeout=900)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding", "connection",
                                        "accept-encoding")}
        headers["Content-Length"] = str(len(body))
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
        except OSError as e:
            entry["reply_status"] = 502
            self._send_json(502, {"error": {"message": f"capture proxy: upstream unreachable: {e}"}})
            return
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        # The reply is logged as it arrives, so a stream the client gives up on is still on disk.
        entry["reply_status"], entry["reply"] = resp.status, bytearray()
        entry["reply_headers"] = dict(resp.getheaders())
        with self.server.reply_log(resp.status, entry["reply_headers"]) as log:
            try:
                while True:
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    entry["reply"] += chunk
                    log.write(b"[%.3f] " % time.time() + chunk if self.server.config.timestamps else chunk)
                    log.flush()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            finally:
                conn.close()

    # -- fake mode --------------------------------------------------------------------------
    def _send_json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_sse(self, events: list[tuple[str | None, object]]) -> None:
        cfg = self.server.config
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for name, data in events:
            kind = name or _chat_kind(data)
            if kind in cfg.drop_events:
                continue
            if kind in cfg.patch_events and isinstance(data, dict):
                data = _merge(data, cfg.patch_events[kind])
                name = name and data.get("type", name)
            payload = data if isinstance(data, str) else json.dumps(data)
            frame = (f"event: {name}\n" if name else "") + f"data: {payload}\n\n"
            self.wfile.write(frame.encode())
            self.wfile.flush()
            if cfg.stall_after and kind == cfg.stall_after:
                end = time.monotonic() + cfg.stall_seconds
                while time.monotonic() < end:
                    time.sleep(cfg.stall_keepalive or cfg.stall_seconds)
                    if cfg.stall_keepalive_event:
                        ev = cfg.stall_keepalive_event
                        self.wfile.write(f"event: {ev}\ndata: {json.dumps({'type': ev})}\n\n".encode())
                        self.wfile.flush()
                    elif cfg.stall_keepalive:
                        self.wfile.write(b": keep-alive\n\n")
                        self.wfile.flush()
                return

    def _fake(self, entry: dict) -> None:
        path, body = entry["path"], entry["body"]
        if self.command == "GET" and path.rstrip("/").endswith("/models"):
            self._send_json(200, {"object": "list", "data": [
                {"id": "smollm2-135m", "object": "model", "created": 0, "owned_by": "capture"}]})
            return
        if self.command != "POST" or not isinstance(body, dict):
            self._send_json(404, {"error": {"message": f"capture server: no route {self.command} {path}"}})
            return
        if path.endswith("/responses"):
            self._responses(body)
        elif path.endswith("/messages/count_tokens"):
            self._send_json(200, {"input_tokens": len(json.dumps(body)) // 4})
        elif path.endswith("/messages"):
            self._messages(body)
        elif path.endswith("/chat/completions"):
            self._chat(body)
        else:
            self._send_json(404, {"error": {"message": f"capture server: no route POST {path}"}})

    def _pick_tool(self, api: str, body: dict):
        """The scripted (name, JSON arguments) call for this request, or None."""
        cfg = self.server.config
        if not cfg.tool_calls or has_tool_result(api, body):
            return None
        declared = declared_tools(api, body)
        for name, args in cfg.tool_table.get(api, []):
            if name in declared:
                text = json.dumps(args).replace("{cwd}", cfg.workdir)
                return name, text
        return None

    # OpenAI Responses (Codex CLI)
    def _responses(self, body: dict) -> None:
        n = self.server.next_id()
        call = self._pick_tool("responses", body)
        model = body.get("model", "smollm2-135m")
        base = {"id": f"resp_{n}", "object": "response", "created_at": int(time.time()), "model": model,
                "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
                "instructions": None, "tools": [], "parallel_tool_calls": False, "usage": None}
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
        if call:
            name, args = call
            item = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": name,
                    "arguments": args, "status": "completed"}
            added = dict(item, arguments="", status="in_progress")
            middle = [("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": 0, "delta": args}),
                      ("response.function_call_arguments.done", {"item_id": item["id"], "output_index": 0, "arguments": args})]
        else:
            part = {"type": "output_text", "text": self.server.config.reply, "annotations": []}
            item = {"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant", "content": [part]}
            added = dict(item, status="in_progress", content=[])
            middle = [("response.content_part.added", {"item_id": item["id"], "output_index": 0, "content_index": 0,
                                                      "part": dict(part, text="")}),
                      ("response.output_text.delta", {"item_id": item["id"], "output_index": 0, "content_index": 0,
                                                     "delta": part["text"]}),
                      ("response.output_text.done", {"item_id": item["id"], "output_index": 0, "content_index": 0,
                                                    "text": part["text"]}),
                      ("response.content_part.done", {"item_id": item["id"], "output_index": 0, "content_index": 0,
                                                     "part": part})]
        done = dict(base, status="completed", output=[item], usage=usage)
        if not body.get("stream"):
            self._send_json(200, done)
            return
        events = [("response.created", {"response": base}), ("response.in_progress", {"response": base}),
                  ("response.output_item.added", {"output_index": 0, "item": added}), *middle,
                  ("response.output_item.done", {"output_index": 0, "item": item}),
                  ("response.completed", {"response": done})]
        self._send_sse([(name, dict({"type": name, "sequence_number": i}, **data))
                        for i, (name, data) in enumerate(events)])

    # Anthropic Messages (Claude Code)
    def _messages(self, body: dict) -> None:
        n = self.server.next_id()
        call = self._pick_tool("messages", body)
        model = body.get("model", "smollm2-135m")
        if call:
            name, args = call
            block = {"type": "tool_use", "id": f"toolu_{n}", "name": name, "input": json.loads(args)}
            start = dict(block, input={})
            delta = {"type": "input_json_delta", "partial_json": args}
            stop_reason = "tool_use"
        else:
            block = {"type": "text", "text": self.server.config.reply}
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
            stop_reason = "end_turn"
        message = {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 10, "output_tokens": 1,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        if not body.get("stream"):
            self._send_json(200, dict(message, content=[block], stop_reason=stop_reason,
                                      usage=dict(message["usage"], output_tokens=2)))
            return
        events = [("message_start", {"message": message}),
                  ("content_block_start", {"index": 0, "content_block": start}),
                  ("ping", {}),
                  ("content_block_delta", {"index": 0, "delta": delta}),
                  ("content_block_stop", {"index": 0}),
                  ("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                     "usage": {"output_tokens": 2}}),
                  ("message_stop", {})]
        self._send_sse([(name, dict({"type": name}, **data)) for name, data in events])

    # Chat Completions (opencode, aider)
    def _chat(self, body: dict) -> None:
        n = self.server.next_id()
        call = self._pick_tool("chat", body)
        model = body.get("model", "smollm2-135m")
        usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
        if call:
            name, args = call
            tc = {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": args}}
            message = {"role": "assistant", "content": None, "tool_calls": [tc]}
            deltas = [{"role": "assistant", "content": None, "tool_calls": [dict(tc, index=0)]}]
            finish = "tool_calls"
        else:
            message = {"role": "assistant", "content": self.server.config.reply}
            deltas = [{"role": "assistant", "content": ""}, {"content": self.server.config.reply}]
            finish = "stop"
        head = {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()), "model": model}
        if not body.get("stream"):
            self._send_json(200, dict(head, choices=[{"index": 0, "message": message, "finish_reason": finish}],
                                      usage=usage))
            return
        head["object"] = "chat.completion.chunk"
        chunks = [dict(head, choices=[{"index": 0, "delta": d, "finish_reason": None}]) for d in deltas]
        chunks.append(dict(head, choices=[{"index": 0, "delta": {}, "finish_reason": finish}]))
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append(dict(head, choices=[], usage=usage))
        self._send_sse([(None, c) for c in chunks] + [(None, "[DONE]")])


class CaptureServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, config: CaptureConfig, host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, port), _Handler)
        self.config = config
        config.log_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._count = itertools.count(1)
        self._ids = itertools.count(1)
        self.entries: list[dict] = []
        self._last: dict[int, Path] = {}

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"

    def next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def record(self, entry: dict) -> None:
        with self._lock:
            n = next(self._count)
            self.entries.append(entry)
        slug = entry["path"].strip("/").replace("/", "_") or "root"
        path = self.config.log_dir / f"{n:03d}-{entry['method']}-{slug}.json"
        path.write_text(json.dumps(entry, indent=1, ensure_ascii=False))
        self._last[threading.get_ident()] = path

    def reply_log(self, status: int, headers: dict):
        """A file beside the request's log for its reply (proxy mode): status, headers, body."""
        path = self._last.get(threading.get_ident())
        f = open(path.with_suffix(".reply.txt") if path else os.devnull, "wb")  # noqa: SIM115 (the caller closes it)
        f.write(b"HTTP %d\n" % status + "".join(f"{k}: {v}\n" for k, v in headers.items()).encode() + b"\n")
        return f

    def start_in_thread(self) -> CaptureServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, required=True)
    ap.add_argument("--upstream", help="proxy mode: forward to this base URL (e.g. http://127.0.0.1:8000)")
    ap.add_argument("--reply", default="hello")
    ap.add_argument("--timestamps", action="store_true", help="proxy mode: prefix logged reply chunks with their arrival time")
    ap.add_argument("--default", action="append", default=[], metavar="FIELD=JSON",
                    help="proxy mode: add this field to generation requests that lack it (repeatable)")
    ap.add_argument("--tool-calls", action="store_true", help="answer the first request that declares a known tool with a call of it")
    ap.add_argument("--workdir", default=".", help="the client's working directory, for absolute paths in tool calls")
    ap.add_argument("--drop", action="append", default=[], help="SSE event type to leave out (repeatable)")
    ap.add_argument("--stall-after", help="send SSE events up to this one, then hold the stream open")
    ap.add_argument("--stall-seconds", type=float, default=600.0)
    ap.add_argument("--stall-keepalive", type=float, default=0.0, help="while stalled, an SSE comment every S seconds")
    ap.add_argument("--stall-keepalive-event", help="while stalled, send this event ({\"type\": name}) instead of a comment")
    ap.add_argument("--patch", action="append", default=[], metavar="EVENT=JSON",
                    help="merge JSON into that SSE event's data (null deletes a key; a new \"type\" renames it)")
    args = ap.parse_args()
    cfg = CaptureConfig(log_dir=args.log_dir, upstream=args.upstream, reply=args.reply, timestamps=args.timestamps,
                        tool_calls=args.tool_calls, workdir=args.workdir, drop_events=frozenset(args.drop),
                        stall_after=args.stall_after, stall_seconds=args.stall_seconds,
                        stall_keepalive=args.stall_keepalive, stall_keepalive_event=args.stall_keepalive_event,
                        patch_events={k: json.loads(v) for k, v in (p.split("=", 1) for p in args.patch)},
                        body_defaults={k: json.loads(v) for k, v in (d.split("=", 1) for d in args.default)})
    server = CaptureServer(cfg, args.host, args.port)
    print(f"capture server at {server.url} ({'proxy to ' + cfg.upstream if cfg.upstream else 'fake'}), "
          f"log in {cfg.log_dir}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
