"""Rules for caller text that every service applies the same way (gateway and tokenizer)."""
from __future__ import annotations

from tokenserve.runtime.errors import InvalidArgument


def check_no_nul(text: str, field: str) -> None:
    """NUL is refused in any caller text: C-string APIs down the line (tokenizer libraries,
    log viewers, some databases) would cut the text there."""
    nul = text.find("\x00")
    if nul >= 0:
        raise InvalidArgument(f"{field} contains a NUL character at offset {nul}; remove it")
