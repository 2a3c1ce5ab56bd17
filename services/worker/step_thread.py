"""The one thread a worker computes on: queued calls (model load, InitializeCache, close) and the
steps that arrive on its step channels, read by this thread itself.

    gRPC event loop:   InitializeCache ── submit() ──┐
    step channel:      engine's frame ───────────────┼─► select() on this thread ─► the call / the step
    main:              Worker(...), worker.close() ──┘      (one wake-up, no hand-off per step)

Why one thread: each thread that starts an OpenMP parallel region keeps a team of its own, and with
more OpenMP threads alive than cores libgomp stops spinning between regions, so every region of a
step paid a wake-up (docs/benchmarks/log.md, "llama-server side by side"). Why the step thread reads
the channel itself: a hand-off from a reader thread costs a wake-up of this one per step, ~50-100 us
on a small VM, where the socket's whole round trip costs 20 us.

An Executor, so `loop.run_in_executor(step_thread, fn)` works as with a ThreadPoolExecutor.
"""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

logger = logging.getLogger(__name__)

Readable = Callable[[socket.socket], None]


class StepThread(Executor):
    """Runs submitted calls one at a time, in order, and `on_readable(sock)` whenever a watched
    socket has data (between calls, never during one). A call or a handler that raises fails its
    future (a handler's exception is logged and the socket unwatched); the thread goes on."""

    def __init__(self, name: str = "worker-step") -> None:
        self._calls: queue.SimpleQueue[tuple[Future, Callable, tuple, dict] | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()  # touched by this thread only
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._shutdown = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new calls after shutdown")
            future: Future = Future()
            self._calls.put((future, fn, args, kwargs))
            self._wake()
        return future

    def watch(self, sock: socket.socket, on_readable: Readable) -> Future:
        """From any thread: from now on, `on_readable(sock)` on this thread whenever `sock` has data."""
        return self.submit(self._selector.register, sock, selectors.EVENT_READ, on_readable)

    def unwatch(self, sock: socket.socket) -> None:
        """On this thread (a handler's own socket); a socket not watched is ignored."""
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def watched(self) -> list[socket.socket]:
        """On this thread: the sockets watched now."""
        return [key.fileobj for key in self._selector.get_map().values() if key.data is not None]

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Calls already submitted run first; watched sockets are left to their owners to close."""
        with self._lock:
            if not self._shutdown:
                self._shutdown = True
                self._calls.put(None)
                self._wake()
        if wait and not self.on_thread():
            self._thread.join()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the thread is awake already

    def _run(self) -> None:
        try:
            while True:
                for key, _ in self._selector.select():
                    if key.data is None:
                        if not self._run_calls():
                            return
                    # Not when an earlier handler or call of this round unwatched (and closed) the
                    # socket, or another socket took its descriptor since: only the registration
                    # select() answered for.
                    elif self._selector.get_map().get(key.fd) is key:
                        self._readable(key.fileobj, key.data)
        finally:
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _readable(self, sock: socket.socket, on_readable: Readable) -> None:
        try:
            on_readable(sock)
        except Exception:
            logger.exception("a step channel's handler failed; its socket is no longer watched")
            self.unwatch(sock)

    def _run_calls(self) -> bool:
        """Every queued call; False once shutdown's marker came."""
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)
