"""Which other web origins may call the HTTP APIs from a browser (CORS), as the `cors_origins`
setting says, and the preflight and response headers that let them.

Closed by default: a page of another site (an `Origin` that is not this server) is refused
with 403 and its preflight too, and no CORS header is ever sent, so a page a user happens to
open cannot drive the mesh. An operator allows the apps they use by pattern, as Ollama's
OLLAMA_ORIGINS does: `http://localhost:*` (a dev server on any port), `app://*`,
`https://chat.example.com`; `*` stands for any run of characters within the origin, and `*`
alone allows every site. An allowed origin's preflight is answered without an API key
(browsers never send one on a preflight); its actual requests need one wherever every request
does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp

# scheme://host[:port], each part possibly with wildcards; no path, query or whitespace.
ORIGIN_PATTERN = re.compile(r"\*|[a-z*][a-z0-9+.\-*]*://[^/?#\s]+")
ALLOWED_METHODS = ("GET", "POST")
# What a page may read of an answer beyond the safelisted headers: a 429's wait.
EXPOSED_HEADERS = ("Retry-After",)
PREFLIGHT_MAX_AGE_S = 600


def parse_origin_pattern(value: str) -> str:
    """One `cors_origins` entry, lower-cased and without a trailing slash; ValueError says
    what an origin looks like."""
    text = value.strip().lower().removesuffix("/")
    if not ORIGIN_PATTERN.fullmatch(text):
        raise ValueError(
            f"{value!r} is not a web origin: use SCHEME://HOST[:PORT] with * for any part "
            "(http://localhost:*, app://*, https://chat.example.com), or * for every site"
        )
    return text


def origins_regex(patterns: Sequence[str]) -> str | None:
    """One regular expression that fully matches the origins `patterns` allow (None: none)."""
    if not patterns:
        return None
    alternatives = (re.escape(pattern).replace(r"\*", r"[^/\s]*") for pattern in patterns)
    return "(?i)" + "|".join(f"(?:{alternative})" for alternative in alternatives)


class OriginPolicy:
    """The allowed origins (see the module docstring); `allows` answers for one `Origin`."""

    def __init__(self, patterns: Sequence[str] = ()) -> None:
        self.patterns = tuple(parse_origin_pattern(pattern) for pattern in patterns)
        regex = origins_regex(self.patterns)
        self._regex = re.compile(regex) if regex else None

    def __bool__(self) -> bool:
        return self._regex is not None

    def allows(self, origin: str) -> bool:
        return self._regex is not None and self._regex.fullmatch(origin) is not None

    def is_preflight(self, method: str, headers: Headers) -> bool:
        """An allowed origin's CORS preflight (answered by the middleware, without a key)."""
        return (
            method == "OPTIONS"
            and "access-control-request-method" in headers
            and self.allows(headers.get("origin", ""))
        )

    def let_read(self, response: Response, origin: str) -> None:
        """Let an allowed origin's page read `response` (a refusal made before the CORS
        middleware: a missing key), so that it can tell its user why."""
        if origin and self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """`app` with CORS headers for the allowed origins (unchanged when none is)."""
        if self._regex is None:
            return app
        return CORSMiddleware(
            app,
            allow_origin_regex=self._regex.pattern,
            allow_methods=ALLOWED_METHODS,
            allow_headers=["*"],  # the SDKs send their own (x-stainless-*, anthropic-version)
            allow_private_network=True,  # a public site's page calling this machine's loopback
            expose_headers=EXPOSED_HEADERS,
            max_age=PREFLIGHT_MAX_AGE_S,
        )
