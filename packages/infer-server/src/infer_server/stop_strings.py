"""Stop strings matched across token boundaries.

Text arrives in deltas. Any tail of the pending text that could still grow into a stop string is held
back; text before a match is emitted and the stop string itself is not, unless `include_stop` (vLLM's
`include_stop_str_in_output`) asks for it. Because every possible start
of a match is held, a match can only begin inside the small pending buffer, so each push is cheap.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    __slots__ = ("_stops", "_buf", "_done", "_include_stop")

    def __init__(self, stops: Iterable[str], include_stop: bool = False) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._buf = ""
        self._done = False
        self._include_stop = include_stop

    @property
    def active(self) -> bool:
        return bool(self._stops)

    @property
    def held(self) -> str:
        return self._buf

    def push(self, text: str) -> tuple[str, bool]:
        """Feed a delta; return (text safe to emit, whether a stop string was hit)."""
        if self._done:
            return "", True
        if not self._stops:
            return text, False
        buf = self._buf + text
        if not buf:
            return "", False
        hit, end = -1, -1
        for stop in self._stops:
            idx = buf.find(stop)
            if idx != -1 and (hit == -1 or idx < hit or (idx == hit and idx + len(stop) > end)):
                hit, end = idx, idx + len(stop)
        if hit != -1:
            self._buf = ""
            self._done = True
            return buf[:end if self._include_stop else hit], True
        hold = self._partial_suffix(buf)
        cut = len(buf) - hold
        self._buf = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """Generation ended without a hit: release what was held back."""
        out, self._buf = self._buf, ""
        return "" if self._done else out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string. Only the places where
        a stop's first character occurs are tried, earliest (= longest tail) first: linear in the stop's length
        for ordinary text, where trying every tail length was quadratic per token."""
        best, n = 0, len(buf)
        for stop in self._stops:
            i = buf.find(stop[0], max(n - len(stop) + 1, 0))
            while i != -1 and n - i > best:
                if stop.startswith(buf[i:]):
                    best = n - i
                    break
                i = buf.find(stop[0], i + 1)
        return best
