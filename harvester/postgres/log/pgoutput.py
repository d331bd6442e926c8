"""The messages of PostgreSQL's built-in logical decoding plugin ``pgoutput`` that the log source
needs (as protocol version 1 sends them; the stream asks for version 2, whose streamed transactions
:mod:`.streamed` puts back into that form): Begin, Relation and Commit, an Insert's new tuple
(:func:`tuple_values`), and the parts of a logical decoding message (:func:`logical_message`).
Every other message (Insert too: the log source recognizes its outbox's inserts before parsing,
:mod:`.transactions`) parses to None.

The stream asks for column values in their binary form (``binary 'true'``, PostgreSQL 14+): each
type's send format, which :mod:`.records` reads. Reference: PostgreSQL's "Logical Replication
Message Formats".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_BEGIN = struct.Struct("!QqI")  # final LSN, commit time, xid
_COMMIT = struct.Struct("!bQQq")  # flags, commit LSN, end LSN, commit time
_U16 = struct.Struct("!H")
_U64 = struct.Struct("!Q")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")


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
    types: tuple[int, ...]  # the columns' type oids


Message = Begin | Commit | Relation


def _cstring(data: bytes, at: int) -> tuple[str, int]:
    end = data.index(b"\0", at)
    return data[at:end].decode("utf-8"), end + 1


def tuple_values(data: bytes, at: int, columns: int) -> list[bytes | None]:
    """The first ``columns`` values of the tuple whose values start at ``at`` (after its column
    count), each in its binary form, None for NULL."""
    values: list[bytes | None] = []
    for _ in range(columns):
        kind = data[at]
        if kind == 0x62:  # 'b': binary
            (size,) = _I32.unpack_from(data, at + 1)
            at += 5 + size
            values.append(data[at - size : at])
        elif kind == 0x6E:  # 'n': NULL
            values.append(None)
            at += 1
        else:  # 'u' (an unchanged TOAST value) never occurs in an insert; 't' only when not asked for binary
            raise ProtocolError(f"unexpected column kind {chr(kind)!r} in an insert")
    return values


def begin_message(final_lsn: int, commit_time: int, xid: int) -> bytes:
    """A Begin message, as the walsender sends it (what :func:`parse` reads)."""
    return b"B" + _BEGIN.pack(final_lsn, commit_time, xid)


def commit_message(flags: int, commit_lsn: int, end_lsn: int, commit_time: int) -> bytes:
    """A Commit message, as the walsender sends it (what :func:`parse` reads)."""
    return b"C" + _COMMIT.pack(flags, commit_lsn, end_lsn, commit_time)


def parse(data: bytes) -> Message | None:
    """One pgoutput message, or None for a kind the log source ignores."""
    kind = data[:1]
    if kind == b"B":
        final_lsn, commit_time, xid = _BEGIN.unpack_from(data, 1)
        return Begin(final_lsn, xid, commit_time)
    if kind == b"C":
        _, commit_lsn, end_lsn, _ = _COMMIT.unpack_from(data, 1)
        return Commit(commit_lsn, end_lsn)
    if kind == b"R":
        (oid,) = _U32.unpack_from(data, 1)
        schema, at = _cstring(data, 5)
        name, at = _cstring(data, at)
        at += 1  # replica identity setting
        (count,) = _U16.unpack_from(data, at)
        at += 2
        columns: list[str] = []
        types: list[int] = []
        for _ in range(count):
            column, at = _cstring(data, at + 1)  # after the flags byte
            columns.append(column)
            types.append(_U32.unpack_from(data, at)[0])
            at += 8  # type oid and modifier
        return Relation(oid, schema, name, tuple(columns), tuple(types))
    return None


def logical_message(data: bytes, prefix_size: int) -> tuple[int, bytes]:
    """(LSN, content) of a logical decoding message (``data[:1] == b"M"``; protocol 1: flags, LSN,
    prefix, content length, content) whose prefix is ``prefix_size`` bytes long."""
    (lsn,) = _U64.unpack_from(data, 2)
    at = 10 + prefix_size + 1
    (size,) = _I32.unpack_from(data, at)
    return lsn, data[at + 4 : at + 4 + size]


def lsn_text(lsn: int) -> str:
    """An LSN as PostgreSQL writes it (``16/B374D848``)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_value(text: str) -> int:
    """An LSN from PostgreSQL's text form."""
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)
