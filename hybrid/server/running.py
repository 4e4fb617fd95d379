"""Running the server: uvicorn in a background thread (it answers /health with 503 while the model loads) and
the generation worker wherever the caller runs it (the CLI: the main thread, where the engine's threads were set
up). `serve_in_background` is both at once, for tests and scripts."""

from __future__ import annotations

import functools
import threading
import time

import uvicorn

from hybrid.server.app import build_app
from hybrid.server.batch_worker import serve_batched
from hybrid.server.runner import run_job
from hybrid.server.slot import serve_jobs
from hybrid.system.threads import setup_threads


class HttpThread:
    """uvicorn serving build_app(state) on host:port (0: a free port) in a daemon thread."""

    def __init__(self, state, host: str = "127.0.0.1", port: int = 8080, log_level: str = "warning"):
        config = uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=2, access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="hybrid-http", daemon=True)
        self.host = host

    def start(self, timeout_s: float = 30.0) -> None:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive():
                raise OSError(f"the HTTP server did not start on {self.host} (is the port in use?)")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the HTTP server did not start within {timeout_s} s")
            time.sleep(0.02)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def work(state, stop: threading.Event) -> None:
    """The generation worker until `stop` is set: the slot's jobs one at a time, or (-np > 1) batched."""
    setup_threads(state.engine.params.n_threads, pin=False)  # Numba's thread count is per calling thread
    if state.scheduler is not None:
        serve_batched(state, state.scheduler, stop)
    else:
        serve_jobs(state.slots, functools.partial(run_job, state), stop)


class BackgroundServer:
    """HTTP and the worker both in background threads; stop() ends them."""

    def __init__(self, state, host: str = "127.0.0.1", port: int = 0):
        self.state = state
        self.http = HttpThread(state, host, port)
        self.stop_event = threading.Event()
        self.worker = threading.Thread(target=work, args=(state, self.stop_event), name="hybrid-slot", daemon=True)

    def __enter__(self) -> "BackgroundServer":
        self.http.start()
        self.worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.http.url

    def stop(self) -> None:
        self.stop_event.set()
        self.http.stop()
        self.worker.join(timeout=30)
