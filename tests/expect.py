"""The suite's check for a refusal: the call raises the given type with a message matching a pattern.
Rank functions return its record so that every rank's refusals can be compared."""

import re


def raises(fn, exc, match) -> str:
    try:
        fn()
    except exc as e:
        assert re.search(match, str(e)), f"{type(e).__name__}: {e!s} does not match {match!r}"
        return f"ok: {match}"
    raise AssertionError(f"no {exc.__name__} matching {match!r}")


__all__ = ["raises"]
