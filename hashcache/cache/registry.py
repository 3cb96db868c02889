"""The file registry: the SQLite path table (id -> path, device, inode) next to the cache file,
and the open descriptors of the files entries point into. A file replaced or deleted under
its path no longer matches its row, so its entries miss without reading anything."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
from collections.abc import Iterator

from hashcache.cache.format import (
    _MAX_DEAD_IDS,
    _MAX_OPEN_FILES,
    CACHE_MODE,
    CacheError,
    _s64,
    narrow_mode,
)
from hashcache.cache.state import CacheState
from hashcache.errors import HashcacheError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY,
    path TEXT NOT NULL UNIQUE,
    dev INTEGER NOT NULL,
    ino INTEGER NOT NULL,
    primed_size INTEGER,
    primed_mtime_ns INTEGER
);
"""


def _open_paths_db(db_path: str, cache_uuid: str) -> sqlite3.Connection:
    """Open (or create) the path table; reset it if it belonged to an earlier cache file."""
    try:
        # made (or narrowed) to its owner's alone before SQLite opens it: SQLite gives the -wal and -shm files
        # the database file's mode, and the table names every indexed file
        os.close(os.open(db_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, CACHE_MODE))
        for suffix in ("", "-wal", "-shm"):
            narrow_mode(db_path + suffix)
        db = sqlite3.connect(db_path, timeout=30.0, isolation_level=None, check_same_thread=False)
    except OSError as e:
        raise CacheError(f"hash cache path table {db_path}: cannot open: {e.strerror or e}") from e
    except sqlite3.Error as e:
        raise CacheError(f"hash cache path table {db_path}: cannot open: {e}") from e
    try:
        for attempt in range(50):
            try:
                if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:  # another process is switching it right now
                if "locked" not in str(e) or attempt == 49:
                    raise
                time.sleep(0.02)
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE key = 'cache_uuid'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta (key, value) VALUES ('cache_uuid', ?)", (cache_uuid,))
            elif row[0] != cache_uuid:
                # Left over from a deleted cache file: its ids mean nothing to this one.
                db.execute("DELETE FROM files")
                db.execute("UPDATE meta SET value = ? WHERE key = 'cache_uuid'", (cache_uuid,))
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
    except sqlite3.DatabaseError as e:
        db.close()
        raise CacheError(
            f"hash cache path table {db_path}: {e}; delete it (and the cache file next to it) and it is "
            "recreated empty on the next use"
        ) from e
    return db


class FileRegistry(CacheState):
    """Part of :class:`HashCache`: the path table and open files."""

    def file_id(self, path: str | os.PathLike[str]) -> int:
        """The path table id of a regular file (registered if new). OSError if it cannot be stat'ed."""
        with self._lock:
            self._check_open()
            real = os.path.abspath(os.fspath(path))  # not realpath: one lstat per component
            st = os.stat(real)
            if not stat.S_ISREG(st.st_mode):
                raise HashcacheError(f"{real}: not a regular file; only regular files can be cached")
            try:
                return self._register(real, st)
            except sqlite3.Error as e:
                raise CacheError(f"hash cache path table {self.paths_path}: cannot register {real}: {e}") from e

    def forget_path(self, path: str | os.PathLike[str]) -> bool:
        """Drop a path from the path table: its entries miss from now on (e.g. before deleting it)."""
        with self._lock:
            self._check_open()
            real = os.path.abspath(os.fspath(path))
            row = self._db.execute("SELECT id FROM files WHERE path = ?", (real,)).fetchone()
            self._path_ids.pop(real, None)
            if row is None:
                return False
            self._drop_file(row[0], delete_row=False)
            with self._tx():
                self._db.execute("DELETE FROM files WHERE id = ?", (row[0],))
            return True

    def _register(self, real: str, st: os.stat_result) -> int:
        dev, ino = _s64(st.st_dev), _s64(st.st_ino)
        known = self._path_ids.get(real)
        if known is not None and known[1] == dev and known[2] == ino:
            return known[0]
        row = self._db.execute("SELECT id, dev, ino FROM files WHERE path = ?", (real,)).fetchone()
        if row is None or (row[1], row[2]) != (dev, ino):
            with self._tx():
                row = self._db.execute("SELECT id, dev, ino FROM files WHERE path = ?", (real,)).fetchone()
                if row is not None and (row[1], row[2]) != (dev, ino):
                    # Another file now lives at this path: the old id's entries must miss.
                    self._db.execute("DELETE FROM files WHERE id = ?", (row[0],))
                    self._drop_file(row[0], delete_row=False)
                    row = None
                if row is None:
                    row = (self._insert_row(real, dev, ino), dev, ino)
        fid: int = row[0]
        self._path_ids[real] = (fid, dev, ino)
        self._files[fid] = (real, dev, ino)
        self._dead.discard(fid)
        return fid

    def _insert_row(self, real: str, dev: int, ino: int) -> int:
        """A new path-table row for ``real`` under a random unused id (in the caller's transaction)."""
        while True:
            fid = self._rng.getrandbits(32)
            if not fid:
                continue
            try:
                self._db.execute("INSERT INTO files (id, path, dev, ino) VALUES (?, ?, ?, ?)", (fid, real, dev, ino))
            except sqlite3.IntegrityError:
                if self._db.execute("SELECT 1 FROM files WHERE path = ?", (real,)).fetchone():
                    raise  # pragma: no cover - impossible inside the write transaction
                continue  # id taken: draw another
            return fid

    def _file_info(self, fid: int) -> tuple[str, int, int] | None:
        info = self._files.get(fid)
        if info is None:
            try:
                row = self._db.execute("SELECT path, dev, ino FROM files WHERE id = ?", (fid,)).fetchone()
            except sqlite3.Error:
                return None
            if row is None:
                return None
            info = self._files[fid] = (row[0], row[1], row[2])
        return info

    def _drop_file(self, fid: int, delete_row: bool) -> None:
        """The file behind ``fid`` is gone or replaced: forget it (and, if asked, its row)."""
        fd = self._fds.pop(fid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        info = self._files.pop(fid, None)
        if len(self._dead) >= _MAX_DEAD_IDS:
            self._dead.clear()
        self._dead.add(fid)
        if info is not None:
            known = self._path_ids.get(info[0])
            if known is not None and known[0] == fid:
                del self._path_ids[info[0]]
            if delete_row:
                with contextlib.suppress(sqlite3.Error):  # best effort: the row only costs a stat
                    self._db.execute("DELETE FROM files WHERE id = ? AND dev = ? AND ino = ?", (fid, info[1], info[2]))

    def _fd_for(self, fid: int, validated: set[int]) -> int | None:
        """An open descriptor on the file ``fid`` names, if that file is still the one registered."""
        if fid in self._dead:
            return None
        info = self._file_info(fid)
        if info is None:  # no such row: the file was forgotten or replaced (or the entry is garbage)
            self._drop_file(fid, delete_row=False)
            return None
        path, dev, ino = info
        fds = self._fds
        fd = fds.get(fid)
        if fd is not None:
            if fid not in validated:
                try:
                    st = os.stat(path)
                except OSError:
                    st = None
                if st is None or _s64(st.st_dev) != dev or _s64(st.st_ino) != ino:
                    self._drop_file(fid, delete_row=True)
                    return None
                validated.add(fid)
            fds.move_to_end(fid)
            return fd
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            self._drop_file(fid, delete_row=True)
            return None
        except OSError:
            return None  # unreadable for now (permissions, EMFILE): a miss, not an invalidation
        try:
            st = os.fstat(fd)
        except OSError:  # pragma: no cover
            os.close(fd)
            return None
        if not stat.S_ISREG(st.st_mode) or _s64(st.st_dev) != dev or _s64(st.st_ino) != ino:
            os.close(fd)
            self._drop_file(fid, delete_row=True)
            return None
        fds[fid] = fd
        validated.add(fid)
        while len(fds) > _MAX_OPEN_FILES:
            _, old = fds.popitem(last=False)
            with contextlib.suppress(OSError):
                os.close(old)
        return fd

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise CacheError(f"hash cache path table {self.paths_path}: {e}") from e
        try:
            yield
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
