"""What every contract has in common, and the two checks the store runs on every table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa


class SchemaError(ValueError):
    """A table does not match its contract; the message names the file, column and types."""


@dataclass(frozen=True)
class Contract:
    kind: str
    version: int
    schema: pa.Schema


def validate_table(contract: Contract, table: pa.Table, where: str) -> pa.Table:
    """Check ``table`` against the contract: every column present with the declared type.

    Extra columns are an error too: a writer that adds one must bump the contract."""
    expected = contract.schema
    for field in expected:
        idx = table.schema.get_field_index(field.name)
        if idx < 0:
            raise SchemaError(
                f"schema mismatch in {where}: missing column {field.name!r} "
                f"(expected {field.type}, {contract.kind} v{contract.version})"
            )
        got = table.schema.field(idx).type
        if not got.equals(field.type):
            raise SchemaError(
                f"schema mismatch in {where}: column {field.name!r} has type {got}, "
                f"expected {field.type} ({contract.kind} v{contract.version})"
            )
    extra = [n for n in table.schema.names if expected.get_field_index(n) < 0]
    if extra:
        raise SchemaError(
            f"schema mismatch in {where}: unexpected column {extra[0]!r} "
            f"({contract.kind} v{contract.version})"
        )
    return table.select(expected.names)


def table_from_rows(
    contract: Contract, rows: list[dict[str, Any]], where: str = "rows"
) -> pa.Table:
    """Build a table with the contract's schema from row dicts, with a one-line error."""
    names = set(contract.schema.names)
    for i, row in enumerate(rows):
        missing = names - row.keys()
        if missing:
            raise SchemaError(
                f"schema mismatch in {where}: row {i} lacks column {sorted(missing)[0]!r}"
            )
        extra = row.keys() - names
        if extra:
            raise SchemaError(
                f"schema mismatch in {where}: row {i} has unexpected column {sorted(extra)[0]!r}"
            )
    try:
        return pa.Table.from_pylist(rows, schema=contract.schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as err:
        msg = str(err).splitlines()[0]
        raise SchemaError(
            f"schema mismatch in {where}: {msg} ({contract.kind} v{contract.version})"
        ) from None
