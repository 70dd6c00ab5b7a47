"""Benchmarks: decoding modes side by side, the propose-time context sweep, and
round-vs-step timing at the shapes of real target/drafter pairs."""


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is 0 or None (a figure that was not measured: no
    decoding round ran)."""
    return a / b if a and b else None


def fmt(value: float | None, spec: str) -> str:
    """A figure formatted by ``spec``, or "-" where it was not measured (None)."""
    return "-" if value is None else format(value, spec)


def pyplot():
    """matplotlib's ``pyplot`` on its Agg backend (files only, no display). matplotlib's
    warning that its config and cache directory cannot be written (a read-only home: it
    uses a temporary one, and its font cache is rebuilt each run) is not shown: the plots
    come out the same, and it was a multi-line warning in bench's one-line output."""
    import logging

    quiet = logging.getLogger("matplotlib")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    finally:
        quiet.setLevel(level)
    return plt
