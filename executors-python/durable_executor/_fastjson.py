"""JSON through the interpreter's own C accelerator, without importing ``json``.

``import json`` costs ~6 ms on a one-shot job's path: ``json.decoder`` and
``json.encoder`` import ``re`` (and ``re`` imports ``enum``, ``functools`` and
``collections``) for their pure-Python fallbacks. ``json.loads`` and
``json.dumps`` themselves call the C scanner and encoder of ``_json`` in the
forms used here, so this module calls them directly and returns exactly what
``json`` would. Anything off the plain path (a decode or encode error, a byte
order mark, UTF-16/32 input, an interpreter without ``_json`` or of a version
this was not checked against) goes to ``json`` itself, so errors and their
messages are ``json``'s own.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

try:
    import _json

    _C_SCANNER: Any = _json.make_scanner
    _C_ENCODER: Any = _json.make_encoder
    _C_STR: Any = _json.encode_basestring
    _C_STR_ASCII: Any = _json.encode_basestring_ascii
    # the encoder's arguments as json.encoder passes them (3.11 to 3.13)
    _OK = (3, 11) <= sys.version_info[:2] <= (3, 13)
except (ImportError, AttributeError):  # pragma: no cover - CPython always has them
    _OK = False

_WS = " \t\n\r"


class _Context:
    """The decoder settings ``json.loads`` uses by default, as the C scanner reads them."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> float:
        return {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}[name]


def _no_number(_text: str) -> None:
    return None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class _CheckContext:
    """Settings of a scan that only checks: numbers are not converted (an integer longer
    than ``sys.get_int_max_str_digits()`` is valid JSON, which ``int()`` refuses), and
    ``NaN``/``Infinity``, which ``json`` accepts, are not JSON."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = staticmethod(_no_number)
    parse_int = staticmethod(_no_number)
    parse_constant = staticmethod(_no_constant)


_scanner: Callable[[str, int], tuple[Any, int]] | None = None
_checker: Callable[[str, int], tuple[Any, int]] | None = None


def check(data: bytes | bytearray | str) -> None:
    """Raise ``ValueError`` unless ``data`` is one JSON value (RFC 8259: no ``NaN``, any
    number of digits), ``RecursionError`` when it nests deeper than the interpreter parses.
    """
    global _checker
    if _OK:
        if _checker is None:
            _checker = _C_SCANNER(_CheckContext())
        if _scan(data, _checker) is not None:
            return
    import json

    json.loads(data, parse_int=_no_number, parse_float=_no_number, parse_constant=_no_constant)


def _scan(data: bytes | bytearray | str, scanner: Callable[[str, int], tuple[Any, int]]) -> Any:
    """The value the C scanner reads from the whole of ``data``, boxed in a 1-tuple; ``None``
    where ``json`` must say what it makes of it (an error, a BOM, UTF-16/32). A recursion
    error is raised as it is."""
    text: str | None
    if isinstance(data, str):
        text = data
    else:
        raw = bytes(data)
        # json.loads decodes UTF-8 with surrogatepass unless a BOM or a NUL in
        # the first bytes says otherwise (json.detect_encoding)
        if raw[:3] == b"\xef\xbb\xbf" or b"\x00" in raw[:4]:
            return None
        try:
            text = raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None
    body = text.strip(_WS)
    if not body or body.startswith("\ufeff"):
        return None
    try:
        value, end = scanner(body, 0)
    except RecursionError:
        raise
    except Exception:  # json below says what is wrong
        return None
    return (value,) if end == len(body) else None


def loads(data: bytes | bytearray | str) -> Any:
    """``json.loads(data)``: the same value, or ``json``'s own error."""
    global _scanner
    if _OK:
        if _scanner is None:
            _scanner = _C_SCANNER(_Context())
        found = _scan(data, _scanner)
        if found is not None:
            return found[0]
    import json

    return json.loads(data)


def _default(o: object) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def dumps(
    value: object,
    *,
    ensure_ascii: bool = True,
    allow_nan: bool = True,
    separators: tuple[str, str] | None = None,
) -> str:
    """``json.dumps(value, ensure_ascii=..., allow_nan=..., separators=...)``."""
    if _OK:
        item_sep, key_sep = separators if separators is not None else (", ", ": ")
        encode_str = _C_STR_ASCII if ensure_ascii else _C_STR
        try:
            if isinstance(value, str):
                return str(encode_str(value))
            encoder = _C_ENCODER(
                {}, _default, encode_str, None, key_sep, item_sep, False, False, allow_nan
            )
            return "".join(encoder(value, 0))
        except Exception:  # json below raises its own error
            pass
    import json

    return json.dumps(value, ensure_ascii=ensure_ascii, allow_nan=allow_nan, separators=separators)
