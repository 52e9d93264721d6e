"""The engine's running totals: the scheduler counts tokens and their latencies as it applies
them, the engine its phases' time, and the metrics reporter reads them from another thread."""

from __future__ import annotations

from dataclasses import dataclass, field

# Where a step's time goes, in order: the engine thread's phases, then the sender thread's
# (building and sending the step's responses, which overlaps the next step). `forward` is the
# runner's: the model and sampling, where the logits are; `sample` is the engine's part of
# sampling (grammar masks, the step's bookkeeping).
PHASES = ("schedule", "prepare", "forward", "sample", "update", "send")


@dataclass(slots=True)
class EngineStats:
    """Plain ints and floats, and lists it swaps out, so no lock is needed under the GIL."""

    num_steps: int = 0
    # Seconds per phase (PHASES), summed over steps.
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # The engine thread's seconds waiting for work (no request running).
    idle_seconds: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)

    @property
    def forward_seconds(self) -> float:
        return self.phase_seconds["forward"]

    def take_latencies(self) -> tuple[list[float], list[float]]:
        ttft, self.time_to_first_token = self.time_to_first_token, []
        itl, self.inter_token_latency = self.inter_token_latency, []
        return ttft, itl
