"""The benchmark harness: ``python -m benchmarks`` lists the suite, ``python -m benchmarks NAME ARGS...``
runs one (``ARGS`` go to the benchmark; ``NAME --help`` shows them).

A Python benchmark runs in this process (its ``module:function`` called with ``ARGS``); a shell one
(``same_result``, ``smollm_tool_warmstart``) runs under bash. Each writes its own result through
:func:`benchmarks.suite.write_result`; the registry, the common arguments and the result schema are
in :mod:`benchmarks.suite`.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

from benchmarks.suite import REGISTRY, ROOT, require_commit


def listing() -> str:
    width = max(map(len, REGISTRY))
    lines = [f"  {name:<{width}}  {b.description}" for name, b in sorted(REGISTRY.items())]
    return "\n".join(["usage: python -m benchmarks NAME [ARGS...]   (NAME --help: its arguments)", "",
                      "benchmarks:", *lines])


def run(name: str, argv: list[str]) -> int:
    if name not in REGISTRY:
        print(f"no benchmark named {name!r}; the suite:\n{listing()}", file=sys.stderr)
        return 2
    bench = REGISTRY[name]
    if not {"-h", "--help"} & set(argv):
        require_commit()  # the tree this run measures, read before it starts (a result must name it)
    if bench.is_shell:
        return subprocess.run(["bash", str(ROOT / bench.target), *argv], cwd=ROOT).returncode
    module, function = bench.target.split(":")
    return getattr(importlib.import_module(module), function)(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
