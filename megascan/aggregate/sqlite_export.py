"""The merged trace as an SQLite database, for questions a timeline answers slowly ("which rank's
recvs from stage 2 took longest?"). Times are global microseconds, as in MergedTrace. Tables and
columns: docs/megascan_aggregate.md."""

from __future__ import annotations

import math
import sqlite3

from megascan.aggregate.merged_trace import MergedTrace
from megatron.training.atomic_file import replaced_on_success

_SCHEMA = """
CREATE TABLE ranks (rank INTEGER PRIMARY KEY, dp INTEGER, pp INTEGER, tp INTEGER, host TEXT,
                    device_index INTEGER, device_name TEXT, residual_us REAL, drift_ppm REAL);
CREATE TABLE events (rank INTEGER, name TEXT, cat TEXT, iteration INTEGER, microbatch INTEGER,
                     chunk INTEGER, layer INTEGER, start_us REAL, end_us REAL);
CREATE TABLE ops (instance_id INTEGER, rank INTEGER, op TEXT, kind TEXT, grp TEXT, role TEXT, seq INTEGER,
                  peer INTEGER, bytes INTEGER, dtype TEXT, iteration INTEGER, microbatch INTEGER,
                  chunk INTEGER, phase TEXT, start_us REAL, end_us REAL);
"""
_INDEXES = """
CREATE INDEX ops_by_instance ON ops (instance_id);
CREATE INDEX ops_by_rank ON ops (rank, start_us);
CREATE INDEX events_by_rank ON events (rank, start_us);
"""


def _number(value):
    return None if value is None or math.isnan(value) else value


def _rank_rows(merged):
    for rank, trace in merged.ranks.items():
        clock = trace.clock
        yield (rank, trace.coords["dp"], trace.coords["pp"], trace.coords["tp"], trace.host, trace.device_index,
               trace.device_name, _number(clock.residual_us), clock.drift_ppm)


def _event_rows(merged):
    for rank, trace in merged.ranks.items():
        for e in trace.events:
            yield rank, e.name, e.cat, e.iteration, e.microbatch, e.chunk, e.layer, e.start, e.end


def _op_rows(merged):
    for instance in merged.instances:
        for rank, r in instance.records.items():
            # kind is the record's own (collective, send or recv): it says which side of a p2p this is
            yield (instance.id, rank, r.op, r.kind, instance.group, instance.role, instance.seq, r.peer, r.bytes,
                   r.dtype, r.iteration, r.microbatch, r.chunk, r.phase, r.start, r.end)


def write_sqlite(merged: MergedTrace, path: str) -> None:
    """Writes tables ranks, events and ops to a new database at ``path`` (atomically)."""
    with replaced_on_success(path) as temporary:
        connection = sqlite3.connect(temporary)
        try:
            connection.executescript(_SCHEMA)
            connection.executemany("INSERT INTO ranks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", _rank_rows(merged))
            connection.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", _event_rows(merged))
            connection.executemany("INSERT INTO ops VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                   _op_rows(merged))
            connection.executescript(_INDEXES)  # after the rows: one sort instead of an update per row
            connection.commit()
        finally:
            connection.close()
