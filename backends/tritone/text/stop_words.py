"""Stop words matched on text in the llm model, where the engine must know which id ended the
answer and how much of the last chunk's text to drop."""

from __future__ import annotations

import bisect

from tritone.text.detokenizer import Detokenizer


class StopMatcher:
    """Finds stop words in the text of a growing id sequence, decoding it one id at a time.

    `ends[i]` is the length of the final text once ids[:i + 1] are decoded, which maps a place in
    the text back to the id that brought it. Ids whose text could still begin a stop word are
    held back (`num_safe_ids`), so a streamed prefix of a stop word is never shown.
    """

    def __init__(self, detokenizer: Detokenizer, words: list[str], skip_special_tokens: bool,
                 prefix_ids: list[int] = ()):
        self.detokenizer, self.words, self.skip = detokenizer, list(words), skip_special_tokens
        # Ids sent before the generated ones (an echoed prompt) are decoded but never searched.
        self.text = detokenizer.final_text(list(prefix_ids), skip_special_tokens) if prefix_ids else ""
        self.ends = [len(self.text)] * len(prefix_ids)
        self.search_start = len(self.text)
        self.longest = max(len(w) for w in self.words)

    def feed(self, ids: list[int], is_final: bool) -> int | None:
        """Decodes the ids not seen yet (all of the text when `is_final`); returns where the first
        stop word starts in the text, or None."""
        searched = len(self.text)
        for i in range(len(self.ends), len(ids)):
            context = self.detokenizer.context(ids, i, self.skip)
            self.text += self.detokenizer.delta(context, [ids[i]], False, self.skip)
            self.ends.append(len(self.text))
        if is_final and ids:
            # What final_text held back belongs to the last id.
            context = self.detokenizer.context(ids, len(ids), self.skip)
            self.text += self.detokenizer.delta(context, [], True, self.skip)
            self.ends[-1] = len(self.text)
        start = max(self.search_start, searched - self.longest + 1)
        found = [i for i in (self.text.find(w, start) for w in self.words) if i >= 0]
        return min(found) if found else None

    def num_safe_ids(self) -> int:
        """How many ids can be sent: those whose text ends before any start of a stop word."""
        hold = len(self.text)
        for word in self.words:
            for k in range(min(len(word) - 1, len(self.text) - self.search_start), 0, -1):
                if self.text.endswith(word[:k]):
                    hold = min(hold, len(self.text) - k)
                    break
        return bisect.bisect_right(self.ends, hold)

    def cut(self, ids: list[int], stop_start: int, num_sent: int) -> tuple[int, int]:
        """For a stop word at `stop_start`: how many ids to send in all (up to the one where the
        stop word starts), and how many characters to drop from the end of the last chunk's text
        (sent after `num_sent` ids) so that it ends right before the stop word."""
        end = bisect.bisect_right(self.ends, stop_start) + 1
        context = self.detokenizer.context(ids, num_sent, self.skip)
        text = self.detokenizer.delta(context, ids[num_sent:end], True, self.skip)
        shown = self.ends[num_sent - 1] if num_sent else 0
        return end, max(0, shown + len(text) - stop_start)
