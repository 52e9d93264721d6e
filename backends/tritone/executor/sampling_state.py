"""What the runner keeps of each request between steps, for sampling (as vLLM's InputBatch): its
parameters, its prompt, the tokens it has sampled for it and its own random generator, sent once
when the request is first scheduled and dropped when it finishes. So a step's message carries
only which request each row samples for, and a seeded request draws from one generator wherever
the runner runs (in the engine's process or in a worker)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from tritone.executor.step import NewRequest, SamplingInput
from tritone.scheduling.request import tokens_slice


@dataclass(slots=True, eq=False)
class SamplingState:
    params: object  # tritone.scheduling.request.SamplingParams
    prompt_ids: list[int]
    generator: torch.Generator
    end_ids: frozenset[int] = frozenset()
    is_guided: bool = False
    # The sampled tokens the host has; `num_unresolved` more are still on the device.
    output_ids: list[int] = field(default_factory=list)
    num_unresolved: int = 0

    @classmethod
    def of(cls, new: NewRequest) -> "SamplingState":
        # On the host whatever the device: a draw from it is no device sync.
        return cls(new.params, list(new.prompt_ids), torch.Generator().manual_seed(new.seed), new.end_ids,
                   new.is_guided)

    @property
    def num_output(self) -> int:
        return len(self.output_ids) + self.num_unresolved

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the output tokens themselves (penalties, bad words)."""
        p = self.params
        return bool(p.bad_token_ids) or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 \
            or p.frequency_penalty != 0.0

    def tokens_slice(self, start: int, end: int) -> list[int]:
        return tokens_slice(self.prompt_ids, self.output_ids, start, end)


class SamplingTable:
    """The runner's SamplingStates by request id. A step's sampled tokens join their requests'
    histories lazily: the step in flight's are still on the device, and are read only where a row
    of the next step needs them (reading them waits for that step)."""

    def __init__(self):
        self.states: dict[str, SamplingState] = {}
        self._unresolved: deque[tuple[object, list[SamplingState]]] = deque()

    def begin_step(self, sampling: SamplingInput) -> list[SamplingState]:
        """Applies the step's news and returns the states of its sampled rows, in row order, with
        the history they read on the host."""
        for request_id in sampling.finished_ids:
            self.states.pop(request_id, None)
        for new in sampling.new:
            self.states[new.request_id] = SamplingState.of(new)
        rows = [self.states[request_id] for request_id in sampling.sample_ids]
        # Steps before the last one have been collected by the engine already: no wait.
        keep = 0 if any(s.reads_history for s in rows) else 1
        while len(self._unresolved) > keep:
            self._resolve(*self._unresolved.popleft())
        return rows

    def end_step(self, handle, rows: list[SamplingState]) -> None:
        """Records that `handle` (a StepHandle) holds one new token for each of `rows`."""
        for state in rows:
            state.num_unresolved += 1
        self._unresolved.append((handle, rows))

    @staticmethod
    def _resolve(handle, rows: list[SamplingState]) -> None:
        token_ids, _ = handle.result()
        for state, token_id in zip(rows, token_ids):
            state.output_ids.append(token_id)
            state.num_unresolved -= 1
