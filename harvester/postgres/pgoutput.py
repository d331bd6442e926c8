"""The messages of PostgreSQL's built-in logical decoding plugin ``pgoutput`` (protocol version 1)
that the log source needs: Begin, Relation, Insert and Commit, and the parts of a logical decoding
message (:func:`logical_message`). Every other message (Update, Delete, Truncate, Origin, Type, and
logical messages too) parses to None.

Column values arrive in their text form, as UTF-8 bytes (``None`` for SQL NULL); :func:`text_array`
reads the text form of a one-dimensional array. Reference: PostgreSQL's "Logical Replication Message Formats".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_BEGIN = struct.Struct("!QqI")  # final LSN, commit time, xid
_COMMIT = struct.Struct("!bQQq")  # flags, commit LSN, end LSN, commit time
_U16 = struct.Struct("!H")
_U64 = struct.Struct("!Q")
_I32 = struct.Struct("!i")
_RELATION_HEAD = struct.Struct("!I")


class ProtocolError(ValueError):
    """A message does not follow the pgoutput format."""


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int  # the LSN of the transaction's commit record
    xid: int
    commit_time: int = 0  # microseconds since 2000-01-01 UTC


@dataclass(frozen=True, slots=True)
class Commit:
    commit_lsn: int
    end_lsn: int  # a slot advanced to here has consumed the transaction


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    schema: str
    name: str
    columns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Insert:
    relation: int
    values: list[bytes | None]  # text form (UTF-8), None for NULL, in the Relation's column order


Message = Begin | Commit | Relation | Insert


def _cstring(data: bytes, at: int) -> tuple[str, int]:
    end = data.index(b"\0", at)
    return data[at:end].decode("utf-8"), end + 1


def _tuple(data: bytes, at: int, columns: int = 0xFFFF) -> list[bytes | None]:
    (count,) = _U16.unpack_from(data, at)
    at += 2
    values: list[bytes | None] = []
    for _ in range(min(count, columns)):
        kind = data[at]
        at += 1
        if kind == 0x74:  # 't': text
            (size,) = _I32.unpack_from(data, at)
            at += 4
            values.append(data[at : at + size])
            at += size
        elif kind == 0x6E:  # 'n': NULL
            values.append(None)
        else:  # 'u' (an unchanged TOAST value) never occurs in an insert; 'b' only when asked for binary
            raise ProtocolError(f"unexpected column kind {chr(kind)!r} in an insert")
    return values


def insert_values(data: bytes, columns: int = 0xFFFF) -> list[bytes | None]:
    """The new tuple of an Insert message (``data[:1] == b"I"``), or its first ``columns`` values."""
    if data[5] != 0x4E:  # 'N'
        raise ProtocolError("an insert without its new tuple")
    return _tuple(data, 6, columns)


def parse(data: bytes) -> Message | None:
    """One pgoutput message, or None for a kind the log source ignores."""
    kind = data[:1]
    if kind == b"I":
        (relation,) = _RELATION_HEAD.unpack_from(data, 1)
        return Insert(relation, insert_values(data))
    if kind == b"B":
        final_lsn, commit_time, xid = _BEGIN.unpack_from(data, 1)
        return Begin(final_lsn, xid, commit_time)
    if kind == b"C":
        _, commit_lsn, end_lsn, _ = _COMMIT.unpack_from(data, 1)
        return Commit(commit_lsn, end_lsn)
    if kind == b"R":
        (oid,) = _RELATION_HEAD.unpack_from(data, 1)
        schema, at = _cstring(data, 5)
        name, at = _cstring(data, at)
        at += 1  # replica identity setting
        (count,) = _U16.unpack_from(data, at)
        at += 2
        columns: list[str] = []
        for _ in range(count):
            column, at = _cstring(data, at + 1)  # after the flags byte
            columns.append(column)
            at += 8  # type oid and modifier
        return Relation(oid, schema, name, tuple(columns))
    return None


def logical_message(data: bytes, prefix_size: int) -> tuple[int, bytes]:
    """(LSN, content) of a logical decoding message (``data[:1] == b"M"``; protocol 1: flags, LSN,
    prefix, content length, content) whose prefix is ``prefix_size`` bytes long."""
    (lsn,) = _U64.unpack_from(data, 2)
    at = 10 + prefix_size + 1
    (size,) = _I32.unpack_from(data, at)
    return lsn, data[at + 4 : at + 4 + size]


def text_array(text: str | None) -> list[str | None] | None:
    """The elements of a one-dimensional array's text form (``{a,"b c",NULL}``); None for NULL."""
    if text is None:
        return None
    if text == "{}":
        return []
    if not (text.startswith("{") and text.endswith("}")):
        raise ProtocolError(f"not an array literal: {text[:40]!r}")
    out: list[str | None] = []
    body, i, n = text[1:-1], 0, len(text) - 2
    if n == 0:
        return out
    while i <= n:
        if i < n and body[i] == '"':
            i += 1
            chars: list[str] = []
            while body[i] != '"':
                if body[i] == "\\":
                    i += 1
                chars.append(body[i])
                i += 1
            out.append("".join(chars))
            i += 2  # the closing quote and the comma
        else:
            end = body.find(",", i)
            end = n if end < 0 else end
            element = body[i:end]
            out.append(None if element == "NULL" else element)
            i = end + 1
    return out


def lsn_text(lsn: int) -> str:
    """An LSN as PostgreSQL writes it (``16/B374D848``)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_value(text: str) -> int:
    """An LSN from PostgreSQL's text form."""
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)
