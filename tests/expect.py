"""The suite's checks for a refusal: the call raises the given type with a message matching a pattern.
Rank functions return their verdicts so that every rank's refusals can be compared."""

import re


def refusal(fn, exc, match) -> str:
    """"ok", or what happened instead (another exception type propagates)."""
    try:
        fn()
    except exc as e:
        return "ok" if re.search(match, str(e)) else f"{type(e).__name__}: {e!s} does not match {match!r}"
    return f"no {exc.__name__} matching {match!r}"


def raises(fn, exc, match) -> str:
    verdict = refusal(fn, exc, match)
    assert verdict == "ok", verdict
    return f"ok: {match}"


__all__ = ["raises", "refusal"]
