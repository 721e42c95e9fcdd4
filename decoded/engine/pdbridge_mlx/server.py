"""Command line, unix-socket server and the single model thread.

Connections are served on their own threads so cheap ops (info, tokenize)
answer at once; model work (generate, reconstruct) goes to ONE thread,
because MLX is not thread-safe: generations share it as a continuous batch,
a bridged block's reconstruction runs between two of its steps, anything else
runs alone. A connection's thread sends its generation's lines, so a slow reader
never holds the model thread.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import queue
import signal
import socket
import stat
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from google.protobuf import json_format
from pdbridge_cache.proto import engine_pb2

from .errors import BadRequest, BlockUnusable, Cancelled, StartupError
from .generation import Job

log = logging.getLogger("pdbridge_mlx")

# A request is one JSON line; token lists of long prompts are the big part
# (~7 bytes per token id), so this allows well over a million tokens.
MAX_REQUEST_BYTES = 16 << 20
# A client that neither sends its request nor reads our replies for this long
# is gone; without a limit it could hold the model thread forever.
IO_TIMEOUT_S = 120.0
DTYPES = ("float32", "float16", "bfloat16")


class _Shutdown(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT."""


class ModelThread:
    """All MLX work, on one daemon thread (MLX is not thread-safe).

    Exclusive work (the model load, a generation that cannot join a batch) runs alone, in
    arrival order. Generations that can join run together as one continuous batch of at most
    `max_batch`, joining and leaving between steps. Exclusive work waits for the batch to drain
    and holds back later arrivals meanwhile, so nothing waits forever (mlx_lm.server's policy).
    Work that touches no generation's state (`between_steps`) runs between two batch steps.
    """

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.engine: Any = None
        self.busy = False
        threading.Thread(target=self._run, name="pdbridge-model", daemon=True).start()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs `fn` alone on the model thread; its result or exception comes back here."""
        return self._wait(_Exclusive(concurrent.futures.Future(), fn, args, kwargs))

    def between_steps(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs `fn` on the model thread between two steps of the running batch, ahead of queued
        work and without waiting for the batch to drain: for work that touches no generation's
        state (a bridged block's cache computed from its layer inputs), which would otherwise
        wait out every running answer."""
        return self._wait(_Exclusive(concurrent.futures.Future(), fn, args, {}, between_steps=True))

    def _wait(self, item: _Exclusive) -> Any:
        self._inbox.put(item)
        return item.future.result()

    def submit(self, job: Any) -> None:
        """Queues a generation; it reports through `job.lines()`."""
        self._inbox.put(job)

    def _run(self) -> None:
        from .batch import Batch  # MLX: imported on the thread that uses it, after startup checks

        pending: deque = deque()
        batch: Batch | None = None
        while True:
            idle = not pending and not batch
            try:
                pending.append(self._inbox.get(block=idle))
                while True:
                    pending.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if batch is None and self.engine is not None:
                batch = Batch(self.engine, self.engine.max_batch)
            for item in [i for i in pending if isinstance(i, _Exclusive) and i.between_steps]:
                pending.remove(item)
                self._start(item, batch, False)
            while pending:
                item = pending[0]
                joins = not isinstance(item, _Exclusive) and self.engine.batchable(item.params)
                if joins and not batch.has_room or not joins and batch:
                    break  # the batch is full, or must drain before this runs alone
                pending.popleft()
                self.busy = True
                try:
                    self._start(item, batch, joins)
                finally:
                    self.busy = bool(batch)
            if batch:
                self.busy = True
                try:
                    batch.step()
                except Exception:
                    log.exception("batch step failed; its generations were failed")
                self.busy = bool(batch)

    def _start(self, item: Any, batch: Any, joins: bool) -> None:
        if isinstance(item, _Exclusive):
            try:
                item.future.set_result(item.fn(*item.args, **item.kwargs))
            except BaseException as e:  # delivered to the caller's thread
                item.future.set_exception(e)
            return
        if item.cancelled.is_set():
            item.fail(Cancelled("client went away"))
            return
        try:
            if joins:
                batch.add(item)
            else:
                self.engine.generate(item)
        except BaseException as e:  # delivered to the connection's thread
            item.fail(e)


@dataclass
class _Exclusive:
    future: concurrent.futures.Future
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    between_steps: bool = False


def to_line(message: Any) -> bytes:
    """A message as one line of the protocol: its proto3 JSON with the proto field names."""
    obj = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _send(conn: socket.socket, reply: engine_pb2.Reply) -> None:
    conn.sendall(to_line(reply))


def _read_request(conn: socket.socket) -> engine_pb2.Request:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break  # a client may also end its request by closing its write side
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise BadRequest(f"request larger than {MAX_REQUEST_BYTES} bytes")
    line = bytes(buf).split(b"\n", 1)[0].strip()
    if not line:
        raise BadRequest("empty request")
    try:
        return json_format.Parse(line, engine_pb2.Request())
    except (UnicodeDecodeError, json_format.ParseError) as e:
        raise BadRequest(f"request is not a pdbridge.engine.v1.Request: {e}") from e


class Handler:
    """One request per connection: read a `Request` line, answer with `Reply` lines, close."""

    def __init__(self, engine: Any, model_thread: ModelThread) -> None:
        self.engine = engine
        self.model_thread = model_thread

    def __call__(self, conn: socket.socket) -> None:
        received = time.perf_counter()
        op = "?"
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                req = _read_request(conn)
                op = req.WhichOneof("op") or "?"
                summary = self._dispatch(op, getattr(req, op) if op != "?" else None, conn, received)
                # decoded probes `info` every few seconds (engine.liveness): not worth a line each.
                level = logging.DEBUG if op == "info" else logging.INFO
                log.log(level, "op=%s ok %sms=%.1f", op, summary, (time.perf_counter() - received) * 1000)
            except (BrokenPipeError, ConnectionResetError) as e:
                # A client that gave up waiting, e.g. a liveness probe queued while we were stopped.
                log.info("op=%s: the client left: %s", op, e)
            except BadRequest as e:
                log.warning("op=%s bad_request: %s", op, e)
                self._send_error(conn, engine_pb2.Error(message=str(e), kind=engine_pb2.ERROR_KIND_BAD_REQUEST))
            except BlockUnusable as e:
                log.warning("op=%s block_unusable: %s", op, e)
                self._send_error(
                    conn, engine_pb2.Error(message=str(e), kind=engine_pb2.ERROR_KIND_BLOCK_UNUSABLE, block=e.index)
                )
            except Cancelled as e:
                log.info("op=%s cancelled: %s", op, e)
            except Exception as e:
                log.exception("op=%s failed", op)
                self._send_error(
                    conn, engine_pb2.Error(message=f"{type(e).__name__}: {e}", kind=engine_pb2.ERROR_KIND_INTERNAL)
                )

    def _dispatch(self, op: str, req: Any, conn: socket.socket, received: float) -> str:
        if op == "info":
            _send(conn, engine_pb2.Reply(info=self.engine.info()))
            return ""
        if op == "tokenize":
            tokens = self.engine.tokenize(req)
            _send(conn, engine_pb2.Reply(tokenize=engine_pb2.TokenizeReply(tokens=tokens)))
            return f"tokens={len(tokens)} "
        if op == "generate":
            job = Job(self.engine.parse(req), received)
            self.model_thread.submit(job)
            try:
                for done in job.lines():
                    _send(conn, done)
            except OSError as e:  # the model thread drops it at its next step
                job.cancelled.set()
                raise Cancelled(f"client went away: {e}") from e
            done, t = done.done, done.done.timings_ms
            return (
                f"prompt={done.prompt_tokens} cached={done.cached_tokens} "
                f"completion={done.completion_tokens} finish={done.finish_reason} "
                f"queue_ms={t['queue']} restore_ms={t['restore']} prefill_ms={t['prefill']} "
                f"first_token_ms={t['first_token']} decode_ms={t['decode']} "
            )
        if op == "reconstruct":
            reply = self.model_thread.between_steps(self.engine.reconstruct, req)
            _send(conn, engine_pb2.Reply(reconstruct=reply))
            return f"offset={req.offset} rows={reply.rows} reconstruct_ms={reply.timings_ms['reconstruct']} "
        raise BadRequest("the request names no op (expected info, tokenize, generate or reconstruct)")

    @staticmethod
    def _send_error(conn: socket.socket, error: engine_pb2.Error) -> None:
        try:
            _send(conn, engine_pb2.Reply(error=error))
        except OSError:
            pass


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdbridge_mlx",
        description="pd-bridge decode engine adapter: serves an mlx-lm model over a unix socket "
        "(ops: info, tokenize, generate, reconstruct; one request line per connection, "
        "proto/engine.proto as proto3 JSON).",
    )
    p.add_argument("--model", required=True, help="mlx-lm model folder")
    p.add_argument("--socket", required=True, help="unix socket path to serve on (a stale file is replaced)")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per store block (default 256)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="activation/cache dtype (default float32; fp16 is emulated and slow on x86 CPUs)")
    p.add_argument("--kv-bits", type=int, choices=(2, 3, 4, 5, 6, 8),
                   help="quantize the KV cache to this many bits, as mlx-lm's --kv-bits (default: not quantized)")
    p.add_argument("--kv-group-size", type=int, default=64, help="KV cache quantization group size (default 64)")
    p.add_argument("--bundle-dir", help="where to write the reconstruction bundle (default: the socket's directory)")
    p.add_argument("--model-id", help="model identity published in the spec (default: the model folder's name)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="generations decoded together in one continuous batch (default 8; 1: one at a time)")
    p.add_argument("--chat-template", type=argparse.FileType("r", encoding="utf-8"),
                   help="Jinja chat template file replacing the model's own (e.g. one that renders tools)")
    p.add_argument("--log-level", default="INFO", help="stderr log level (default INFO)")
    args = p.parse_args(argv)
    if args.block_tokens < 1:
        p.error("--block-tokens must be >= 1")
    if args.max_batch < 1:
        p.error("--max-batch must be >= 1")
    if args.chat_template is not None:
        with args.chat_template as f:
            args.chat_template = f.read()
    return args


def _claim_stdout():
    """stdout carries exactly one line, the ready line; point fd 1 at stderr
    so nothing a library prints can corrupt it."""
    sys.stdout.flush()
    ready_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return ready_out


def _remove_stale_socket(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a leftover of a dead adapter
        return
    finally:
        probe.close()
    raise StartupError(f"another process is serving on {path}")


def _bind(path: str) -> tuple[socket.socket, int]:
    _remove_stale_socket(path)  # again: another adapter may have started during our load
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Owner-only: the socket lets a caller run the model and write files.
    old_umask = os.umask(0o177)
    try:
        listener.bind(path)
    except OSError as e:
        listener.close()
        raise StartupError(f"cannot bind {path}: {e}") from e
    finally:
        os.umask(old_umask)
    listener.listen(64)
    return listener, os.lstat(path).st_ino


class Adapter:
    """The process's life: start (model, bundle, socket), serve, close."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.socket_path = os.path.abspath(args.socket)
        self.model_thread: ModelThread | None = None
        self.engine: Any = None
        self.listener: socket.socket | None = None
        self._inode: int | None = None

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.socket_path), exist_ok=True)
        _remove_stale_socket(self.socket_path)  # fail fast, before the slow model load
        import mlx.core as mx  # not at module level: --help and argument errors stay instant

        from .engine import Engine

        self.model_thread = ModelThread()
        # Built on the model thread like all MLX work.
        self.engine = self.model_thread.call(
            Engine, self.args.model, block_tokens=self.args.block_tokens,
            dtype=getattr(mx, self.args.dtype),
            bundle_dir=self.args.bundle_dir or os.path.dirname(self.socket_path),
            model_id=self.args.model_id, kv_bits=self.args.kv_bits, kv_group_size=self.args.kv_group_size,
            max_batch=self.args.max_batch, chat_template=self.args.chat_template,
        )
        self.model_thread.engine = self.engine
        self.listener, self._inode = _bind(self.socket_path)

    def serve(self) -> None:
        handler = Handler(self.engine, self.model_thread)
        while True:
            conn, _ = self.listener.accept()
            threading.Thread(target=handler, args=(conn,), name="pdbridge-conn", daemon=True).start()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.cancelled.set()  # a running generation stops at its next token
        if self.listener is not None:
            self.listener.close()
        # Remove the socket only if it is still ours (not a successor's).
        try:
            if self._inode is not None and os.lstat(self.socket_path).st_ino == self._inode:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    @property
    def busy(self) -> bool:
        return self.model_thread is not None and self.model_thread.busy


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s pdbridge_mlx: %(message)s",
    )
    ready_out = _claim_stdout()

    def on_signal(signum: int, _frame: Any) -> None:
        raise _Shutdown(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    adapter = Adapter(args)
    try:
        t0 = time.perf_counter()
        try:
            adapter.start()
        except Exception as e:
            if isinstance(e, StartupError):
                log.error("cannot start: %s", e)
            else:
                log.exception("cannot start")
            ready_out.write(to_line(engine_pb2.Ready(ready=False, error=str(e))).decode())
            ready_out.flush()
            return 1
        log.info("serving on %s (ready in %.0f ms)", adapter.socket_path, (time.perf_counter() - t0) * 1000)
        ready_out.write(to_line(engine_pb2.Ready(ready=True, socket=adapter.socket_path)).decode())
        ready_out.flush()
        adapter.serve()
    except _Shutdown as sig:
        log.info("%s: shutting down", sig)
    finally:
        adapter.close()
    if adapter.busy:
        # A prefill chunk cannot be interrupted; don't let interpreter teardown
        # wait for (or race) native MLX work on the model thread.
        logging.shutdown()
        os._exit(0)
    return 0
