"""What an outbox insert read from the log becomes: the record the engine publishes, from the
column values of a pgoutput Insert message (their text forms) and where the outbox's columns are in
its Relation message. Called once per record at full speed, so it decodes only the columns up to
the last one it reads."""

from __future__ import annotations

from datetime import UTC, datetime

from harvester.core.protocols import StoreError
from harvester.core.records import MarkedRecord
from harvester.postgres import logical, pgoutput, rows


class Columns:
    """Where the outbox's columns are in a Relation message's tuple."""

    def __init__(self, relation: pgoutput.Relation) -> None:
        index = {name: i for i, name in enumerate(relation.columns)}
        try:
            self.id, self.time, self.topic, self.key, self.value, self.hkeys, self.hvalues = (
                index[c] for c in logical.PUBLISHED
            )
        except KeyError as exc:
            raise StoreError(f"the published outbox has no column {exc.args[0]}") from None
        self.needed = 1 + max(self.id, self.time, self.topic, self.key, self.value, self.hkeys, self.hvalues)
        # The last create_time parsed, as text and as parsed: the rows of one transaction usually
        # share it (DEFAULT now()). Only the mark thread decodes, so no lock.
        self.last_time: tuple[bytes, datetime] = (b"", datetime.now(UTC))


def outbox_record(data: bytes, c: Columns, kind: str) -> MarkedRecord:
    """The record of an Insert message, before the identity headers."""
    values = pgoutput.insert_values(data, c.needed)
    raw = values[c.value]
    # A textual value's text form is the bytes Kafka carries; bytea's is hex (\x...).
    value = bytes.fromhex(raw[2:].decode()) if raw is not None and kind == "bytes" else raw
    raw_keys, raw_values = values[c.hkeys], values[c.hvalues]
    headers: list[tuple[str, str | bytes | None]] = []
    why = None
    if raw_keys != b"{}" or raw_values != b"{}":
        hkeys = pgoutput.text_array(None if raw_keys is None else raw_keys.decode())
        hvalues = pgoutput.text_array(None if raw_values is None else raw_values.decode())
        why = rows.malformed("", hkeys, hvalues)
        headers = [
            (k or "", v.encode() if v is not None else b"") for k, v in zip(hkeys or (), hvalues or (), strict=False)
        ]
    key = values[c.key]
    if key is None:
        why = rows.malformed(None, [], [])
    created, (last, when) = values[c.time], c.last_time
    if not created:
        when = datetime.now(UTC)
    elif created != last:
        when = datetime.fromisoformat(created.decode())
        c.last_time = (created, when)
    return MarkedRecord(
        int(values[c.id] or 0),
        when,
        (values[c.topic] or b"").decode(),
        key.decode() if key is not None else "",
        value,
        headers,
        malformed=why,
    )
