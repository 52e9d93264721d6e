"""Tokenization and detokenization inside the engine's process: the `llm_inline` model.

The ensemble in one process: the same inputs and outputs as `ensemble`, the same preprocessing,
engine and postprocessing code, but all of it run by the one engine process, as an engine that
does its own text work would. Served under the name `ensemble` where the engine runs on the CPU
(--pipeline), whose cores the text processes would take from the engine's threads.
"""

from __future__ import annotations

import numpy as np

from tritone.serving.inputs import Getter, LLMRequest, parse_llm_request
from tritone.serving.processing import Postprocessor, Preprocessor


class InlineText:
    def __init__(self, params: dict[str, str]):
        self.preprocess = Preprocessor(params)
        self.postprocess = Postprocessor.from_parameters(params)

    @property
    def detokenizer(self):
        return self.postprocess.detokenizer

    def parse(self, getters: list[Getter]) -> list[LLMRequest | ValueError]:
        """The engine requests of a batch of ensemble requests (lower-case public inputs), or the
        error of each one that is not valid."""
        upper = [lambda name, get=get: get(name.lower()) for get in getters]
        parsed: list = []
        for get, result in zip(getters, self.preprocess(upper)):
            if isinstance(result, Exception):
                parsed.append(result)
                continue
            try:
                parsed.append(parse_llm_request(lambda name, get=get, r=result: r[name] if name in r
                                                else get(name.lower())))
            except ValueError as exc:
                parsed.append(exc)
        return parsed

    def outputs(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The ensemble's output tensors for one llm response's tensors."""
        (result,) = self.postprocess([tensors.get])
        return {name.removeprefix("OUT_").lower(): array for name, array in result.items()}
