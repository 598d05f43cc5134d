"""The wrapper code of a graph lowered for its code alone, kept on disk under Inductor's own key.

``compile_with_inductor(code_only=True)`` stops each graph's compile once its wrapper code exists
(a fractional ``memory_budget``'s base, ``verify_peak``'s pair without offloading): nothing is built
or loaded, so Inductor's FX graph cache saves nothing, and every process lowered the same graph
again. On the 12-block GPT at ``memory_budget=0.5`` with ``recompute="inductor"`` the second run's
first step took 28.3 s where Inductor's took 2.6 s, 14.8 s of it that lowering
(docs/results.md, thirtieth session).

``keeping_code(sink)``: while one graph is lowered for its code, Inductor's cache lookup
(``FxGraphCache.load_with_key``, called with the key ``FxGraphCache.prepare_key`` made from the graph,
its inputs, Inductor's config and torch's version) first reads the code kept under that key, and
gives it to ``sink`` (which stops the compile); the returned ``keep(code)`` keeps a code lowered
after a miss. The key is Inductor's, so the code comes back exactly where a whole compile would come
back from Inductor's own cache: not where that cache is off (``fx_graph_cache=False``) or bypassed,
and not for another graph, another config (fxoffload's changes to Inductor's lowering are in it:
``scheduler_runs._cache_key``, ``donated``) or another torch.

Private Inductor pieces (``FxGraphCache.load_with_key``, ``cache_dir``): torch 2.11 and 2.13 alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from torch._inductor.codecache import FxGraphCache
from torch._inductor.runtime.cache_dir_utils import cache_dir

log = logging.getLogger(__name__)

__all__ = ["keeping_code"]


def _path(key: str) -> str:
    return os.path.join(cache_dir(), "fxoffload-code", key[:3], f"{key}.py")


def _read(key: str) -> str | None:
    try:
        with open(_path(key), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _write(key: str, code: str) -> None:
    """Written whole or not at all (another process may read it meanwhile); never an error."""
    path = _path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=os.path.dirname(path), delete=False) as f:
            f.write(code)
        os.replace(f.name, path)
    except OSError as e:
        log.debug("fxoffload: the code of graph key %s was not kept (%s)", key, e)


@contextlib.contextmanager
def keeping_code(sink: Callable[[str], None]) -> Iterator[Callable[[str], None]]:
    """See the module's text. ``sink(code)`` must stop the compile (raise); ``keep(code)``, called
    with the code lowered inside, keeps it under the key Inductor looked up (nothing where none was)."""
    original = FxGraphCache.load_with_key
    keys: list[str] = []

    def load_with_key(key: str, *args: Any, **kwargs: Any) -> Any:
        keys.append(key)
        code = _read(key)
        if code is not None:
            log.debug("fxoffload: the code of graph key %s read back", key)
            sink(code)
        return original(key, *args, **kwargs)

    def keep(code: str) -> None:
        if keys:
            _write(keys[-1], code)

    FxGraphCache.load_with_key = staticmethod(load_with_key)  # type: ignore[method-assign]
    try:
        yield keep
    finally:
        FxGraphCache.load_with_key = staticmethod(original)  # type: ignore[method-assign]
