"""The engine's own figures, from the server's Prometheus endpoint: busy fraction and step phases."""

from __future__ import annotations

import re
import time
import urllib.request

STEP_PHASES = ("schedule", "prepare", "forward", "sample", "update", "send")


class ServerMetrics:
    """The engine's counters from the server's Prometheus endpoint (any model label)."""

    def __init__(self, metrics_url: str):
        self.url = metrics_url

    @classmethod
    def of(cls, server) -> "ServerMetrics":
        """The metrics of a `tritone.launcher.Server`."""
        return cls(f"http://{server.args.host}:{server.args.metrics_port}/metrics")

    def read(self) -> dict[str, float]:
        values: dict[str, float] = {}
        with urllib.request.urlopen(self.url, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("tritone_"):
                    name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
                    values[name] = values.get(name, 0.0) + value
                    if (phase := re.search(r'phase="(\w+)"', line)) is not None:
                        values[f"{name}:{phase.group(1)}"] = values.get(f"{name}:{phase.group(1)}", 0.0) + value
        return values

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until the engine has no request running or waiting, and has reported it (metrics are
        reported once a second)."""
        deadline = time.monotonic() + timeout
        idle_since = None
        while time.monotonic() < deadline:
            m = self.read()
            if m.get("tritone_num_requests_running", 0) == 0 and m.get("tritone_num_requests_waiting", 0) == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 1.2:
                    return
            else:
                idle_since = None
            time.sleep(0.2)
        raise TimeoutError(f"the engine was still busy {timeout:.0f} s after the load stopped")


def step_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per engine step in each phase between two reads of ServerMetrics (send runs
    on the sender thread, beside the next step), and the steps counted."""
    steps = after.get("tritone_steps_total", 0.0) - before.get("tritone_steps_total", 0.0)
    key = "tritone_step_phase_seconds_total:"
    out = {phase: 1000 * (after.get(key + phase, 0.0) - before.get(key + phase, 0.0)) / max(steps, 1.0)
           for phase in STEP_PHASES}
    out["steps"] = steps
    return out


def format_breakdown(breakdown: dict[str, float]) -> str:
    return ", ".join(f"{phase} {breakdown[phase]:.2f}" for phase in STEP_PHASES) + " ms per step"
