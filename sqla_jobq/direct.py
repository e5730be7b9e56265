"""A statement run on libpq directly, below psycopg's cursors (internal).

An idle worker's claim (see `pickup`) is the one statement whose client-side
cost is paid while a job waits to start. Through `Connection.execute`, which
makes a cursor, converts the query's `%(name)s` placeholders, keeps the
prepared-statement bookkeeping and builds rows through a row maker, it took
1.37 ms against 1.19 ms here, measured cold (one claim every 15 ms, as an
idle worker claims). So the claim's parameters are dumped ahead of time, by
the loop when it arms the pickup (`Numbered.bind`); the statement is
prepared once per connection and parameter types; and the rows are loaded
by psycopg's own `Transformer` with the connection's loaders, so they hold
the same values the worker's other claims return.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq
from psycopg.abc import Buffer
from psycopg.adapt import PyFormat, Transformer
from psycopg.errors import error_from_result
from psycopg.types.json import set_json_loads
from sqlalchemy import ClauseElement
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg
from sqlalchemy.sql.compiler import SQLCompiler

from .db import connect_kwargs, conninfo
from .driver import Row, raw_json

log = logging.getLogger("sqla_jobq.worker")

# `$1, $2, ...` placeholders, as libpq takes them.
_DIALECT = pg_psycopg.dialect(paramstyle="numeric_dollar")  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class Numbered:
    """A Core statement compiled once with numbered placeholders, and the
    names of its parameters in their order."""

    sql: bytes
    names: tuple[str, ...]
    defaults: Mapping[str, Any]

    @classmethod
    def of(cls, stmt: ClauseElement) -> Numbered:
        done = stmt.compile(dialect=_DIALECT)
        assert isinstance(done, SQLCompiler)  # a statement, not DDL
        return cls(done.string.encode(), tuple(done.positiontup or ()), dict(done.params))

    def bind(self, **values: Any) -> Bound:
        """The statement with these values dumped, ready to send (any thread)."""
        merged = {**self.defaults, **values}
        dumper = Transformer()
        values_in_order = [merged[name] for name in self.names]
        dumped = dumper.dump_sequence(values_in_order, [PyFormat.AUTO] * len(self.names))
        params = [value for value in dumped if value is not None]
        if len(params) < len(dumped):  # a claim has no optional parameter
            raise ValueError(f"NULL among the parameters of {self.names}")
        return Bound(self.sql, params, dumper.types or (), dumper.formats or [])


@dataclass(frozen=True)
class Bound:
    """A `Numbered` statement with its parameters dumped: what libpq sends."""

    sql: bytes
    params: Sequence[Buffer]
    types: tuple[int, ...]  # an int's type depends on its size: part of a prepared name's key
    formats: Sequence[pq.Format]


class DirectConnection:
    """One autocommit connection, used by one thread at a time, running bound
    statements. Any error closes it (a prepared statement may be what went
    wrong); the next call connects again."""

    def __init__(self, url: str, prepared: bool) -> None:
        self.url = conninfo(url)
        self.prepared = prepared  # False behind a pooler that does not keep them
        self._conn: psycopg.Connection[Any] | None = None
        self._names: dict[tuple[bytes, tuple[int, ...]], bytes] = {}

    def connect(self) -> None:
        """Connect now if not connected (apart from `run`, to time it alone)."""
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(self.url, **connect_kwargs(self.prepared))
            set_json_loads(raw_json, conn)
            self._conn = conn

    def run(self, bound: Bound) -> list[Row]:
        self.connect()
        conn = self._conn
        assert conn is not None
        try:
            result = self._execute(conn.pgconn, bound)
            if conn.pgconn.status != pq.ConnStatus.OK:  # as psycopg says a lost session
                raise psycopg.OperationalError(result.get_error_message(conn.info.encoding))
            if result.status != pq.ExecStatus.TUPLES_OK:
                raise error_from_result(result, encoding=conn.info.encoding)
        except psycopg.Error:
            self.close()
            raise
        loader = Transformer.from_context(conn)
        loader.set_pgresult(result)
        names = [(result.fname(i) or b"").decode() for i in range(result.nfields)]
        rows = loader.load_rows(0, result.ntuples, tuple)
        return [dict(zip(names, values, strict=True)) for values in rows]

    def close(self) -> None:
        conn, self._conn = self._conn, None
        self._names.clear()
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:  # a broken connection may not close cleanly
                log.debug("closing the idle claim connection: %s", exc)

    def _execute(self, pgconn: pq.abc.PGconn, bound: Bound) -> pq.abc.PGresult:
        if not self.prepared:
            return pgconn.exec_params(bound.sql, bound.params, bound.types, bound.formats)
        key = (bound.sql, bound.types)
        name = self._names.get(key)
        if name is None:
            name = b"jobq_direct_%d" % len(self._names)
            prepared = pgconn.prepare(name, bound.sql, bound.types)
            if prepared.status != pq.ExecStatus.COMMAND_OK:
                raise error_from_result(prepared)
            self._names[key] = name
        return pgconn.exec_prepared(name, bound.params, bound.formats)
