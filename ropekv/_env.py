"""The environment variables ropekv reads, and the one rule for its boolean ones.

Every ``ROPEKV_*`` switch is read by :func:`env_flag`: ``1``, ``true``, ``yes``, ``on`` turn it
on, ``0``, ``false``, ``no``, ``off`` and the empty string turn it off (any letter case, spaces
around ignored); unset means its default; anything else raises ValueError naming the variable and
what it accepts (a typo must not silently pick either side). ``docs/environment.md`` lists every
variable.

The per-call switches (``ROPEKV_CHECK_INDICES``, ``ROPEKV_ALLOW_LEGACY_DLPACK_WRITES``) are read
through :func:`fast_flag`, which looks the raw value up in a table of the usual spellings and only
falls back to :func:`env_flag` for another one.
"""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")

# Every variable ropekv reads (docs/environment.md describes each; a test checks both lists).
VARIABLES = (
    "ROPEKV_ALLOW_LEGACY_DLPACK_WRITES",
    "ROPEKV_CACHE_DIR",
    "ROPEKV_CHECK_INDICES",
    "ROPEKV_COMPILE_TIMEOUT",
    "ROPEKV_GIT_REVISION",
    "ROPEKV_NATIVE",
    "ROPEKV_NATIVE_CUPY",
    "ROPEKV_NATIVE_TORCH",
)


def parse_flag(name, value, default=False):
    """``value`` (a string or None: unset) of the variable ``name`` as a bool."""
    if value is None:
        return default
    text = value.strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ValueError(
        f"{name}={value!r} is not a boolean: use one of {', '.join(TRUE)} (on) or "
        f"{', '.join(FALSE[:-1])} or the empty string (off)"
    )


def env_flag(name, default=False):
    """The boolean environment variable ``name`` (unset: ``default``); ValueError for a value
    that is neither a true nor a false spelling."""
    return parse_flag(name, os.environ.get(name), default)


def _spellings(words):
    return {v for w in words for v in (w, w.upper(), w.capitalize())}


# os.environ read without its per-call key encoding and value decoding (its raw table stays in
# step with os.environ, monkeypatch.setenv included)
_environ_data = getattr(os.environ, "_data", None)
if isinstance(_environ_data, dict) and isinstance(next(iter(_environ_data), b""), bytes):
    _raw_get = _environ_data.get

    def _key(name):
        return os.fsencode(name)

    _KNOWN = {os.fsencode(w): True for w in _spellings(TRUE)}
    _KNOWN.update({os.fsencode(w): False for w in _spellings(FALSE)})
else:  # another platform's os.environ
    _raw_get = os.environ.get

    def _key(name):
        return name

    _KNOWN = {w: True for w in _spellings(TRUE)}
    _KNOWN.update({w: False for w in _spellings(FALSE)})


# ROPEKV_CHECK_INDICES as _launch's replay reads it on every call: the raw value (``_raw_get``) of
# ``CHECK_INDICES_KEY``, ``EMPTY_KEY`` when unset; the check is skipped when it is one of the off
# spellings (``OFF``), and any other value goes through ``_checks.check_indices_enabled`` (on, or
# a ValueError)
CHECK_INDICES_KEY, EMPTY_KEY = _key("ROPEKV_CHECK_INDICES"), _key("")
OFF = frozenset(k for k, v in _KNOWN.items() if not v)


def fast_flag(name, default=False):
    """A function of no arguments giving :func:`env_flag` ``(name, default)`` at each call, at
    the cost of two dict lookups for the usual spellings (for flags read on every call)."""
    key, known_get, raw_get = _key(name), _KNOWN.get, _raw_get
    unset = object()

    def flag():
        raw = raw_get(key, unset)
        if raw is unset:
            return default
        value = known_get(raw)
        return env_flag(name, default) if value is None else value

    flag.__doc__ = f"``{name}`` as a bool (default {default})."
    return flag
