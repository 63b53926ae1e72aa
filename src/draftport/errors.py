"""One error type the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations

import os


class DraftportError(Exception):
    """A problem with the user's input: printed as one line, never as a traceback."""

    def __init__(self, where: str | os.PathLike | None, problem: str):
        self.where = str(where) if where is not None else None
        self.problem = problem
        super().__init__(f"{self.where}: {problem}" if self.where else problem)
