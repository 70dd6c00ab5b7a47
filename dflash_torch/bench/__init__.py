"""Benchmarks: decoding modes side by side, the propose-time context sweep, and
round-vs-step timing at the shapes of real target/drafter pairs."""


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is 0 or None (a figure that was not measured: no
    decoding round ran)."""
    return a / b if a and b else None


def fmt(value: float | None, spec: str) -> str:
    """A figure formatted by ``spec``, or "-" where it was not measured (None)."""
    return "-" if value is None else format(value, spec)
