"""A running tritonserver and tritone-openai: started on a rendered repository, supervised
(restarted when a process dies), drained and stopped."""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from tritone.cache import cache_root
from tritone.checkpoints import resolve_model
from tritone.config import text_nice
from tritone.launcher.install import TritonInstall, find_malloc, find_tritonserver
from tritone.launcher.options import (ADMIN_HEADER, RESTRICTED_APIS, build_parser, engine_on_cpu, resolve_pipeline,
                                     template_values)
from tritone.launcher.repository import ENSEMBLE_MODELS, INLINE_MODELS, render_repository
from tritone.processes import die_with_parent, free_port, lower_priority
from tritone.serving import flow
from tritone.serving.inputs import CONTROL_KEY_ENV
from tritone.text.templates import chat_template_text, parser_for_template

# tritonserver's own exit timeout, after the launcher's drain (Server.triton_exit_timeout).
TRITON_EXIT_GRACE_SECONDS = 10


class Server:
    """A tritonserver process serving the rendered repository; used by `serve` and the tests."""

    def __init__(self, args, run_dir: pathlib.Path | None = None):
        self.args = args
        self.model_dir = resolve_model(args.model)
        self.run_dir = run_dir or cache_root() / "run" / f"{args.http_port}"
        self.process: subprocess.Popen | None = None
        self.frontend: subprocess.Popen | None = None
        self.num_restarts = 0
        self.num_frontend_restarts = 0
        # Made at every launch, for this server's parts alone (tritone.serving.inputs.CONTROL_KEY_ENV).
        self.control_key = secrets.token_urlsafe(32)
        self.admin_key = getattr(args, "admin_key", None) or os.environ.get("TRITONE_ADMIN_KEY") \
            or secrets.token_urlsafe(32)
        # The flow board's directory: private to this user, made at start (tritone.serving.flow).
        self.flow_dir: pathlib.Path | None = None
        self._stdout = None
        self._is_stopping = False
        self._skip_drain = False
        # "ensemble" or "inline" (--pipeline, auto resolved once: a restart serves the same).
        self.pipeline = resolve_pipeline(args)
        # Where the engine computes on the CPU, the text work yields it the cores (--text-nice):
        # that much nicer than the processes start (our own priority). Auto resolved once, for
        # the served pipeline, and rendered as a number for the engine's response sender.
        args.text_nice = str(text_nice(getattr(args, "text_nice", "0"), self.pipeline))
        nicer = int(args.text_nice) if engine_on_cpu(args) else 0
        self.text_priority = os.getpriority(os.PRIO_PROCESS, 0) + nicer if nicer else None

    def command(self, install: TritonInstall, repository: pathlib.Path) -> list[str]:
        a = self.args
        return [
            str(install.binary),
            f"--model-repository={repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-address={a.host}", f"--http-port={a.http_port}",
            f"--grpc-address={a.host}", f"--grpc-port={a.grpc_port}",
            f"--metrics-address={a.host}", f"--metrics-port={a.metrics_port}",
            "--model-control-mode=none",
            # Every config.pbtxt is complete; with auto-complete on, the Python backend first starts
            # a stub process per model only to ask it for its config, which imports the model's
            # module (torch, transformers): a start took 15-19 s with it, 11 s without.
            "--disable-auto-complete-config",
            f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
            f"--exit-timeout-secs={self.triton_exit_timeout}",
            f"--log-verbose={a.log_verbose}",
        ]

    def start(self, stdout=None) -> None:
        self._stdout = stdout
        install = find_tritonserver()
        models = INLINE_MODELS if self.pipeline == "inline" else ENSEMBLE_MODELS
        for stale in (self.shutdown_file, self.drained_file):
            stale.unlink(missing_ok=True)
        flow.remove_stale()
        if self.flow_dir is not None:  # a restart's: the last server's page
            shutil.rmtree(self.flow_dir, ignore_errors=True)
        self.flow_dir = flow.private_directory()
        values = {**template_values(self.args, self.model_dir), "shutdown_file": str(self.shutdown_file),
                  "flow_board": str(self.flow_dir / "board")}
        repository = render_repository(self.run_dir / "model_repository", values, models)
        # Its own session, so that Ctrl-C reaches it once, through us; and it dies with us.
        env = dict(install.env)
        env[CONTROL_KEY_ENV] = self.control_key
        malloc = find_malloc(getattr(self.args, "malloc", "auto"))
        if malloc is not None:
            env["LD_PRELOAD"] = os.pathsep.join(p for p in (malloc, env.get("LD_PRELOAD", "")) if p)
        asked = getattr(self.args, "pipeline", "auto") != "auto"
        why = "as asked" if asked else "the engine on the CPU" if self.pipeline == "inline" else "the engine on a GPU"
        print(f"tritone: tritonserver and its model processes allocate with {malloc or 'the C library'}; "
              f"pipeline: {self.pipeline} ({why})", file=stdout or sys.stdout, flush=True)
        self.process = subprocess.Popen(self.command(install, repository), env=env, stdout=stdout,
                                        stderr=subprocess.STDOUT if stdout else None,
                                        start_new_session=True, preexec_fn=die_with_parent)
        self._start_frontend(stdout)

    def _start_frontend(self, stdout) -> None:
        """tritone-openai, a process of its own, on the gRPC port (the key goes by environment,
        out of the process list)."""
        a = self.args
        if not getattr(a, "openai_port", 0):
            return
        env = dict(os.environ)
        env[CONTROL_KEY_ENV] = self.control_key
        if a.api_key:
            env["TRITONE_API_KEY"] = a.api_key
        grpc_host = "127.0.0.1" if a.host in ("0.0.0.0", "::", "") else a.host
        parser = getattr(a, "tool_call_parser", "auto")
        if parser == "auto":
            parser = parser_for_template(chat_template_text(self.model_dir))
        command = [sys.executable, "-m", "tritone.openai", "--grpc-url", f"{grpc_host}:{a.grpc_port}",
                   "--host", a.host, "--port", str(a.openai_port), "--model-name", self.model_dir.name,
                   "--tool-call-parser", parser, "--max-body-bytes", str(self.max_body_bytes),
                   "--pipeline", self.pipeline]
        if getattr(a, "reasoning_parser", None):
            command += ["--reasoning-parser", a.reasoning_parser]
        if getattr(a, "lora_modules", ""):  # the adapters' names, which clients send as the model
            command += ["--lora-modules", a.lora_modules]
        self.frontend = subprocess.Popen(command, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                                         start_new_session=True, preexec_fn=die_with_parent)

    def _stop_frontend(self) -> None:
        # First, so that no new request arrives during the drain; uvicorn gives the streams it
        # holds a few seconds, then closes them (which aborts them in the engine).
        if self.frontend is None or self.frontend.poll() is not None:
            return
        self.frontend.terminate()
        try:
            self.frontend.wait(10)
        except subprocess.TimeoutExpired:
            self.frontend.kill()
            self.frontend.wait()

    @property
    def max_body_bytes(self) -> int:
        """tritone-openai's body limit: room for a prompt of --max-input-bytes, escaped in JSON."""
        a = self.args
        return getattr(a, "max_body_bytes", 0) or 4 * getattr(a, "max_input_bytes", 1 << 20)

    @property
    def openai_url(self) -> str | None:
        port = getattr(self.args, "openai_port", 0)
        return f"http://{self.args.host}:{port}/v1" if port else None

    @property
    def triton_exit_timeout(self) -> int:
        """tritonserver's own wait at exit. The launcher's drain has already waited for every
        request the engine holds, so this lets the models unload. What Triton would
        wait for beyond that never ends: ensemble requests a client cancelled, which Triton
        2.51 keeps counting in flight, and those a dead model process held."""
        return min(self.args.exit_timeout, TRITON_EXIT_GRACE_SECONDS)

    @property
    def shutdown_file(self) -> pathlib.Path:
        """Created to drain the models (see tritone.serving.lifecycle.Drain)."""
        return self.run_dir / "shutting_down"

    @property
    def drained_file(self) -> pathlib.Path:
        """Created by the engine once drained: Drain.done_path of shutdown_file."""
        return pathlib.Path(f"{self.shutdown_file}.done")

    @property
    def http_url(self) -> str:
        return f"{self.args.host}:{self.args.http_port}"

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        self._wait_frontend(deadline)
                        return self._lower_text_priority()
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver was not ready within {timeout:.0f} s")

    def _lower_text_priority(self) -> None:
        """tritonserver's threads, tritone-openai's and the text models' processes, once ready,
        --text-nice nicer than the engine's forward threads; the engine lowers its own response
        sender (AsyncEngine). Once the models are loaded: their processes, forked by tritonserver,
        would otherwise inherit it, and a process cannot take back a priority it gave up."""
        if self.text_priority is None:
            return
        text = [self.process.pid] + [pid for pid in self.stub_pids() if self._is_text_model(pid)]
        if self.frontend is not None and self.frontend.poll() is None:
            text.append(self.frontend.pid)
        for pid in text:
            lower_priority(pid, self.text_priority)

    @staticmethod
    def _is_text_model(pid: int) -> bool:
        try:
            command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return any(f"/{name}/1/model.py".encode() in command for name in ("preprocessing", "postprocessing"))

    def _wait_frontend(self, deadline: float) -> None:
        # A front end that cannot start (its port taken) leaves tritonserver serving: say so.
        while self.frontend is not None and time.monotonic() < deadline:
            if self.frontend.poll() is not None:
                print(f"tritone: tritone-openai exited with code {self.frontend.returncode} "
                      f"(is port {self.args.openai_port} taken? --openai-port N, or 0 to turn it off)",
                      file=sys.stderr, flush=True)
                return
            try:
                with urllib.request.urlopen(self.openai_url.removesuffix("/v1") + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)

    def stub_pids(self) -> set[int]:
        """The Python backend stubs of the running tritonserver: one process per model instance."""
        pids = set()
        for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                if parent == self.process.pid and b"python_backend_stub" in (stat.parent / "cmdline").read_bytes():
                    pids.add(int(stat.parent.name))
            except (OSError, IndexError, ValueError):
                pass
        return pids

    def supervise(self, poll_seconds: float = 1.0) -> int:
        """Until asked to stop, restarts tritonserver whenever it or one of its model processes dies.

        Triton 2.51's Python backend neither restarts a dead stub nor reports its model unready,
        so without this every later request to that model fails until someone restarts the
        server; with model control off, a whole restart is the one way back. There is no drain
        then (a dead stub finishes nothing): tritonserver's short exit timeout passes, and the
        requests the dead stub held end when their connections close. (tritonserver itself may
        also abort when a stub dies holding a shared-memory lock.)"""
        while True:
            stubs = self.stub_pids()
            while self.process.poll() is None and not self._is_stopping and stubs <= self.stub_pids():
                self._keep_frontend()
                time.sleep(poll_seconds)
            if self._is_stopping:
                # Polled, not waited on: stop() in another thread waits with a timeout, and
                # Popen lets only one thread at a time reap the process.
                while self.process.poll() is None:
                    time.sleep(poll_seconds)
                return self.process.returncode
            print("tritone: tritonserver or one of its model processes died; restarting the server",
                  file=sys.stderr, flush=True)
            self.stop(restarting=True)
            if self._is_stopping:
                return self.process.returncode
            self.num_restarts += 1
            self._restart()

    def _keep_frontend(self) -> None:
        """Restarts tritone-openai if it died: the models' restarts are tritonserver's, its own are
        here (its clients' requests in flight are lost with it; the engine aborts them when their
        gRPC streams close)."""
        if self.frontend is None or self.frontend.poll() is None or self._is_stopping:
            return
        print(f"tritone: tritone-openai exited with code {self.frontend.returncode}; restarting it",
              file=sys.stderr, flush=True)
        self.num_frontend_restarts += 1
        self._start_frontend(self._stdout)
        self._lower_text_priority()

    def _restart(self, attempts: int = 3) -> None:
        # A start right after a crash has been seen to abort in the Python backend: try again.
        for attempt in range(attempts):
            self.start(self._stdout)
            try:
                return self.wait_ready()
            except RuntimeError:
                if attempt == attempts - 1 or self._is_stopping:
                    raise

    def request_stop(self) -> None:
        """From a signal handler: the first asks for a graceful stop (in a thread, as it waits),
        a second one cuts the drain short."""
        if self._is_stopping:
            self._skip_drain = True
            return
        self._is_stopping = True
        threading.Thread(target=self.stop, name="tritone-stop", daemon=True).start()

    def drain(self, timeout: float) -> bool:
        """Refuses new requests and waits, up to `timeout` seconds, until the engine has
        finished the ones it holds. Triton 2.51 cannot do this itself for ensemble requests
        (see tritone.serving.lifecycle.Drain). True if the engine reported itself drained."""
        self.shutdown_file.touch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None and not self._skip_drain:
            if self.drained_file.exists():
                return True
            time.sleep(0.05)
        return False

    def stop(self, timeout: float | None = None, restarting: bool = False) -> int:
        """Drains (unless restarting after a crash, when nothing could finish), then asks
        tritonserver to exit, which gives whatever is left its exit timeout."""
        self._is_stopping = self._is_stopping or not restarting
        # Past its own exit timeout, tritonserver 2.51 has been seen to hang rather than exit
        # (with a client's gRPC stream still open): after the drain, nothing is lost by killing it.
        timeout = timeout or self.triton_exit_timeout + 5
        self._stop_frontend()
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        if not restarting and not self.drain(self.args.exit_timeout):
            print("tritone: requests were still in flight at the end of the drain", file=sys.stderr, flush=True)
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            if self.flow_dir is not None:
                shutil.rmtree(self.flow_dir, ignore_errors=True)
            flow.remove_stale()  # the llm model unlinks its own page, unless killed


@contextlib.contextmanager
def temporary_server(log_path: pathlib.Path, *options: str):
    """A tritonserver on free ports for one script's run, with extra launcher `options`: ready
    inside the block, then stopped and its run directory removed."""
    args = build_parser().parse_args(["--http-port", str(free_port()), "--grpc-port", str(free_port()),
                                      "--metrics-port", str(free_port()), "--openai-port", "0", *options])
    server = Server(args, run_dir=pathlib.Path(tempfile.mkdtemp(prefix="tritone-server-")))
    print(f"Starting tritonserver (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        try:
            server.start(stdout=log)
            server.wait_ready()
            yield server
        finally:
            server.stop()
            shutil.rmtree(server.run_dir, ignore_errors=True)


