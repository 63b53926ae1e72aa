"""progress(): a tqdm bar on a terminal, timed plain lines elsewhere; LogWriter: the log side of
the step runner's Tee, collapsing carriage-return updates."""

import io
import os
import sys
import time

import pytest
from tqdm import tqdm

from draftport import progress


@pytest.fixture
def no_tty(monkeypatch):
    """The process's real stderr is not a terminal (as under Snakemake)."""
    monkeypatch.setattr(sys, "__stderr__", io.StringIO())


@pytest.fixture
def tty(monkeypatch):
    """The process's real stderr is a terminal: a pseudo-terminal's slave end."""
    master, slave = os.openpty()
    fh = os.fdopen(slave, "w")
    monkeypatch.setattr(sys, "__stderr__", fh)
    yield
    fh.close()
    os.close(master)


def test_plain_lines_come_at_the_interval_and_once_at_the_end(no_tty, monkeypatch):
    monkeypatch.setenv(progress.ENV_SECONDS, "0.2")
    buf = io.StringIO()
    n = 10_000
    t0 = time.perf_counter()
    with progress.progress(n, "train", "step", file=buf) as bar:
        for i in range(n):
            bar.update()
            if i % 1000 == 0:
                bar.set_postfix(loss=f"{4 - i / n:.3f}")
            # ~1 s in all: sleep only when ahead of the schedule (few, short sleeps)
            wait = t0 + (i + 1) * 1e-4 - time.perf_counter()
            if wait > 0.005:
                time.sleep(wait)
    seconds = time.perf_counter() - t0
    out = buf.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    # one line per 0.2 s (the updates come on time, at worst a little later) plus the final one
    assert 2 <= len(lines) <= seconds / 0.2 + 2, lines
    assert lines[-1].startswith("train: 10000/10000 step (100%), ")
    assert "step/s" in lines[-1] and lines[-1].endswith("loss=3.100")
    assert "eta" in lines[0] and "eta" not in lines[-1]


def test_interval_zero_writes_every_update(no_tty, monkeypatch):
    monkeypatch.setenv(progress.ENV_SECONDS, "0")
    buf = io.StringIO()
    with progress.progress(3, "capture", "sample", file=buf) as bar:
        for _ in range(3):
            bar.update(2)
    lines = buf.getvalue().splitlines()
    assert [ln.split(",")[0] for ln in lines] == [
        "capture: 2/3 sample (67%)",
        "capture: 4/3 sample (133%)",
        "capture: 6/3 sample (200%)",
    ]  # no repeat at the end


def test_unknown_total_resume_and_disabled(no_tty, monkeypatch):
    monkeypatch.setenv(progress.ENV_SECONDS, "0")
    buf = io.StringIO()
    with progress.progress(None, "regenerate", file=buf) as bar:
        bar.update(5)
    assert buf.getvalue().splitlines()[-1].startswith("regenerate: 5 it, ")
    buf = io.StringIO()
    with progress.progress(10, "train", "step", initial=8, file=buf) as bar:
        bar.update()
    assert buf.getvalue().splitlines()[-1].startswith("train: 9/10 step (90%), ")
    buf = io.StringIO()
    with progress.progress(10, "train", enabled=False, file=buf) as bar:
        bar.update(3)
        bar.set_postfix(loss=1.0)
    assert buf.getvalue() == ""


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv(progress.ENV_SECONDS, raising=False)
    assert progress.interval_seconds() == 5.0
    for raw, want in (("0", 0.0), ("2.5", 2.5), ("soon", 5.0), ("-1", 5.0), ("nan", 5.0)):
        monkeypatch.setenv(progress.ENV_SECONDS, raw)
        assert progress.interval_seconds() == want


def test_terminal_gets_a_tqdm_bar(tty):
    buf = io.StringIO()
    with progress.progress(5, "train", "step", file=buf) as bar:
        assert isinstance(bar._bar, tqdm)
        for _ in range(5):
            bar.update()
        bar.set_postfix(loss="1.000")
    assert "\r" in buf.getvalue() and "5/5" in buf.getvalue()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_logwriter_collapses_carriage_return_updates_and_keeps_the_last_state():
    fh, clock = io.StringIO(), Clock()
    log = progress.LogWriter(fh, 1.0, clock=clock)
    log.write("loading the target\n")
    for i in range(1, 1001):  # 10 s of updates, one per 10 ms, the way tqdm writes them
        clock.t += 0.01
        log.write(f"\rtrain: {i / 10:3.0f}%|{'#' * (i // 100):<10}| {i}/1000")
        log.flush()
    log.write("\n")
    log.write("train: done\n")
    out = fh.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    assert lines[0] == "loading the target" and lines[-1] == "train: done"
    bars = lines[1:-1]
    assert 5 <= len(bars) <= 12, bars  # ~one per second, not 1000
    assert bars[-1].endswith("| 1000/1000")  # the state before the newline
    assert bars[0].endswith("| 1/1000")  # the first state, at once


def test_logwriter_with_a_real_tqdm_stream():
    fh = io.StringIO()
    log = progress.LogWriter(fh, 3600)  # at most the first state, then the final one
    for _ in tqdm(range(500), desc="capture", file=log, mininterval=0, miniters=1, ascii=True, ncols=80):
        pass
    print("capture: wrote 500 samples", file=log)
    lines = fh.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert "0/500" in lines[0] and "500/500" in lines[1] and lines[2] == "capture: wrote 500 samples"


class KeptIO(io.StringIO):
    def close(self):
        self.kept = self.getvalue()
        super().close()


def test_logwriter_keeps_a_wiped_bar_and_pending_text_on_close():
    fh, clock = KeptIO(), Clock()
    log = progress.LogWriter(fh, 10.0, clock=clock)
    log.write("\rstep 1/3")
    clock.t += 1
    log.write("\rstep 3/3")
    log.write("\r" + " " * 20 + "\r")  # tqdm(leave=False) wipes its bar
    log.write("next line\n")
    log.write("no newline yet")
    log.flush()
    assert fh.getvalue() == "step 1/3\nstep 3/3\nnext line\n"
    log.close()
    assert fh.closed and fh.kept.endswith("next line\nno newline yet\n")
    log2_fh = io.StringIO()
    log2 = progress.LogWriter(log2_fh, 10.0)
    log2.write("a\r\nb\n\n")
    assert log2_fh.getvalue() == "a\nb\n\n"
