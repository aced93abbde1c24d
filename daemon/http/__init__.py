"""HTTP on every daemon: OpenAI-, Anthropic- and Ollama-compatible APIs and the dashboard.

The server (hypercorn, Starlette) runs on the daemon's asyncio thread, next to grpc.aio
and the request path; `meshd.http.backend` is the one place that calls into the node, so
every API here only translates requests and answers.
"""
