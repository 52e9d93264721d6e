"""CPU seconds of a server's processes by role, from /proc: what each part of a stack costs a token.

Measured as vLLM's front end is measured: the user and system CPU time of every process of the
server's tree, sampled before and after a closed-loop window, divided by the output tokens the
window served. A process is named by its role (tritonserver, each Python-backend model, the
OpenAI front end; vLLM's API server and engine core), so both stacks print one table.
"""

from __future__ import annotations

import os
import pathlib
import re

# The text path of Tritone: what a token costs between the engine and the client.
TEXT_PATH_ROLES = ("tritonserver", "preprocessing", "postprocessing")
_TICKS = os.sysconf("SC_CLK_TCK")
_STUB_MODEL = re.compile(rb"/([^/\x00]+)/\d+/model\.py")


def read_stat(text: str) -> tuple[int, float]:
    """(parent pid, user + system CPU seconds) from one /proc/<pid>/stat line."""
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def role(comm: str, cmdline: bytes) -> str:
    """What a process of a serving stack is, from its name and command line."""
    if comm == "tritonserver":
        return "tritonserver"
    if b"python_backend_stub" in cmdline:
        model = _STUB_MODEL.search(cmdline)
        if model and model.group(1) == b"ensemble":  # Triton's ensembles have no process: llm_inline serves as one
            return "llm_inline"
        return model.group(1).decode() if model else "python backend"
    if b"tritone.openai" in cmdline:
        return "openai front end"
    if b"tritone.executor.worker" in cmdline:  # the llm model's ranks under tensor or data parallelism
        return "llm workers"
    if comm.startswith("VLLM::EngineCor") or b"EngineCore" in cmdline:
        return "vllm engine core"
    if comm.startswith("VLLM::"):  # vLLM names its processes: the model's workers
        return "vllm " + comm.removeprefix("VLLM::").rstrip("0123456789_").lower()
    if b"vllm" in cmdline:
        return "vllm api server"
    return "other"


class ProcessTree:
    """The processes under each of `roots` (themselves included), summed by role: a server and
    its front end where the launcher starts them side by side."""

    def __init__(self, *roots: int, proc: pathlib.Path = pathlib.Path("/proc")):
        self.roots, self.proc = roots, proc

    def _processes(self) -> dict[int, tuple[int, float, str, bytes]]:
        found = {}
        for stat in self.proc.glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
                parent, seconds = read_stat(text)
                comm = text[text.index("(") + 1:text.rindex(")")]
                found[int(stat.parent.name)] = (parent, seconds, comm, (stat.parent / "cmdline").read_bytes())
            except (OSError, ValueError, IndexError):
                pass  # a process that ended between the listing and the read
        return found

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each role in the tree (processes that ended are not counted,
        which a window that starts and ends with the same server does not meet)."""
        processes = self._processes()
        children: dict[int, list[int]] = {}
        for pid, (parent, *_) in processes.items():
            children.setdefault(parent, []).append(pid)
        totals: dict[str, float] = {}
        stack = list(self.roots)
        while stack:
            pid = stack.pop()
            stack.extend(children.get(pid, []))
            if pid in processes:
                _, seconds, comm, cmdline = processes[pid]
                name = role(comm, cmdline)
                totals[name] = totals.get(name, 0.0) + seconds
        return totals


def per_token_ms(before: dict[str, float], after: dict[str, float], num_tokens: int) -> dict[str, float]:
    """Milliseconds of CPU per output token by role, with Tritone's text path summed when present."""
    report = {name: 1000.0 * (after[name] - before.get(name, 0.0)) / max(1, num_tokens) for name in after}
    if "tritonserver" in report:
        report["text path"] = sum(report.get(name, 0.0) for name in TEXT_PATH_ROLES)
    return report


def format_per_token(report: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.3f}" for name, ms in sorted(report.items()))
