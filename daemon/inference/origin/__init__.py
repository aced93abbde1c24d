"""The origin of a request: the pure core that decides (`core`), the request's state around
it (`request`) and the asyncio runtime that carries its decisions out (`runtime`)."""
