"""Type stub of ``nbdkit``: the module nbdkit's Python plugin host gives the plugin it embeds
(diskserver/plugin.py); not on PyPI, no stubs of its own. Only what the plugin uses
(nbdkit-python-plugin(3))."""

THREAD_MODEL_SERIALIZE_CONNECTIONS: int
THREAD_MODEL_SERIALIZE_ALL_REQUESTS: int
THREAD_MODEL_SERIALIZE_REQUESTS: int
THREAD_MODEL_PARALLEL: int

CACHE_NONE: int
CACHE_EMULATE: int
CACHE_NATIVE: int

EXTENT_HOLE: int
EXTENT_ZERO: int

def set_error(err: int) -> None: ...
def debug(msg: str) -> None: ...
