"""Keep a TLS connection's record buffers: no large allocation per write or read.

Why: CPython creates every ``ssl.SSLContext`` with OpenSSL's ``SSL_MODE_RELEASE_BUFFERS``,
so each connection frees its ~17 KB read and write buffers whenever they empty and
allocates them again for the next record. On a lane (:mod:`meshd.inference.transport.lanes`) that is
an allocation per frame, and with glibc's malloc it is an expensive one on the thread that
just ran a forward pass: the pass freed thousands of small blocks into that thread's
fastbins, and glibc coalesces them all before it serves the next large request (0.6-0.7 ms
of CPU on a 2-core x86_64 VM, ``perf record``). A token sent from a last stage's
compute thread paid exactly that in its ``send``. With the buffers kept, a token's send
allocates nothing large, and the coalescing runs later (measured: docs/performance.md).

How: Python has no API for the mode, so :func:`keep_record_buffers` clears the bit with
``SSL_CTX_ctrl(ctx, SSL_CTRL_CLEAR_MODE, SSL_MODE_RELEASE_BUFFERS)`` on the context's
``SSL_CTX``, found through ctypes: the ``_ssl`` module's own OpenSSL (a lookup through its
handle resolves in the libraries it links), and the pointer CPython keeps right after the
object's header (``PySSLContext.ctx``, unchanged from CPython 3.7 to 3.14). Guarded: only
on CPython, only where the symbols resolve, and only when the pointer reads back as that
context (the ``SSL_CTX``'s verify mode matches the object's); anything else leaves the
context as it was and says so. It changes no security property: the buffers hold the same
bytes for longer, in the process that owns them. The memory cost is the two buffers per
connection, ~34 KB, for as long as it is open.
"""

from __future__ import annotations

import ctypes
import logging
import ssl
import sys
from collections.abc import Callable

log = logging.getLogger("meshd.tls")

SSL_CTRL_MODE = 33  # SSL_CTX_set_mode(ctx, 0) returns the mode (it ORs in nothing)
SSL_CTRL_CLEAR_MODE = 78
SSL_MODE_RELEASE_BUFFERS = 0x10
# SSL_CTX_get_verify_mode() for each of ssl's modes (CERT_REQUIRED: SSL_VERIFY_PEER |
# SSL_VERIFY_FAIL_IF_NO_PEER_CERT), to tell the context's SSL_CTX from anything else.
_VERIFY_MODES = {
    ssl.CERT_NONE: 0,
    ssl.CERT_OPTIONAL: 1,
    ssl.CERT_REQUIRED: 3,
}


def keep_record_buffers(context: ssl.SSLContext) -> bool:
    """Make the connections ``context`` creates from now on keep their record buffers;
    whether they do now (False: the context is unchanged, the reason is logged at debug).
    Call it before the context makes a connection: each takes the mode when it is made."""
    found = _context_pointer(context)
    if found is None:
        log.debug("TLS record buffers stay released per record: no SSL_CTX reachable here")
        return False
    ctrl, pointer = found
    ctrl(pointer, SSL_CTRL_CLEAR_MODE, SSL_MODE_RELEASE_BUFFERS, None)
    if ctrl(pointer, SSL_CTRL_MODE, 0, None) & SSL_MODE_RELEASE_BUFFERS:
        log.debug("TLS record buffers stay released per record: OpenSSL kept the mode")
        return False
    return True


def releases_record_buffers(context: ssl.SSLContext) -> bool | None:
    """Whether ``context`` has OpenSSL's release-buffers mode (None: cannot be read here)."""
    found = _context_pointer(context)
    if found is None:
        return None
    ctrl, pointer = found
    return bool(ctrl(pointer, SSL_CTRL_MODE, 0, None) & SSL_MODE_RELEASE_BUFFERS)


def _context_pointer(context: ssl.SSLContext) -> tuple[Callable[..., int], int] | None:
    """``SSL_CTX_ctrl`` and the context's ``SSL_CTX *``, checked, or None."""
    if sys.implementation.name != "cpython" or not (3, 7) <= sys.version_info < (3, 15):
        return None  # PySSLContext's layout is known for these
    try:
        import _ssl

        if not isinstance(context, _ssl._SSLContext):
            return None
        library = ctypes.CDLL(_ssl.__file__)
        ctrl = library.SSL_CTX_ctrl
        get_verify_mode = library.SSL_CTX_get_verify_mode
    except (ImportError, OSError, AttributeError):  # no _ssl file, or a build that hides them
        return None
    ctrl.restype = ctypes.c_long
    ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    get_verify_mode.restype = ctypes.c_int
    get_verify_mode.argtypes = [ctypes.c_void_p]
    pointer = ctypes.c_void_p.from_address(id(context) + object.__basicsize__).value
    if not pointer or get_verify_mode(pointer) != _VERIFY_MODES.get(context.verify_mode):
        return None  # not this context's SSL_CTX: leave it alone
    return ctrl, pointer
