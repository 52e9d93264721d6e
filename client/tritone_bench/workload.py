"""What to send: prompts of exact token lengths, fixed or in a long-tailed chat-like mix, seeded."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# English words that most tokenizers hold as one token both alone and after a space, so that a
# prompt of N words is N tokens; each tokenizer's own check keeps only those that are.
_WORDS = ("the of and to in is that it for was on are as with his they at be this from have or by one had not "
          "but what all were when we there can an your which their said if do will each about how up out them "
          "then she many some so these would other into has more her two like him see time could no make than "
          "first been its who now people my made over did down only way find use may water long little very "
          "after words called just where most know day get come number sound work place year back live give "
          "name good man think say great help line turn cause much mean old same tell boy follow came want "
          "show also around form three small set put end does another well large must big even such because "
          "here why ask went men read need land different home us move try kind hand picture again change off "
          "play spell air away animal house point page letter mother answer found study still learn should").split()

# Chat-like lengths: log-normal, so most requests are short and a few are long (medians and
# spreads in the range public chat traces show), clipped to the given bounds.
CHAT_MIX = {"prompt_median": 200, "prompt_sigma": 1.0, "output_median": 100, "output_sigma": 0.8}


def chat_lengths(num: int, seed: int = 0, max_prompt: int = 4000, max_output: int = 1000,
                 mix: dict = CHAT_MIX) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) pairs drawn from the long-tailed chat mix."""
    rng = random.Random(seed)

    def draw(median, sigma, upper):
        return max(1, min(upper, round(rng.lognormvariate(math.log(median), sigma))))

    return [(draw(mix["prompt_median"], mix["prompt_sigma"], max_prompt),
             draw(mix["output_median"], mix["output_sigma"], max_output)) for _ in range(num)]


class PromptFactory:
    """Texts of an exact number of tokens (as the tokenizer counts them, special tokens
    included), made of random words: seeded, and different from each other so that the
    server's prefix cache does not turn a long-prompt benchmark into a short one."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.num_special = len(tokenizer("a").input_ids) - len(tokenizer("a", add_special_tokens=False).input_ids)
        self.words = [w for w in _WORDS if self._one_token(w) and self._one_token(" " + w)]
        if len(self.words) < 16:
            raise ValueError("the tokenizer splits too many common English words to build prompts from them")

    def _one_token(self, text: str) -> bool:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids) == 1

    def make(self, num_tokens: int) -> str:
        num_words = num_tokens - self.num_special
        if num_words < 1:
            raise ValueError(f"a prompt needs at least {self.num_special + 1} tokens, got {num_tokens}")
        text = " ".join(self.rng.choice(self.words) for _ in range(num_words))
        if len(self.tokenizer(text).input_ids) != num_tokens:
            raise ValueError(f"prompt of {num_tokens} tokens tokenized to another length")
        return text


@dataclass(slots=True)
class Workload:
    """What to send: a prompt text and max_tokens per request, cycled through."""

    prompts: list[tuple[str, int, int]]  # (text, prompt tokens, max_tokens)

    @classmethod
    def fixed(cls, factory: PromptFactory, num: int, prompt_tokens: int, output_tokens: int) -> "Workload":
        return cls([(factory.make(prompt_tokens), prompt_tokens, output_tokens) for _ in range(num)])

    @classmethod
    def chat(cls, factory: PromptFactory, num: int, seed: int = 0, max_prompt: int = 4000,
             max_output: int = 1000) -> "Workload":
        return cls([(factory.make(max(p, factory.num_special + 1)), max(p, factory.num_special + 1), o)
                    for p, o in chat_lengths(num, seed, max_prompt, max_output)])

    def __getitem__(self, i: int) -> tuple[str, int, int]:
        return self.prompts[i % len(self.prompts)]
