"""A broken engine without touching what is installed: a ``sitecustomize.py`` that changes a vLLM
module right after it is imported, in every process whose ``PYTHONPATH`` starts with its folder
(the API server, the EngineCore, ratebench's feature-off comparison). Test fixtures, never shipped."""

from __future__ import annotations

import textwrap


def break_on_import(targets: dict[str, str], marker: str) -> str:
    """A sitecustomize that runs ``targets[name]`` (the body of ``_break(module)``) right after the
    module ``name`` is imported."""
    breakers = "\n".join(
        f"def _break_{i}(module):\n" + textwrap.indent(textwrap.dedent(body), "    ")
        + f"\n    print({marker!r}, file=sys.stderr, flush=True)\n"
        for i, body in enumerate(targets.values()))
    table = ", ".join(f"{name!r}: _break_{i}" for i, name in enumerate(targets))
    return textwrap.dedent('''
        """Test fixture of tests/mutants/hooks.py: a broken vLLM. Never shipped."""
        import importlib.abc
        import importlib.util
        import queue
        import sys
        import time
    ''') + breakers + textwrap.dedent(f'''

        _TARGETS = {{{table}}}


        class _BreakOnImport(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name not in _TARGETS or getattr(self, "busy", False):
                    return None
                self.busy = True
                try:
                    spec = importlib.util.find_spec(name)
                finally:
                    self.busy = False
                exec_module = spec.loader.exec_module
                breaker = _TARGETS.pop(name)

                def exec_then_break(module):
                    exec_module(module)
                    breaker(module)

                spec.loader.exec_module = exec_then_break
                return spec


        sys.meta_path.insert(0, _BreakOnImport())
    ''')
