"""shadowtrace hooks: capture an inference engine's tensors and write shadowtrace runs.

Importing this package costs nothing: engines are patched only by `activate`, which the
startup hook calls when SHADOWTRACE is set. The writing layer (`writer`), the trace format
(`format`) and the environment (`config`) are usable on their own.
"""

__version__ = "0.1.0"
