"""Answers of several choices: one generation of the ensemble per choice, submitted together, and
their answers joined in choice order (whole) or interleaved as they come, each chunk with its
choice's index (streamed)."""

from __future__ import annotations

import asyncio

from tritone_client.client import Chunk

from tritone.openai.backend import Generation
from tritone.openai.errors import RequestError, error_body
from tritone.openai.formats import ResponseFormat, sse


def total(chunks: list[Chunk], num_seqs: int = 1) -> Chunk:
    """The usage of all sequences: every generated token, and each prompt's once (as OpenAI and
    vLLM count n choices of one prompt), `num_seqs` sequences per prompt."""
    return Chunk("", sum(c.num_input_tokens for c in chunks[::num_seqs]), sum(c.num_output_tokens for c in chunks),
                 0.0, [], "")


def best(answers: list[Chunk], num_seqs: int, n: int) -> list[Chunk]:
    """Of each prompt's `num_seqs` sequences (best_of), the `n` of highest cumulative
    log-probability, best first, as vLLM ranks them; all of them, in order, where n == num_seqs."""
    if n == num_seqs:
        return answers
    kept = []
    for start in range(0, len(answers), num_seqs):
        group = answers[start:start + num_seqs]
        kept += sorted(group, key=lambda a: a.cum_log_prob, reverse=True)[:n]
    return kept


async def wholes(generations: list[Generation]) -> list[Chunk]:
    try:
        return list(await asyncio.gather(*(g.whole() for g in generations)))
    finally:
        for g in generations:
            g.close()


async def firsts(generations: list[Generation]) -> list[Chunk]:
    """Each generation's first response: an error before any token is the whole answer's error."""
    try:
        return list(await asyncio.gather(*(g.__anext__() for g in generations)))
    except BaseException:
        for g in generations:
            g.close()
        raise


async def events(fmt: ResponseFormat, firsts_: list[Chunk], generations: list[Generation], include_usage: bool,
                 continuous_usage: bool, num_seqs: int = 1):
    """The stream of several choices: chunks in the order they come, each with its index."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation):
        try:
            async for chunk in generation:
                await queue.put((index, chunk, None))
        except Exception as exc:
            await queue.put((index, None, exc))
        await queue.put((index, None, None))

    pending = [(i, c, None) for i, c in enumerate(firsts_)]
    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations) if not firsts_[i].finish_reason]
    remaining, last = len(tasks), dict(enumerate(firsts_))
    try:
        for index in range(len(generations)):
            yield sse(fmt.start(include_usage, index))
        while pending or remaining:
            index, chunk, exc = pending.pop(0) if pending else await queue.get()
            if exc is not None:
                raise exc
            if chunk is None:
                remaining -= 1
                continue
            last[index] = chunk
            if chunk.text or chunk.top_log_probs or chunk.finish_reason:
                yield sse(fmt.delta(chunk, include_usage, continuous_usage, index=index))
        if include_usage:
            yield sse(fmt.usage(total(list(last.values()), num_seqs)))
    except RequestError as exc:  # after the first responses: reported in the stream
        yield sse(error_body(exc.message, exc.type, exc.param))
    finally:
        for task in tasks:
            task.cancel()
        for g in generations:
            g.close()
    yield sse("[DONE]")
