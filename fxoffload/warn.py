"""Warnings said at the user's line: the first frame outside fxoffload, torch and Python's own
library (the call of the compiled model, or its ``backward``), not a frame of the compiler.

Everything fxoffload warns about happens inside ``torch.compile``'s frames (a compile, a re-plan,
the first steps' watch), where ``stacklevel`` cannot reach the caller: a budget not met pointed at
``fxoffload/compiler/compile.py``. Python's filters work as for any warning (``-W``,
``warnings.filterwarnings``); each is said once per line of the user's code, as Python's default.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from types import FrameType

import torch

__all__ = ["warn", "user_frame"]

def _dir(path: str) -> str:
    return os.path.join(os.path.abspath(path), "")


_PACKAGES = (_dir(os.path.dirname(__file__)), _dir(os.path.dirname(torch.__file__)))
_STDLIB = _dir(sysconfig.get_paths()["stdlib"])
# Installed packages are the user's code here (a trainer's loop), even where they sit inside the
# standard library's folder (a system Python's site-packages).
_SITE = tuple({_dir(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")})


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The first of ``frame`` and its callers that is neither fxoffload's, torch's or Python's own,
    nor called by fxoffload or torch (the code Inductor generated, a hook): None when there is none
    (a thread of the copy engine, say)."""
    while frame is not None and (_internal(frame) or (frame.f_back is not None and _ours(frame.f_back))):
        frame = frame.f_back
    return frame


def _path(frame: FrameType) -> str:
    return os.path.abspath(frame.f_code.co_filename)


def _ours(frame: FrameType) -> bool:
    """fxoffload's or torch's."""
    return _path(frame).startswith(_PACKAGES)


def _internal(frame: FrameType) -> bool:
    if frame.f_code.co_filename.startswith("<"):  # code made at run time: Dynamo's, a frozen module
        return True
    path = _path(frame)
    return path.startswith(_PACKAGES) or (path.startswith(_STDLIB) and not path.startswith(_SITE))


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)``, said at the user's line (``user_frame``)."""
    frame = user_frame(sys._getframe(1))
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    # Not ``module_globals``: its loader may not serve the module's name (``python -m pkg.mod`` runs as
    # __main__ with pkg.mod's loader, which then raised ImportError); the line is read from the file.
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message, category, frame.f_code.co_filename, frame.f_lineno, module=module_globals.get("__name__"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )  # fmt: skip
