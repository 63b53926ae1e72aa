"""Progress of long loops, readable both on a terminal and in logs/<step>.log, and where a training
loop reports its metrics (Logger).

    with progress(len(items), "capture", "sample") as bar:
        for batch in batches:
            ...
            bar.update(len(batch))
            bar.set_postfix(loss=f"{loss:.3f}")

On a terminal (the process's real stderr, sys.__stderr__, is a TTY) this is a tqdm bar, written
to sys.stderr. Anywhere else (Snakemake, a batch job, a pipe) it writes plain lines to sys.stderr,
one every DRAFTPORT_PROGRESS_SECONDS seconds (default 5; 0: at every update) and one at the end
(unless the last one already showed the final count), never a carriage return:

    train: 40/60 step (67%), 12.3 s, 3.2 step/s, eta 6.2 s, loss=4.1

The step runner writes stdout/stderr both to the terminal and to logs/<step>.log; on a terminal
the bar's carriage-return updates reach the log too, and `LogWriter`, the log side of that Tee,
collapses them to a line every few seconds.
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from typing import IO, Any, Callable

from tqdm import tqdm

ENV_SECONDS = "DRAFTPORT_PROGRESS_SECONDS"
DEFAULT_SECONDS = 5.0


def interval_seconds(default: float = DEFAULT_SECONDS) -> float:
    """DRAFTPORT_PROGRESS_SECONDS as a float >= 0; `default` when unset or not a number."""
    raw = os.environ.get(ENV_SECONDS, "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        return default
    return v if math.isfinite(v) and v >= 0 else default


def on_terminal() -> bool:
    """Whether the process's real stderr is a terminal (not sys.stderr: the runner's Tee
    replaces that, and pytest's capture too)."""
    err = sys.__stderr__
    try:
        return err is not None and err.isatty()
    except (ValueError, OSError):  # closed or detached
        return False


def progress(
    total: int | None,
    desc: str,
    unit: str = "it",
    *,
    enabled: bool = True,
    initial: int = 0,
    leave: bool = True,
    file: IO[str] | None = None,
) -> Progress:
    """A context manager with .update(n=1), .set_postfix(**kw) and .close().

    total: the count at the end (None: unknown, no percentage). initial: the count to start from
    (a resumed run), not included in the rate. enabled=False: does nothing. leave: keep the bar on
    the terminal when done (tqdm's leave; plain lines always end with a final line). file: where
    to write (default: sys.stderr at the time of the call).
    """
    if not enabled:
        return Progress()
    out = file if file is not None else sys.stderr
    if on_terminal():
        return _Bar(total, desc, unit, initial=initial, leave=leave, file=out)
    return _Lines(total, desc, unit, initial=initial, interval=interval_seconds(), file=out)


class Progress:
    """The interface of what progress() returns; this base does nothing (enabled=False)."""

    n: int = 0

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kw: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Bar(Progress):
    """tqdm, for a terminal."""

    def __init__(self, total, desc, unit, *, initial, leave, file):
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=leave, file=file, dynamic_ncols=True)

    @property
    def n(self) -> int:  # type: ignore[override]
        return self._bar.n

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def set_postfix(self, **kw: Any) -> None:
        self._bar.set_postfix(**kw)

    def close(self) -> None:
        self._bar.close()


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def _rate(r: float, unit: str) -> str:
    if r >= 100:
        return f"{r:,.0f} {unit}/s"
    if r >= 1 or r == 0:
        return f"{r:.1f} {unit}/s"
    return f"{1 / r:.1f} s/{unit}"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class _Lines(Progress):
    """Plain timed lines, for a log: no carriage returns. Updates may come from several threads
    (a callback handed to a worker pool)."""

    def __init__(self, total, desc, unit, *, initial, interval, file, clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.n = self.initial = int(initial)
        self._file, self._clock = file, clock
        self._t0 = self._last = clock()
        self._postfix: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._shown = None  # (n, postfix) of the last line written

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
            now = self._clock()
            if now - self._last >= self.interval:
                self._last = now
                self._write(self.line(now))
                self._shown = (self.n, self._postfix)

    def set_postfix(self, **kw: Any) -> None:
        with self._lock:
            self._postfix = dict(kw)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._shown != (self.n, self._postfix):  # else the last line already says it
                self._write(self.line(self._clock(), final=True))

    def line(self, now: float | None = None, final: bool = False) -> str:
        elapsed = (self._clock() if now is None else now) - self._t0
        parts = [
            f"{self.desc}: {self.n}/{self.total} {self.unit}"
            if self.total is not None
            else f"{self.desc}: {self.n} {self.unit}"
        ]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(_duration(elapsed))
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 else 0.0
        parts.append(_rate(rate, self.unit))
        if not final and self.total is not None and rate > 0 and self.n < self.total:
            parts.append(f"eta {_duration((self.total - self.n) / rate)}")
        parts.extend(f"{k}={_value(v)}" for k, v in self._postfix.items())
        return ", ".join(parts)

    def _write(self, line: str) -> None:
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except (ValueError, OSError):  # the stream went away (closed at shutdown): progress is optional
            pass


_TOKENS = re.compile(r"(\r|\n)")


class LogWriter:
    """A text stream for a log file that keeps complete lines and collapses carriage-return
    updates (what tqdm writes on a terminal: "\\r<bar>" again and again on one line).

    Intended use: the log side of the step runner's Tee, which sends stdout/stderr both to the
    terminal and to logs/<step>.log:

        log_fh = open(a.log, "w")
        log = LogWriter(log_fh)
        sys.stdout, sys.stderr = Tee(sys.__stdout__, log), Tee(sys.__stderr__, log)
        ...
        finally:
            ...
            log.close()     # writes a pending last state, then closes log_fh

    The terminal keeps its live bar; the log gets, of a run of "\\r" updates on one line, at
    most one line every `interval_s` seconds (default DRAFTPORT_PROGRESS_SECONDS, else 5) and
    always the last state before the newline (or before the bar was wiped with blanks, as tqdm
    does with leave=False). Lines without "\\r" pass through unchanged, each once complete.
    flush() flushes the file but does not write a partial line (tqdm flushes after every
    update); close() does.
    """

    def __init__(self, fh: IO[str], interval_s: float | None = None, *, clock: Callable[[], float] = time.monotonic):
        self.fh = fh
        self.interval = interval_seconds() if interval_s is None else float(interval_s)
        self._clock = clock
        self._cur = ""  # the text since the last \r or \n
        self._state = None  # the last complete \r-state not yet written, if any
        self._in_cr = False  # the current line has seen a \r
        self._last = -math.inf  # when a \r-state was last written
        self._lock = threading.Lock()
        self.closed = False

    # the bits of the io.TextIOBase interface callers look at
    encoding = "utf-8"

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with self._lock:
            for tok in _TOKENS.split(s):
                if tok == "\n":
                    self._newline()
                elif tok == "\r":
                    self._carriage_return()
                elif tok:
                    self._cur += tok
        return len(s)

    def _emit(self, text: str) -> None:
        self.fh.write(text + "\n")

    def _carriage_return(self) -> None:
        if self._cur.strip():
            self._state = self._cur
            now = self._clock()
            if now - self._last >= self.interval:
                self._emit(self._state)
                self._state, self._last = None, now
        elif self._state is not None:  # the bar was wiped: keep what it showed last
            self._emit(self._state)
            self._state = None
        self._cur = ""
        self._in_cr = True

    def _newline(self) -> None:
        if self._cur.strip() or not self._in_cr:
            self._emit(self._cur)  # an ordinary line, or the last state of a \r run
        elif self._state is not None:  # "\r<state>\r\n" or "<state>\r   \n"
            self._emit(self._state)
        self._cur, self._state, self._in_cr = "", None, False

    def flush(self) -> None:
        with self._lock:
            self.fh.flush()

    def close(self) -> None:
        """Write what is pending (a last state, a line without its newline), then close fh."""
        with self._lock:
            if self.closed:
                return
            if self._cur.strip() or (self._cur and not self._in_cr):
                self._emit(self._cur)
            elif self._state is not None:
                self._emit(self._state)
            self._cur, self._state, self._in_cr = "", None, False
            self.closed = True
            self.fh.close()


class Logger:
    """Where a training loop reports its metrics (draftport.training.loop): nowhere by default;
    pipeline.tracking.PhaseRun (MLflow) plugs in behind the same two methods."""

    def log_params(self, params: dict) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int) -> None:
        pass
