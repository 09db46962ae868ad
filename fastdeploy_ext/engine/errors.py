"""Engine exceptions, importable without Paddle."""


class RankFailure(RuntimeError):
    """A tensor-parallel rank process died or failed; the engine cannot continue."""
