"""Incremental stop matching equals a brute-force search over the whole text, fed in arbitrary pieces."""

import numpy as np

from fastdeploy_ext.engine.stop_strings import StopMatcher


def brute(text, stops, start):
    """(earliest start of a stop string ending at or after ``start``, hold of the text's end)."""
    hits = [(text.find(s, max(0, start - len(s) + 1)), s) for s in stops]
    hits = [h for h in hits if h[0] >= 0]
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return (min(hits) if hits else None), hold


def test_matches_brute_force_on_random_streams():
    rng = np.random.default_rng(0)
    for trial in range(300):
        stops = ["".join(rng.choice(list("abc"), rng.integers(1, 6))) for _ in range(rng.integers(1, 5))]
        text = "".join(rng.choice(list("abcd"), rng.integers(0, 60)))
        m, fed = StopMatcher(stops), 0
        while fed < len(text):
            step = int(rng.integers(1, 5))
            piece = text[fed:fed + step]
            found = m.feed(piece)
            want, hold = brute(text[:fed + len(piece)], stops, fed)
            assert (min(found) if found else None) == want, (stops, text, fed)
            fed += len(piece)
            if want is not None:
                break
            assert m.hold == hold, (stops, text[:fed])
