"""Stop strings on a text stream whose pieces can split a stop string anywhere."""

from __future__ import annotations


class StopMatcher:
    """Cuts a streamed text at the first stop string.

    The stream stops where a stop string first completes (the smallest end position; among stop strings
    completing there, the one starting first). Everything before it is emitted, the stop string and
    everything after it are not. Text that could still be the start of a stop string is held back until
    decided, so the result does not depend on how the text was split into pieces.
    """

    def __init__(self, stop_strings: list[str]):
        if any(not stop for stop in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop_strings))
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a piece: (text now safe to emit, whether a stop string has completed). After a stop every
        further call returns ("", True)."""
        if self.stopped:
            return "", True
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            cut, self.matched = match
            self._held = ""
            self.stopped = True
            return buffer[:cut], True
        keep = self._undecided_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """End of the stream: the held-back text, which turned out not to be a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string that completes first in `buffer`, or None."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _undecided_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
