"""Resumable profiling: measured grid points survive an interrupted run.

``<profile>.partial.jsonl`` next to the output: the first line is the run's *identity*
(everything that decides what a grid point measures — model, device, engine, ladder,
workload, measurement settings), each further line one finished grid point, appended and
fsync'd as soon as it is measured. A restarted run with the same identity skips the grid
points already there; a different identity is refused (mixing measurements of two set-ups
would fit nonsense) unless the caller asks to discard the old file. A line cut short by a
kill is the only damage tolerated, and only as the last line.
"""

from __future__ import annotations

import os
from pathlib import Path

from harvest.predict import strict_json
from harvest.predict.schema import GridPointRecord, grid_point_from_dict


class PartialRunError(RuntimeError):
    pass


def grid_key(record_or_fields) -> tuple:
    r = record_or_fields
    return (r.level, r.stage, r.phase, r.batch_size, r.context_length)


def partial_path(profile_path: str | Path) -> Path:
    path = Path(profile_path)
    return path.with_name(path.name + ".partial.jsonl")


class PartialRun:
    def __init__(self, path: str | Path, identity: dict):
        self.path = Path(path)
        # Normalised through JSON so that tuples compare equal to the lists read back.
        self.identity = strict_json.loads(strict_json.dumps_line(identity))
        self._file = None

    def open(self, restart: bool = False) -> list[GridPointRecord]:
        """Start or resume; returns the grid points already measured."""
        records: list[GridPointRecord] = []
        if self.path.exists() and restart:
            self.path.unlink()
        if self.path.exists():
            records = self._read()
            self._file = open(self.path, "a")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w")
            self._write_line(self.identity)
        return records

    def _read(self) -> list[GridPointRecord]:
        lines = self.path.read_text().splitlines()
        try:
            identity = strict_json.loads(lines[0]) if lines else None
        except ValueError as exc:
            raise PartialRunError(f"{self.path}: unreadable header ({exc}); pass --restart to discard it") from exc
        if identity != self.identity:
            differing = sorted(
                key for key in set(self.identity) | set(identity or {}) if (identity or {}).get(key) != self.identity.get(key)
            )
            raise PartialRunError(
                f"{self.path} holds an interrupted run with different settings ({', '.join(differing)}); "
                f"rerun with the same settings to resume it, or pass --restart to discard it"
            )
        records = []
        for number, line in enumerate(lines[1:], start=2):
            try:
                records.append(grid_point_from_dict(strict_json.loads(line), "record"))
            except ValueError as exc:
                if number == len(lines):  # cut short by a kill mid-write: drop it, re-measure that point
                    self._truncate_last_line(len(lines) - 1)
                    break
                raise PartialRunError(f"{self.path}: line {number}: {exc}; pass --restart to discard the file") from exc
        return records

    def _truncate_last_line(self, keep_lines: int) -> None:
        kept = self.path.read_text().splitlines()[:keep_lines]
        self.path.write_text("".join(line + "\n" for line in kept))

    def _write_line(self, value) -> None:
        self._file.write(strict_json.dumps_line(value) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def append(self, record: GridPointRecord) -> None:
        self._write_line(strict_json.to_jsonable(record))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> None:
        """The profile is written: the partial file is no longer needed."""
        self.close()
        self.path.unlink(missing_ok=True)
