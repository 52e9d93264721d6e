"""Finds tritonserver, fills the model repository's templates, and runs the server.

`python -m tritone.launcher --help` lists the options; `scripts/serve` calls it after set-up.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import sysconfig
import time
import urllib.request
from dataclasses import dataclass

from tritone.models import cache_root, resolve_model
from tritone.processes import die_with_parent, free_port
from tritone.serving import flow
from tritone.serving.inputs import CONTROL_KEY_ENV

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
_TEMPLATE = re.compile(r"\$\{(\w+)\}")
# The models a server loads: the ensemble stack, or the single-process ablation that benchmarks
# compare it with (never both by default: each loads the model).
ENSEMBLE_MODELS = ("preprocessing", "llm", "postprocessing", "ensemble")
INLINE_MODELS = ("llm_inline",)
# tritonserver's own exit timeout, after the launcher's drain (Server.triton_exit_timeout).
TRITON_EXIT_GRACE_SECONDS = 10
# Triton's administrative APIs, which no client of a model needs: registering shared memory
# (any region, the Python backend's own included: NVIDIA's CVE-2025-23319/23320/23334 chain),
# the repository, logging, trace and statistics. They answer only requests that carry this
# header with the admin key (--admin-key); health, metadata, model config and inference stay open.
RESTRICTED_APIS = "shared-memory,model-repository,logging,trace,statistics"
ADMIN_HEADER = "tritone-admin-key"


@dataclass(slots=True)
class TritonInstall:
    binary: pathlib.Path
    backend_dir: pathlib.Path
    env: dict[str, str]


def find_tritonserver() -> TritonInstall:
    """NVIDIA's container install if present, else the binary in the nvidia-pytriton wheel."""
    env = dict(os.environ)
    python_path = list(dict.fromkeys([str(REPO_ROOT / "backends"), sysconfig.get_paths()["purelib"],
                                      sysconfig.get_paths()["platlib"]]))
    container = pathlib.Path("/opt/tritonserver")
    if (container / "bin" / "tritonserver").exists():
        return TritonInstall(container / "bin" / "tritonserver", container / "backends", env)
    try:
        import pytriton
    except ImportError:
        raise RuntimeError("no tritonserver found: use NVIDIA's tritonserver container, or "
                           "pip install nvidia-pytriton (scripts/serve does this)") from None
    wheel = pathlib.Path(pytriton.__file__).parent / "tritonserver"
    libs = pathlib.Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    # One backend directory per checkout and environment: servers started from two checkouts
    # at once would otherwise hand each other's stubs the wrong paths.
    key = hashlib.sha256(repr(python_path).encode()).hexdigest()[:12]
    backend_dir = cache_root() / "triton_backends" / key
    python_backend = backend_dir / "python"
    python_backend.mkdir(parents=True, exist_ok=True)
    for item in (wheel / "backends" / "python").iterdir():
        if item.is_file():
            _link(item, python_backend / item.name)
    _link(stub, python_backend / "triton_python_backend_stub")
    # The stub runs Python isolated (environment variables ignored) from the base interpreter's
    # sys.path, with the backend directory on it: a module there hands it our paths.
    (python_backend / "tritone_env.py").write_text(
        f"import sys\nsys.path[:0] = [p for p in {python_path!r} if p not in sys.path]\n")
    libpython_dir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), libpython_dir, env.get("LD_LIBRARY_PATH", "")) if p)
    return TritonInstall(wheel / "bin" / "tritonserver", backend_dir, env)


# tritonserver spends about a fifth of its CPU in the C library's malloc and free under streaming
# load (three messages per streamed token, each allocated, copied and freed across threads); any
# of these allocators takes 10% to 20% off the text path's CPU per token
# (docs/performance.md). mimalloc comes with Tritone's dependencies; the others where the system
# has them (NVIDIA's container ships jemalloc and tcmalloc).
MALLOC_LIBRARIES = {"mimalloc": ("mimalloc",), "jemalloc": ("jemalloc",), "tcmalloc": ("tcmalloc_minimal", "tcmalloc")}


def find_malloc(choice: str) -> str | None:
    """The allocator library to preload for `--malloc choice` (None: the C library's)."""
    if choice == "system":
        return None
    if choice not in ("auto", *MALLOC_LIBRARIES):
        if not pathlib.Path(choice).is_file():
            raise ValueError(f"--malloc {choice}: no such file (auto, system, {', '.join(MALLOC_LIBRARIES)} "
                             "or a library's path)")
        return choice
    for name in MALLOC_LIBRARIES if choice == "auto" else (choice,):
        found = _malloc_library(name)
        if found:
            return found
    if choice != "auto":
        raise ValueError(f"--malloc {choice}: the library is not installed")
    return None


def _malloc_library(name: str) -> str | None:
    import ctypes.util

    if name == "mimalloc":  # the cmeel-mimalloc wheel, in this environment
        for site in dict.fromkeys((sysconfig.get_paths()["platlib"], sysconfig.get_paths()["purelib"])):
            found = sorted(pathlib.Path(site, "cmeel.prefix", "lib").glob("libmimalloc.so.*"))
            if found:
                return str(found[0])
    for soname in MALLOC_LIBRARIES[name]:
        found = ctypes.util.find_library(soname)
        if found:
            return found
    return None


def _link(source: pathlib.Path, target: pathlib.Path) -> None:
    if target.is_symlink() or target.exists():
        if target.resolve() == source.resolve():
            return
        target.unlink()
    target.symlink_to(source)


def render_repository(target: pathlib.Path, values: dict[str, str],
                      models: tuple[str, ...] = ENSEMBLE_MODELS) -> pathlib.Path:
    """Copies the `models` of the model repository to `target`, filling `${name}` templates in
    config.pbtxt. A template without a value stays as it is, and the model code treats it as unset."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for model in models:
        shutil.copytree(MODEL_REPOSITORY / model, target / model, ignore=shutil.ignore_patterns("__pycache__"))
    for config in target.glob("*/config.pbtxt"):
        text = _TEMPLATE.sub(lambda m: str(values.get(m.group(1), m.group(0))), config.read_text())
        config.write_text(text)
    return target


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/serve", description="Serve a model with Tritone on tritonserver.")
    p.add_argument("--model", help="local Hugging Face causal-LM directory (default: SmolLM2-135M-Instruct, prepared once)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind HTTP and gRPC to (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="tritonserver's HTTP port (KServe v2, `generate`, `generate_stream`)")
    p.add_argument("--grpc-port", type=int, default=8001, help="tritonserver's gRPC port")
    p.add_argument("--metrics-port", type=int, default=8002,
                   help="tritonserver's Prometheus metrics port (`/metrics`, with the engine's `tritone_*` metrics)")
    p.add_argument("--preprocessing-instances", type=int, default=2, help="processes of the tokenizer model")
    # One: under the dynamic batcher one instance takes every waiting chunk in one execute, and a
    # second only splits the batches (default model, 2 cores: text path 0.46-0.52 -> 0.41-0.46 ms
    # of CPU per token at concurrency 32 and 128). More where the text path falls behind.
    p.add_argument("--postprocessing-instances", type=int, default=1,
                   help="processes of the detokenizer model (more where the text path falls behind)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--kv-cache-bytes", type=int, default=0, help="KV cache budget in bytes (0: a fraction of free memory)")
    p.add_argument("--kv-cache-fraction", type=float, default=0.25,
                   help="share of free memory (GPU) or available RAM (CPU) the KV cache takes when --kv-cache-bytes is 0")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in the running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens computed per step, decodes plus prompt chunks: bounds a step's latency")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's own limit")
    p.add_argument("--max-input-len", type=int, default=0, help="longest prompt accepted, in tokens (0: max model len)")
    p.add_argument("--max-input-bytes", type=int, default=1 << 20,
                   help="longest text_input or messages accepted, in bytes, checked before tokenizing")
    p.add_argument("--exit-timeout", type=int, default=30,
                   help="seconds in-flight requests get to finish on shutdown, while new ones are refused")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="waiting requests beyond this get 'server busy' (default 1024; 0: no limit)")
    p.add_argument("--num-threads", type=int, default=0,
                   help="CPU threads for the model (0: every core)")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the model's forward on CPU (auto: where a C++ compiler is present); "
                        "the first start compiles, later starts load the cache")
    p.add_argument("--forward", default="auto", choices=["auto", "native", "torch"],
                   help="native: Tritone's Llama-family model in one native call per step (CPU: fp32, or bf16 "
                        "with AVX512-BF16); "
                        "torch: the model's torch modules (compiled per --compile); auto: native where it can run")
    p.add_argument("--attention", default="auto", choices=["auto", "cpu-native", "flash-varlen", "triton", "sdpa"],
                   help="paged attention kernel (auto: the native kernel on CPU; on CUDA the first of flash-varlen "
                        "and triton that agrees with SDPA on a probe batch at start)")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "off"],
                   help="replay decode steps from CUDA graphs captured at start (auto: on CUDA where the model "
                        "and attention allow; off: every step eager)")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="schedule and prepare step N+1 while the device computes step N (auto: on CUDA, where the "
                        "device runs asynchronously; on CPU each step would only come back one step later)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many ranks, each a worker process: GPUs, or equal slices of "
                        "the CPU cores (Llama-family models; heads split by KV head)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="run this many independent engines behind the one llm model, each request sent to the one "
                        "holding its prompt's prefix or with the most free KV cache (GPUs or CPU core slices: "
                        "tensor x data parallel size of them)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed response, except the first and the last (default 1: every token); "
                        "larger values send fewer responses, each with more text")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="never reuse the KV of a prompt prefix computed for an earlier request")
    p.add_argument("--chat-template", default="auto", choices=["auto", "never"],
                   help="auto: wrap text_input in the model's chat template when it has one")
    p.add_argument("--inline", action="store_true",
                   help="serve llm_inline (tokenizer, engine and detokenizer in one process, the benchmarks' "
                        "ablation) instead of the ensemble")
    p.add_argument("--openai-port", type=int, default=9000,
                   help="port of tritone-openai, the OpenAI-compatible API on --host (default 9000; 0: off)")
    p.add_argument("--api-key", default=None,
                   help="key tritone-openai requires as 'Authorization: Bearer KEY' (default: $TRITONE_API_KEY; "
                        "none: open)")
    p.add_argument("--admin-key", default=None,
                   help=f"key of Triton's administrative APIs ({RESTRICTED_APIS}), sent as the header "
                        f"'{ADMIN_HEADER}: KEY' (default: $TRITONE_ADMIN_KEY; none: a random one, so closed)")
    p.add_argument("--max-body-bytes", type=int, default=0,
                   help="largest request body tritone-openai reads (default 0: 4 x --max-input-bytes)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json"],
                   help="the model's tool-call syntax for tritone-openai (default auto: from the chat template; "
                        "hermes where it names none)")
    p.add_argument("--malloc", default="auto",
                   help="memory allocator of tritonserver and its model processes, preloaded: auto (the first "
                        "found of mimalloc, jemalloc, tcmalloc; else the C library's), mimalloc, jemalloc, "
                        "tcmalloc, system (the C library's), or a library's path")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver's --log-verbose level")
    return p


def chat_template_text(model_dir: pathlib.Path) -> str:
    """The model's chat template as written in its directory (empty where it has none)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    try:
        template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template") or ""
    except (OSError, ValueError):
        return ""
    return template if isinstance(template, str) else json.dumps(template)


def template_values(args, model_dir: pathlib.Path) -> dict[str, str]:
    return {
        "model_dir": str(model_dir),
        "preprocessing_instances": args.preprocessing_instances,
        "postprocessing_instances": args.postprocessing_instances,
        "device": args.device,
        "dtype": args.dtype,
        "kv_cache_bytes": args.kv_cache_bytes,
        "kv_cache_fraction": args.kv_cache_fraction,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "max_input_len": args.max_input_len,
        "max_input_bytes": args.max_input_bytes,
        "max_queue_len": args.max_queue_len,
        "num_threads": args.num_threads,
        "compile": args.compile,
        "forward": args.forward,
        "attention": args.attention,
        "cuda_graphs": args.cuda_graphs,
        "async_scheduling": args.async_scheduling,
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "stream_interval": args.stream_interval,
        "enable_prefix_caching": str(not args.no_prefix_caching).lower(),
        "chat_template": args.chat_template,
    }


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
            f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
            f"--exit-timeout-secs={self.triton_exit_timeout}",
            f"--log-verbose={a.log_verbose}",
        ]

    def start(self, stdout=None) -> None:
        self._stdout = stdout
        install = find_tritonserver()
        models = INLINE_MODELS if getattr(self.args, "inline", False) else ENSEMBLE_MODELS
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
        print(f"tritone: tritonserver and its model processes allocate with {malloc or 'the C library'}",
              file=stdout or sys.stdout, flush=True)
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
            from tritone.openai.tools import parser_for_template

            parser = parser_for_template(chat_template_text(self.model_dir))
        command = [sys.executable, "-m", "tritone.openai", "--grpc-url", f"{grpc_host}:{a.grpc_port}",
                   "--host", a.host, "--port", str(a.openai_port), "--model-name", self.model_dir.name,
                   "--tool-call-parser", parser, "--max-body-bytes", str(self.max_body_bytes)]
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
                        return self._wait_frontend(deadline)
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver was not ready within {timeout:.0f} s")

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


def _print_usage(server: Server) -> None:
    a = server.args
    print(f"""
Tritone is serving {server.model_dir.name} as model "ensemble".
  curl -s -X POST http://{a.host}:{a.http_port}/v2/models/ensemble/generate \\
       -d '{{"text_input": "What is the capital of France?", "max_tokens": 24}}'
  curl -s -N -X POST http://{a.host}:{a.http_port}/v2/models/ensemble/generate_stream \\
       -d '{{"text_input": "What is the capital of France?", "max_tokens": 24, "stream": true}}'
  tritone-client generate --url {a.host}:{a.grpc_port} --stream "What is the capital of France?"
Metrics: http://{a.host}:{a.metrics_port}/metrics    Stop: Ctrl-C
""", flush=True)
    if server.openai_url:
        key = "$TRITONE_API_KEY" if a.api_key else "none"
        print(f"""OpenAI-compatible API: {server.openai_url} (model "{server.model_dir.name}")
  curl -s {server.openai_url}/chat/completions -H "Authorization: Bearer {key}" -H 'Content-Type: application/json' \\
       -d '{{"model": "{server.model_dir.name}", "messages": [{{"role": "user", "content": "Hi!"}}], "max_tokens": 24}}'
""", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.api_key = args.api_key or os.environ.get("TRITONE_API_KEY")
    server = Server(args)
    started = time.monotonic()
    try:
        server.start()
    except ValueError as exc:  # an option that cannot be honoured, named in the message
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C or SIGTERM: new requests are refused, those in flight finish (up to the exit
    # timeout), then tritonserver exits; a second Ctrl-C cuts the wait short.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.request_stop())
    try:
        server.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        server.stop()
        return 1
    print(f"Ready in {time.monotonic() - started:.1f} s.", flush=True)
    _print_usage(server)
    return server.supervise()


if __name__ == "__main__":
    sys.exit(main())
