"""Incremental stop-string matching: one KMP automaton per stop string, fed only the new text.

Each step costs O(new characters x stop strings) whatever the output length, on the engine thread (finding
a stop) and in the server (holding back text that could still become one).
"""

from __future__ import annotations


def _failure(s: str) -> list[int]:
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Tracks, for every stop string, the longest prefix of it that the text fed so far ends with."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.fed = 0  # characters fed so far

    def feed(self, text: str) -> list[tuple[int, str]]:
        """Feed new characters; returns ``(start, stop)`` of each stop string completed inside them (the first
        completion per stop string), start offsets counted from the first character ever fed."""
        found = []
        for j, s in enumerate(self.stops):
            k, fail, hit = self._state[j], self._fail[j], None
            for i, ch in enumerate(text):
                while k and ch != s[k]:
                    k = fail[k - 1]
                if ch == s[k]:
                    k += 1
                if k == len(s):
                    if hit is None:
                        hit = self.fed + i + 1 - len(s)
                    k = fail[k - 1]
            self._state[j] = k
            if hit is not None:
                found.append((hit, s))
        self.fed += len(text)
        return found

    @property
    def hold(self) -> int:
        """Characters at the end of the text that are a proper prefix of some stop string."""
        return max(self._state, default=0)
