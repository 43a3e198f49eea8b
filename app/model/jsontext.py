"""JSON text from an encoder made once.

`json.dumps`, and `JSONEncoder.encode` on an encoder made once, build a new C encoder on every call
(its options, and a closure that writes floats) before they write a byte: on this machine's
Python 3.11 that is about as much as writing the small lists and objects a request needs (its
canonical JSON body, the head of the request kept behind its key, its stored headers). `writer`
builds the C encoder once and reuses it; the text is the same, byte for byte.

Design rule: no check for a value that contains itself. Everything written here is built by the
gateway or decoded from JSON text, neither of which can refer to itself; such a value would end
in RecursionError, not ValueError.
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable
from typing import Any

# CPython's C encoder (None where `_json` is missing: the pure-Python encoder is used instead).
_MAKE_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)


def _unsupported(value: object) -> object:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def writer(
    *,
    sort_keys: bool = False,
    separators: tuple[str, str] = (", ", ": "),
    ensure_ascii: bool = True,
    allow_nan: bool = True,
    default: Callable[[Any], object] | None = None,
) -> Callable[[object], str]:
    """What `json.JSONEncoder(<the same options>).encode(value)` returns, for a value that is a
    list, a dict or a scalar; TypeError for a value it cannot write, as that encoder."""
    item_separator, key_separator = separators
    if _MAKE_ENCODER is None:
        return json.JSONEncoder(
            sort_keys=sort_keys,
            separators=separators,
            ensure_ascii=ensure_ascii,
            allow_nan=allow_nan,
            default=default,
        ).encode
    encode_string = (
        json.encoder.encode_basestring_ascii if ensure_ascii else json.encoder.encode_basestring
    )
    encoder = _MAKE_ENCODER(
        None,  # markers: no check for a value that contains itself (the module's rule)
        default if default is not None else _unsupported,
        encode_string,
        None,  # indent
        key_separator,
        item_separator,
        sort_keys,
        False,  # skipkeys
        allow_nan,
    )

    def write(value: object) -> str:
        return "".join(encoder(value, 0))

    return write
